"""GGUF targets: HF checkpoints written as GGUF by spec_jax.writing.gguf_writer (llama.cpp's names and
transforms), loaded back by spec_jax.loading.gguf, against the safetensors originals."""

import dataclasses
import functools
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import HF_FIXTURES, TINY, relative_error
from flax import nnx

from models.layers import Batch
from models.qwen3_5 import init_cache, init_mtp_cache
from spec_jax import LLM, SamplingParams
from spec_jax.loading import load_model
from spec_jax.loading.gguf import gguf_tokenizer, reorder_v_heads
from spec_jax.loading.source import CheckpointError
from spec_jax.writing.gguf_writer import write_gguf
from spec_jax.writing.random_checkpoint import write_checkpoint


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    T = tokens.shape[1]
    hidden = model(tokens, Batch(jnp.zeros(1, jnp.int32), jnp.asarray([T])), init_cache(model.cfg, 1, T, jnp.float32),
                   kv_len=T).hidden
    if model.mtp is None:
        return model.logits(hidden)[0], None
    # draft row p: token p+1 at position p with the target's hidden at p, as test_mtp pairs them
    h, _ = model.mtp(model.embed(tokens[:, 1:]), hidden[:, :-1], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([T - 1])),
                     init_mtp_cache(model.cfg, 1, T, jnp.float32), kv_len=T - 1)
    return model.logits(hidden)[0], model.logits(h)[0]


def forward(model, ids) -> tuple[np.ndarray, np.ndarray | None]:
    """(target logits [T, V], MTP logits [T-1, V] or None), one compilation per config."""
    graphdef, state = nnx.split(model)
    logits, mtp = _forward(graphdef, state, jnp.asarray(ids, jnp.int32)[None])
    return np.asarray(logits), None if mtp is None else np.asarray(mtp)


def params_of(model) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    return {jax.tree_util.keystr(k): np.asarray(v, np.float32) for k, v in leaves}


# dense and MoE (VL-wrapped, MoE sharded with fused experts) with MTP heads; Qwen3-Next with its fused
# in_proj_qkvz / in_proj_ba and one tensor per expert. All written by HF transformers, every weight random.
# moe_vl is written a second time with fused `ffn_gate_up_exps` experts.
@pytest.mark.parametrize("case, fused", [("dense_vl", False), ("moe_vl", False), ("moe_vl", True), ("next", False)])
def test_f32_gguf_equals_safetensors(case, fused, tmp_path):
    src = HF_FIXTURES / case
    ref = np.load(src / "reference.npz")
    model, cfg = load_model(src, "float32")
    path = write_gguf(src, tmp_path / "m.gguf", fused_experts=fused)
    assert ("blk.0.ffn_gate_up_exps.weight" in {t.name for t in gguf.GGUFReader(path).tensors}) == fused
    got, got_cfg = load_model(path, "float32")
    assert got_cfg == cfg
    want, want_mtp = forward(model, ref["input_ids"])
    logits, mtp = forward(got, ref["input_ids"])
    assert relative_error(logits, want) < 1e-5
    assert relative_error(logits, ref["logits"]) < 1e-4
    assert (mtp is None) == (case == "next")  # the Next fixture has no MTP head
    if mtp is not None:
        assert relative_error(mtp, want_mtp) < 1e-5
        assert relative_error(mtp, ref["mtp_logits"]) < 1e-4


def test_moe_tensors_are_named_as_llama_cpp_names_them(tmp_path):
    """The routed and shared experts carry gguf-py's table names plus ".weight", as llama.cpp's
    convert_hf_to_gguf.py writes them (blk.N.ffn_gate_exps.weight, not blk.N.ffn_gate_exps)."""
    path = write_gguf(HF_FIXTURES / "moe_vl", tmp_path / "m.gguf")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    T = gguf.MODEL_TENSOR
    for tensor in (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP, T.FFN_GATE_INP, T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP,
                   T.FFN_DOWN_SHEXP, T.FFN_GATE_INP_SHEXP):
        assert gguf.TENSOR_NAMES[tensor].format(bid=0) + ".weight" in names
    assert not any(name.endswith("_exps") for name in names)


