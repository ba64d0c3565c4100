"""Qwen's FP8 and ModelOpt's NVFP4 checkpoints load quantized and run; `convert --quantization`.

Checkpoints come from our writer (spec_jax.writing.quantize_checkpoint) over random models. The published
layouts are checked against their specs with an independent numpy decoder (tensor names, dtypes,
scale shapes, nibble order, scale semantics); the quantized model must equal, to float rounding,
the float model loaded from that decoding; and its logits are compared with the unquantized
model's. Relative logit error ||l_q - l|| / ||l|| measured here: FP8 0.024 (seed 0), NVFP4 0.080
(seed 1); over seeds 0-3 FP8 0.024-0.062 and NVFP4 0.080-0.17.
"""

import fnmatch
import functools
import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from models.layers import Batch, Linear
from models.qwen3_5 import Qwen3_5Config, init_mtp_cache
from spec_jax import LLM, SamplingParams
from spec_jax.api.cli import main
from spec_jax.engine.config import EngineConfig
from spec_jax.engine.runner import Runner
from spec_jax.loading import load_model
from spec_jax.loading.quantized import QUANTIZED_PROJECTIONS, QuantizedSource, quantize_projections, read_quant_scheme
from spec_jax.loading.source import CheckpointError, canonical_name, param_sources
from spec_jax.writing.quantize_checkpoint import quantize_checkpoint
from spec_jax.writing.random_checkpoint import write_checkpoint

LOGIT_TOLERANCE = {"fp8": 0.1, "nvfp4": 0.3}  # relative logit error vs the unquantized model, ~2x the worst seen
CODES = {"fp8": ml_dtypes.float8_e4m3fn, "nvfp4": np.uint8}
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
OUT_SCALE = 0.25  # see `write_source`


def random_config(seed: int) -> Qwen3_5Config:
    """A tiny MoE model with every size drawn at random (input sizes multiples of 32 for NVFP4,
    but a shared expert of 48 sometimes, which NVFP4 must leave in bf16)."""
    rng = np.random.default_rng(seed)
    pick = lambda *xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    nk, kv, vocab = pick(1, 2), pick(1, 2), pick(256, 320, 384)
    return Qwen3_5Config(
        vocab_size=vocab, hidden_size=pick(64, 96), intermediate_size=pick(64, 96), num_hidden_layers=pick(4, 8),
        num_attention_heads=kv * pick(1, 2), num_key_value_heads=kv, head_dim=32, linear_num_key_heads=nk,
        linear_num_value_heads=nk * pick(1, 2), linear_key_head_dim=pick(16, 32), linear_value_head_dim=pick(32, 64),
        linear_conv_kernel_dim=pick(2, 4), rope_theta=pick(1e4, 1e6), partial_rotary_factor=pick(0.25, 0.5),
        max_position_embeddings=1024, tie_word_embeddings=pick(False, True), mtp_num_hidden_layers=1,
        num_experts=pick(3, 4), num_experts_per_tok=2, moe_intermediate_size=pick(32, 64),
        shared_expert_intermediate_size=pick(48, 64), eos_token_id=(vocab - 1,))


def write_source(out_dir, seed: int):
    """A random f32 checkpoint whose blocks write small updates into the residual stream, as trained
    ones do: at full random scale 1% weight noise already moves the logits ~20%, which would bury
    the quantization error under the random model's chaos."""
    cfg = random_config(seed)
    d = write_checkpoint(out_dir, cfg, seed=seed)
    tensors = load_file(str(d / "model.safetensors"))
    for name in tensors:
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")):
            tensors[name] = tensors[name] * OUT_SCALE
    save_file(tensors, str(d / "model.safetensors"))
    return d, cfg


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_source(tmp_path_factory.mktemp("src"), seed=0)


@pytest.fixture(scope="module", params=[("fp8", 0), ("nvfp4", 1)], ids=["fp8", "nvfp4"])
def quantized(request, source, tmp_path_factory):
    """(directory, format, unquantized source directory, config) of a written quantized checkpoint."""
    fmt, seed = request.param
    src, cfg = source if seed == 0 else write_source(tmp_path_factory.mktemp(f"src{seed}"), seed)
    return quantize_checkpoint(src, tmp_path_factory.mktemp(fmt), fmt), fmt, src, cfg


