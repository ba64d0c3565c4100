"""`spec-jax convert` writes Orbax params that load back to the same model."""

import numpy as np
import pytest
from helpers import HF_FIXTURES

from spec_jax import LLM
from spec_jax.api.cli import main
from spec_jax.loading import load_model
from spec_jax.loading.source import CheckpointError
from spec_jax.writing.convert import convert


@pytest.mark.parametrize("case, dtype", [("moe_vl", "float32"), ("dense_vl", "bfloat16")])
def test_converted_checkpoint_gives_the_same_logits(tmp_path, case, dtype):
    out = tmp_path / "converted"
    assert main(["convert", "--model", str(HF_FIXTURES / case), "--output", str(out), "--dtype", dtype]) == 0
    assert (out / "spec_jax.json").exists() and (out / "params").is_dir()
    ids = np.load(HF_FIXTURES / case / "reference.npz")["input_ids"].tolist()
    original = LLM(model=str(HF_FIXTURES / case), dtype=dtype, max_model_len=64).logits(ids)
    restored = LLM(model=str(out), dtype=dtype, max_model_len=64)
    assert restored.model.mtp is not None
    np.testing.assert_array_equal(restored.logits(ids), original)


def test_restore_in_another_dtype_casts(tmp_path):
    out = tmp_path / "c"
    main(["convert", "--model", str(HF_FIXTURES / "dense_vl"), "--output", str(out), "--dtype", "float32"])
    model, _ = load_model(out, "bfloat16")
    assert str(model.embed_tokens[...].dtype) == "bfloat16"


def test_convert_refuses_a_non_empty_output(tmp_path, capsys):
    (tmp_path / "x").write_text("x")
    assert main(["convert", "--model", str(HF_FIXTURES / "dense_vl"), "--output", str(tmp_path)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_a_damaged_conversion_is_named(tmp_path):
    out = tmp_path / "c"
    main(["convert", "--model", str(HF_FIXTURES / "dense_vl"), "--output", str(out), "--dtype", "float32"])
    import shutil

    shutil.rmtree(out / "params")
    with pytest.raises(CheckpointError, match="is missing: the converted directory is damaged"):
        load_model(out)


def test_every_truncated_file_and_a_bad_marker_are_named(tmp_path):
    """The marker lists every file under params/ with its size: truncating any one of them is a
    CheckpointError naming it (TensorStore's own errors, where a file passes that check, are
    CheckpointErrors too); a marker of the wrong JSON type is one as well."""
    import json

    out = tmp_path / "c"
    main(["convert", "--model", str(HF_FIXTURES / "dense_vl"), "--output", str(out), "--dtype", "float32"])
    files = json.loads((out / "spec_jax.json").read_text())["files"]
    assert files and all((out / "params" / name).stat().st_size == size for name, size in files.items())
    for name, size in files.items():
        path = out / "params" / name
        data = path.read_bytes()
        path.write_bytes(data[: size // 2])
        with pytest.raises(CheckpointError, match=f"{name} was saved with {size} bytes and is {size // 2} bytes"):
            load_model(out)
        path.write_bytes(data)
    (out / "spec_jax.json").write_text("[]")
    with pytest.raises(CheckpointError, match="spec_jax.json holds a JSON list"):
        load_model(out)


def test_a_gguf_converts_and_restores_to_the_same_logits(tmp_path, tiny_dir):
    """GGUF Q8_0 is dequantized once by convert; the restore gives the GGUF's own logits."""
    from spec_jax.writing.gguf_writer import write_gguf

    gguf_file = write_gguf(tiny_dir, tmp_path / "src" / "tiny.gguf", "q8_0")
    convert(gguf_file, tmp_path / "out", "float32")
    ids = list(range(3, 40))
    direct = LLM(model=str(gguf_file), dtype="float32", max_model_len=64, max_num_seqs=1)
    restored = LLM(model=str(tmp_path / "out"), dtype="float32", max_model_len=64, max_num_seqs=1)
    assert restored.cfg == direct.cfg
    np.testing.assert_allclose(restored.logits(ids), direct.logits(ids), rtol=1e-5, atol=1e-5)