def test_value_heads_are_tiled_as_llama_cpp_stores_them():
    grouped = np.arange(6)  # 2 key heads with 3 value heads each: value head g*3 + j
    tiled = reorder_v_heads(grouped, 0, dataclasses.replace(TINY, linear_num_value_heads=6), 1, to_tiled=True)
    assert tiled.tolist() == [0, 3, 1, 4, 2, 5]  # position j*2 + g holds value head g*3 + j
    back = reorder_v_heads(tiled, 0, dataclasses.replace(TINY, linear_num_value_heads=6), 1, to_tiled=False)
    assert back.tolist() == grouped.tolist()


# Rows of 256 so the K-quants apply; 3 value heads per key head (a reordering that is not its own
# inverse); out_proj rows of 384 fall back to Q8_0 in K-quant files.
WIDE = dataclasses.replace(TINY, hidden_size=256, intermediate_size=512, num_hidden_layers=4, layer_types=(),
                           head_dim=64, linear_num_value_heads=6, linear_key_head_dim=32, linear_value_head_dim=64)
# type -> (largest per-parameter relative error, logits relative error) against the f32 model;
# measured: f16 2e-4 / 1e-3, bf16 1.8e-3 / 1e-2, q8_0 5e-3 / 3e-2, q6_k 2e-2 / 0.1, q4_k 8e-2 / 0.4.
TOLERANCES = {"f16": (5e-4, 5e-3), "bf16": (4e-3, 3e-2), "q8_0": (1e-2, 0.1), "q6_k": (4e-2, 0.25), "q4_k": (0.12, 0.7)}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    d = write_checkpoint(tmp_path_factory.mktemp("wide"), WIDE, seed=5)
    model, _ = load_model(d, "float32")
    ids = np.random.default_rng(0).integers(0, WIDE.vocab_size, 24)
    return d, params_of(model), ids, forward(model, ids)[0]


@pytest.mark.parametrize("kind", list(TOLERANCES))
def test_quantized_gguf_within_tolerance_of_f32(kind, wide, tmp_path):
    d, want, ids, want_logits = wide
    path = write_gguf(d, tmp_path / f"m-{kind}.gguf", kind)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_qkv.weight"] == kind.upper() and types["blk.0.attn_norm.weight"] == "F32"
    assert types["blk.0.ssm_out.weight"] == ("Q8_0" if kind.endswith("_k") else kind.upper())  # rows of 384
    model, _ = load_model(path, "float32")
    worst = max(relative_error(v, want[k]) for k, v in params_of(model).items())
    assert worst < TOLERANCES[kind][0]
    assert relative_error(forward(model, ids)[0], want_logits) < TOLERANCES[kind][1]


# ----------------------------------------------------------------------------- LLM, CLI, tokenizer


@pytest.fixture(scope="module")
def dense_gguf(tmp_path_factory, tiny_dir):
    """tiny_dir as F32 GGUF, alone in a directory."""
    d = tmp_path_factory.mktemp("gguf")
    write_gguf(tiny_dir, d / "tiny.gguf")
    return d


def test_llm_generates_from_a_gguf_directory_as_from_safetensors(dense_gguf, tiny_llm):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = tiny_llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=params)[0].outputs[0].token_ids
    llm = LLM(model=str(dense_gguf), dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=[4])
    assert llm.model.mtp is not None and llm.cfg == tiny_llm.cfg
    assert llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=params)[0].outputs[0].token_ids == want


def test_cli_generates_from_a_gguf_file(dense_gguf, capsys):
    from spec_jax.api.cli import main

    assert main(["generate", "--model", str(dense_gguf / "tiny.gguf"), "--dtype", "float32", "--max-model-len", "256",
                 "--max-num-seqs", "4", "--prompt-token-ids", "5,6,7,8", "--max-tokens", "4"]) == 0
    assert "loaded" in capsys.readouterr().err