@pytest.fixture(scope="module")
def quantized_llm(quantized):
    return LLM(model=str(quantized[0]), dtype="float32", max_model_len=64, max_num_seqs=2)


def decode_by_spec(qdir, fmt: str) -> dict[str, np.ndarray]:
    """Every tensor of a written checkpoint, quantized weights decoded in numpy by the published
    rules (fp8: W = w * weight_scale_inv[r // 128, c // 128]; nvfp4: even column in the low nibble,
    W = e2m1 * weight_scale[r, c // 16] * weight_scale_2); scale tensors dropped."""
    src = QuantizedSource(qdir, read_quant_scheme(qdir))
    out = {}
    for name in src.names():
        module = name.removesuffix(".weight")
        if fmt == "fp8" and f"{module}.weight_scale_inv" in src:
            w, s = src.raw(name).astype(np.float32), src.raw(f"{module}.weight_scale_inv").astype(np.float32)
            out[name] = w * np.kron(s, np.ones((128, 128), np.float32))[: w.shape[0], : w.shape[1]]
        elif fmt == "nvfp4" and f"{module}.weight_scale_2" in src:
            packed = src.raw(name)
            codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
            values = np.where(codes & 8, -E2M1[codes & 7], E2M1[codes & 7])
            scale = np.repeat(src.raw(f"{module}.weight_scale").astype(np.float32), 16, axis=1)
            out[name] = values * scale * src.raw(f"{module}.weight_scale_2").astype(np.float32)
        elif not name.endswith(("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")):
            out[name] = src.raw(name).astype(np.float32)
    return out


def ignored(module: str, ignore: list[str]) -> bool:
    return any(fnmatch.fnmatch(module, canonical_name(p) or p) for p in ignore)


def test_written_checkpoint_has_the_published_layout(quantized):
    qdir, fmt, src, cfg = quantized
    config = json.loads((qdir / "config.json").read_text())["quantization_config"]
    stored = QuantizedSource(qdir, read_quant_scheme(qdir))
    dtype = lambda name: stored.files["model.safetensors"].get_slice(stored.location[name][1]).get_dtype()  # noqa: E731
    module = "model.layers.0.linear_attn.in_proj_qkv"
    N, K = cfg.conv_dim, cfg.hidden_size
    if fmt == "fp8":
        assert config == {**config, "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]}
        assert {"model.language_model.layers.0.linear_attn.in_proj_a", "model.language_model.layers.0.mlp.gate",
                "mtp.fc", "model.language_model.norm"} <= set(config["modules_to_not_convert"])
        assert (dtype(f"{module}.weight"), dtype(f"{module}.weight_scale_inv")) == ("F8_E4M3", "BF16")
        assert stored.shape(f"{module}.weight_scale_inv") == (-(-N // 128), -(-K // 128))
        assert "mtp.layers.0.mlp.experts.1.down_proj.weight_scale_inv" in stored
    else:
        legacy = json.loads((qdir / "hf_quant_config.json").read_text())["quantization"]
        assert (config["quant_method"], config["quant_algo"], legacy["quant_algo"], legacy["group_size"]) == (
            "modelopt", "NVFP4", "NVFP4", 16)
        assert config["ignore"] == legacy["exclude_modules"]
        assert {"model.language_model.layers.0.linear_attn.in_proj_b", "mtp*"} <= set(config["ignore"])
        assert [dtype(f"{module}.{t}") for t in ("weight", "weight_scale", "weight_scale_2", "input_scale")] == [
            "U8", "F8_E4M3", "F32", "F32"]
        assert (stored.shape(f"{module}.weight"), stored.shape(f"{module}.weight_scale"),
                stored.shape(f"{module}.weight_scale_2")) == ((N, K // 2), (N, K // 16), ())
        assert "model.layers.0.mlp.experts.1.down_proj.weight_scale_2" in stored
    # Decoded by the spec, every quantized weight is close to the original (a wrong nibble order
    # or an inverted scale would be off by ~100%).
    original, decoded = load_file(str(src / "model.safetensors")), decode_by_spec(qdir, fmt)
    assert "lm_head.weight" not in original or np.array_equal(decoded["lm_head.weight"], original["lm_head.weight"])
    w = original[f"model.language_model.{module[len('model.'):]}.weight"]
    err = np.linalg.norm(decoded[f"{module}.weight"] - w) / np.linalg.norm(w)
    assert err < {"fp8": 0.04, "nvfp4": 0.15}[fmt], err


def mtp_hidden(model, cfg) -> np.ndarray:
    """The MTP head's output for fixed random inputs (its layer is quantized in FP8 checkpoints)."""
    rng = np.random.default_rng(5)
    x, h = (jnp.asarray(rng.normal(size=(1, 6, cfg.hidden_size)), jnp.float32) for _ in range(2))
    batch = Batch(jnp.zeros(1, jnp.int32), jnp.asarray([6]))
    run = nnx.jit(lambda m: m.mtp(x, h, batch, init_mtp_cache(cfg, 1, 8, jnp.float32), kv_len=8)[0])
    return np.asarray(run(model))


def test_quantized_checkpoint_loads_quantized_and_computes_its_weights(quantized, quantized_llm, tmp_path):
    qdir, fmt, src, cfg = quantized
    model = quantized_llm.model
    ignore = read_quant_scheme(qdir).ignore
    formats = {}
    for path, m in nnx.iter_modules(model):
        if not isinstance(m, Linear):
            continue
        modules = [n.removesuffix(".weight") for n in param_sources((*path, "weight"), cfg)]
        quantizable = path[-1] in QUANTIZED_PROJECTIONS and not any(ignored(n, ignore) for n in modules)
        assert m.format == ({"fp8": "fp8_block", "nvfp4": "nvfp4"}[fmt] if quantizable else None), path
        assert m.weight[...].dtype == (CODES[fmt] if quantizable else np.float32), path
        formats.setdefault(path[-1], set()).add(m.format)
    assert formats["in_proj_a"] == formats["in_proj_b"] == formats["gate"] == formats["shared_expert_gate"] == {None}
    assert formats["fc"] == {None} and (cfg.tie_word_embeddings or model.lm_head.format is None)
    assert formats["in_proj_qkv"] == formats["out_proj"] == {model.layers[0].linear_attn.in_proj_qkv.format} != {None}
    assert (model.mtp.layers[0].self_attn.o_proj.format is None) == (fmt == "nvfp4")  # ModelOpt leaves the MTP block
    assert model.layers[0].mlp.experts.gate_up_proj[...].dtype == np.float32  # routed experts: dequantized at load

    # The quantized model is the float model whose weights are the spec's decoding, to float rounding.
    float_dir = tmp_path / "decoded"
    float_dir.mkdir()
    save_file(decode_by_spec(qdir, fmt), str(float_dir / "model.safetensors"))
    config = json.loads((qdir / "config.json").read_text())
    del config["quantization_config"]
    (float_dir / "config.json").write_text(json.dumps(config))
    decoded = load_model(float_dir, "float32")[0]
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, 40)
    logits = lambda m: Runner(m, None, EngineConfig(max_model_len=64)).logits(ids)  # noqa: E731
    quant = quantized_llm.logits(ids)
    np.testing.assert_allclose(quant, logits(decoded), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mtp_hidden(model, cfg), mtp_hidden(decoded, cfg), rtol=1e-5, atol=1e-5)

    reference = logits(load_model(src, "float32")[0])
    err = np.linalg.norm(quant - reference) / np.linalg.norm(reference)
    print(f"{fmt}: relative logit error {err:.4f} vs the unquantized model")
    assert 0 < err < LOGIT_TOLERANCE[fmt]


def test_greedy_generation_runs(quantized_llm):
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = quantized_llm.generate(prompt_token_ids=[[3, 1, 4, 1, 5], [9, 2, 6]], sampling_params=sp)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    # greedy: the first token is the argmax of the prompt's last logits
    assert outs[1].outputs[0].token_ids[0] == int(np.argmax(quantized_llm.logits([9, 2, 6])[-1]))


def test_convert_with_quantization_restores_the_quantized_model(source, tmp_path):
    src, cfg = source
    out = tmp_path / "int8"
    assert main(["convert", "--model", str(src), "--output", str(out), "--dtype", "float32", "--quantization",
                 "int8"]) == 0
    restored = LLM(model=str(out), dtype="float32", max_model_len=64)
    assert restored.model.layers[0].mlp.shared_expert.up_proj.weight[...].dtype == np.int8
    direct = quantize_projections(load_model(src, "float32")[0], "int8")
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 20)
    np.testing.assert_array_equal(restored.logits(ids),
                                  Runner(direct, None, EngineConfig(max_model_len=64)).logits(ids))


def test_converting_a_quantized_checkpoint_keeps_it_quantized(quantized, quantized_llm, tmp_path):
    qdir = quantized[0]
    out = tmp_path / "c"
    assert main(["convert", "--model", str(qdir), "--output", str(out), "--dtype", "float32"]) == 0
    restored = LLM(model=str(out), dtype="float32", max_model_len=64)
    def z_format(llm):
        return llm.model.layers[0].linear_attn.in_proj_z.format

    assert z_format(restored) == z_format(quantized_llm)
    ids = [5, 7, 11, 2]
    np.testing.assert_array_equal(restored.logits(ids), quantized_llm.logits(ids))


@pytest.mark.parametrize("quant_config, message", [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq'; spec_jax loads 'fp8' .* and 'modelopt'"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, r"quant_algo 'FP8'"),
])
def test_unsupported_quantization_is_refused_by_name(source, tmp_path, quant_config, message):
    d = shutil.copytree(source[0], tmp_path / "ckpt")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config}))
    with pytest.raises(CheckpointError, match=message):
        load_model(d)