def test_mtp_on_a_gguf_without_nextn_is_refused(tiny_dir, tmp_path):
    path = write_gguf(tiny_dir, tmp_path / "no-mtp.gguf", mtp=False)
    model, cfg = load_model(path, "float32")
    assert model.mtp is None and cfg.mtp_num_hidden_layers == 0
    with pytest.raises(ValueError,
                       match=r"needs the target's MTP head.*a GGUF/safetensors export without the MTP head"):
        LLM(model=str(path), dtype="float32", max_model_len=256,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@pytest.mark.parametrize("pre", ["gpt2", "qwen35"])
def test_tokenizer_is_rebuilt_from_the_gguf_vocabulary(pre, tmp_path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from spec_jax.loading.gguf import PRE_TOKENIZER_PATTERNS

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre == "gpt2")
    tok.pre_tokenizer = byte_level if pre == "gpt2" else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS[pre]), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # café, naïve\n" * 20
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    src = shutil.copytree(HF_FIXTURES / "dense_text", tmp_path / "hf")
    tok.save(str(src / "tokenizer.json"))
    rebuilt = gguf_tokenizer(write_gguf(src, tmp_path / "out" / "m.gguf"))
    assert rebuilt is not None
    sample = "def fibonacci(k):  return k<|im_end|> über  \n\n x"
    ids = tok.encode(sample, add_special_tokens=False).ids
    assert rebuilt.encode(sample) == ids
    assert rebuilt.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)


# ----------------------------------------------------------------------------- broken files


@pytest.fixture
def broken(dense_gguf, tmp_path):
    """A fresh copy of the tiny F32 GGUF to damage."""
    return shutil.copy(dense_gguf / "tiny.gguf", tmp_path / "broken.gguf")


def test_wrong_magic(broken):
    with open(broken, "r+b") as f:
        f.write(b"GGUX")
    with pytest.raises(CheckpointError, match=r"cannot read GGUF file .*broken.gguf.*magic"):
        load_model(broken)


@pytest.mark.parametrize("keep", [0.6, 0.999, 0.001])
def test_truncated_file(broken, keep):
    data = open(broken, "rb").read()
    open(broken, "wb").write(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"broken.gguf.*truncated"):
        load_model(broken)


def edit_in_place(path, edit):
    reader = gguf.GGUFReader(path, "r+")
    edit(reader)
    reader.data.flush()


@pytest.mark.parametrize("shift, message", [(4, "not aligned"), (32, "overlaps tensor")])
def test_corrupted_tensor_offset(broken, shift, message):
    def move(reader):
        reader.tensors[3].field.parts[-1][0] += shift
    edit_in_place(broken, move)
    with pytest.raises(CheckpointError, match=message):
        load_model(broken)


def test_corrupted_tensor_data(broken):
    edit_in_place(broken, lambda reader: reader.tensors[5].data.reshape(-1).__setitem__(7, np.nan))
    with pytest.raises(CheckpointError, match=r"tensor .* holds NaN or inf"):
        load_model(broken)


def rename(reader, old: str, new: str):
    """Overwrite a string stored in the header with another of the same length."""
    raw = reader.data
    at = bytes(raw).find(old.encode())
    raw[at : at + len(old)] = np.frombuffer(new.encode(), np.uint8)


def test_unknown_architecture(broken):
    edit_in_place(broken, lambda reader: rename(reader, "qwen35", "llama3"))
    with pytest.raises(CheckpointError,
                       match="general.architecture 'llama3'; spec_jax loads qwen35, qwen35moe, qwen3next"):
        load_model(broken)


def test_missing_tensor_is_named(broken):
    edit_in_place(broken, lambda reader: rename(reader, "blk.2.ssm_alpha.weight", "blk.2.ssm_alpha.weighx"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk.2.ssm_alpha.weight'"):
        load_model(broken)


@pytest.mark.parametrize("key", ["qwen35.attention.key_length", "qwen35.ssm.time_step_rank"])
def test_zero_sizes_in_the_header_are_named(broken, key):
    def zero(reader):
        reader.fields[key].parts[-1][0] = 0
    edit_in_place(broken, zero)
    with pytest.raises(CheckpointError, match=rf"metadata {key} = 0 must be a positive integer"):
        load_model(broken)


def test_zero_full_attention_interval_is_named(broken):
    edit_in_place(broken, lambda reader: reader.fields["qwen35.full_attention_interval"].parts[-1].__setitem__(0, 0))
    with pytest.raises(CheckpointError, match="full_attention_interval=0 must be an integer >= 1"):
        load_model(broken)


def test_a_flipped_bit_in_a_header_string_is_named(broken):
    def flip(reader):
        field = reader.fields["general.architecture"]
        field.parts[-1][0] = 0xFF  # not UTF-8
    edit_in_place(broken, flip)
    with pytest.raises(CheckpointError, match="general.architecture.*cannot be read"):
        load_model(broken)