@pytest.mark.parametrize("fmt, scale", [("fp8", "weight_scale_inv"), ("nvfp4", "weight_scale_2")])
def test_a_missing_scale_is_named(source, tmp_path, fmt, scale):
    d = quantize_checkpoint(source[0], tmp_path / fmt, fmt)
    src = QuantizedSource(d, read_quant_scheme(d))  # safetensors' numpy reader has no float8
    tensors = {stored: src.raw(canon) for canon, (_, stored) in src.location.items()}
    name = f"model.language_model.layers.{source[1].num_hidden_layers - 1}.self_attn.o_proj.{scale}"
    del tensors[name]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"missing tensor '{canonical_name(name)}'"):
        load_model(d)


def test_modelopt_legacy_hf_quant_config_alone_is_read(source, tmp_path):
    d = quantize_checkpoint(source[0], tmp_path / "nvfp4", "nvfp4")
    config = json.loads((d / "config.json").read_text())
    del config["quantization_config"]  # older ModelOpt exports carry only hf_quant_config.json
    (d / "config.json").write_text(json.dumps(config))
    model, _ = load_model(d)
    assert model.layers[0].linear_attn.in_proj_z.format == "nvfp4"


@pytest.mark.parametrize("quantized", [("nvfp4", 1)], ids=["nvfp4"], indirect=True)
def test_a_conversion_holding_modelopt_nibbles_restores_the_same(quantized, quantized_llm, tmp_path):
    """Directories converted before NVFP4 codes took the kernels' bit layout hold ModelOpt's nibbles
    and no `nvfp4_bits` in their marker: they restore to the same model. Unknown bit positions are
    refused by name."""
    import orbax.checkpoint as ocp

    from pallas_kernels.quant_formats import nvfp4_to_modelopt

    out = tmp_path / "c"
    assert main(["convert", "--model", str(quantized[0]), "--output", str(out), "--dtype", "float32"]) == 0
    marker = json.loads((out / "spec_jax.json").read_text())
    del marker["nvfp4_bits"], marker["files"]  # as such old directories were written
    params = ocp.StandardCheckpointer().restore((out / "params").absolute())
    for path, f in marker["quantized"].items():
        if f == "nvfp4":
            leaf = functools.reduce(lambda d, k: d[k], path.split("."), params)
            leaf["weight"] = nvfp4_to_modelopt(leaf["weight"])
    shutil.rmtree(out / "params")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((out / "params").absolute(), params)
    checkpointer.wait_until_finished()
    (out / "spec_jax.json").write_text(json.dumps(marker))
    ids = [5, 7, 11, 2]
    np.testing.assert_array_equal(LLM(model=str(out), dtype="float32", max_model_len=64).logits(ids),
                                  quantized_llm.logits(ids))
    marker["nvfp4_bits"] = [[0, 1, 2, 3], [4, 5, 6, 7]]
    (out / "spec_jax.json").write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"NVFP4 bit positions \[\[0, 1, 2, 3\]"):
        load_model(out, "float32")
