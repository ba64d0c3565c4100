"""Tensor parallelism on four CPU devices. Run by test_tensor_parallel.py in a process of its own,
started with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the device count is fixed when
JAX starts, and the main test process has one): `pytest tests/e2e/tensor_parallel_cases.py`.

The target is split as `models/tensor_parallel.py` says; every check compares against the same
checkpoint on one device.
"""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import DRAFT_GREEDY, DRAFTER, FIXED_K, TINY, drafter_prompts, relative_error
from starlette.testclient import TestClient

from models.tensor_parallel import make_mesh
from spec_jax import LLM
from spec_jax.api.cli import main
from spec_jax.api.server import Server, build_app
from spec_jax.engine.config import EngineConfig
from spec_jax.engine.runner import Runner
from spec_jax.loading import load_model
from spec_jax.writing.convert import convert
from spec_jax.writing.gguf_writer import write_gguf
from spec_jax.writing.random_checkpoint import write_checkpoint, write_dflash_checkpoint

# Four KV heads and four GDN key heads: splits over 2 and 4 devices.
DENSE = dataclasses.replace(TINY, num_attention_heads=8, num_key_value_heads=4, head_dim=16, linear_num_key_heads=4,
                            linear_num_value_heads=8)
MOE = dataclasses.replace(DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=24)
IDS = np.arange(3, 40)
ARGS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=[4])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: write_checkpoint(tmp_path_factory.mktemp(name), cfg, seed=1)
            for name, cfg in (("dense", DENSE), ("moe", MOE))}


@pytest.fixture(scope="module")
def one_device_logits(checkpoints):
    return {name: LLM(str(d), **ARGS).engine.logits(IDS) for name, d in checkpoints.items()}


@pytest.fixture(scope="module")
def llm2(checkpoints):
    """The dense model over two devices."""
    return LLM(str(checkpoints["dense"]), tensor_parallel_size=2, **ARGS)


def test_four_devices_are_here():
    assert jax.device_count() == 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("n", [2, 4])
def test_logits_over_n_devices_equal_one_device(checkpoints, one_device_logits, name, n):
    llm = LLM(str(checkpoints[name]), tensor_parallel_size=n, **ARGS)
    assert relative_error(llm.engine.logits(IDS), one_device_logits[name]) < 1e-5
    gdn = llm.model.layers[0].linear_attn
    for weight, axis in ((gdn.in_proj_qkv.weight, 1), (gdn.out_proj.weight, 2), (llm.model.embed_tokens, 0)):
        w = weight[...]
        assert {s.data.shape[axis] for s in w.addressable_shards} == {w.shape[axis] // n}  # each device its slice


@pytest.mark.parametrize("spec", [{"method": "mtp", "num_speculative_tokens": 2}, "dflash"], ids=["mtp", "dflash"])
def test_greedy_speculation_equals_plain_under_tp(llm2, spec, tmp_path):
    if spec == "dflash":
        d = write_dflash_checkpoint(tmp_path / "dflash", DRAFTER, seed=2)
        spec = {"method": "dflash", "model": str(d), "num_speculative_tokens": 3, **FIXED_K}
    plain = [o.outputs[0].token_ids for o in llm2.generate(prompt_token_ids=drafter_prompts(),
                                                           sampling_params=DRAFT_GREEDY)]
    runner = llm2.with_speculation(spec)
    params = [DRAFT_GREEDY, dataclasses.replace(DRAFT_GREEDY, speculative=False), DRAFT_GREEDY]
    outs = runner.generate(prompt_token_ids=drafter_prompts(), sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert runner.metrics["num_draft_tokens"] > 0


def test_decode_layout_joins_projections_per_device(checkpoints, one_device_logits):
    llm = LLM(str(checkpoints["moe"]), tensor_parallel_size=2, **ARGS)  # its own copy: the layout is made in place
    engine = Runner(llm.model, None, EngineConfig(max_model_len=128, layout="decode"), llm.mesh)
    fused = llm.model.groups[0][0].linear_attn.fused.weight[...]  # [qkv | z | b | a], grouped by device
    assert {s.data.shape[0] for s in fused.addressable_shards} == {fused.shape[0] // 2}
    assert relative_error(engine.logits(IDS), one_device_logits["moe"]) < 1e-5


def test_quantized_projections_split_like_their_weights(checkpoints):
    want = LLM(str(checkpoints["dense"]), quantization="fp8", **ARGS).engine.logits(IDS)
    got = LLM(str(checkpoints["dense"]), quantization="fp8", tensor_parallel_size=2, **ARGS).engine.logits(IDS)
    assert relative_error(got, want) < 1e-5


def test_every_format_loads_each_devices_slice(checkpoints, one_device_logits, tmp_path):
    src = checkpoints["dense"]
    convert(src, tmp_path / "orbax", dtype="float32")
    gguf = write_gguf(src, tmp_path / "m.gguf")
    mesh = make_mesh(2)
    for path in (src, tmp_path / "orbax", gguf):
        model, _ = load_model(path, "float32", mesh=mesh)
        qkv = model.layers[0].linear_attn.in_proj_qkv.weight[...]
        assert qkv.sharding.mesh == mesh and qkv.addressable_shards[0].data.shape[1] == qkv.shape[1] // 2, path
        logits = Runner(model, None, EngineConfig(max_model_len=128), mesh).logits(IDS)
        assert relative_error(logits, one_device_logits["dense"]) < 1e-5, path


def test_sizes_the_devices_do_not_divide_are_refused(tmp_path):
    three = dataclasses.replace(DENSE, num_attention_heads=12, num_key_value_heads=3)  # 4 is no multiple of 3
    d = write_checkpoint(tmp_path / "three", three)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 does not divide num_key_value_heads=3: .* or a "
                                         "multiple of it"):
        LLM(str(d), tensor_parallel_size=4, **ARGS)
    d = write_checkpoint(tmp_path / "tiny", TINY)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must be an integer from 1 to the 4 cpu device"):
        LLM(str(d), tensor_parallel_size=8, **ARGS)


def test_the_cli_and_the_server_take_tensor_parallel_size(llm2, checkpoints, capsys):
    want = llm2.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=DRAFT_GREEDY)[0].outputs[0].token_ids
    rc = main(["generate", "--model", str(checkpoints["dense"]), "--dtype", "float32", "--prompt-token-ids", "1,2,3",
               "--max-tokens", "30", "--ignore-eos", "--max-model-len", "128", "--max-num-seqs", "4", "--batch-buckets",
               "4", "--tensor-parallel-size", "2"])  # llm2's shapes: its programs, from the compilation cache
    assert rc in (None, 0) and str(want) in capsys.readouterr().out
    with TestClient(build_app(Server(llm2, served_model_name="tp"))) as client:
        r = client.post("/v1/completions", json={"model": "tp", "prompt": [1, 2, 3], "max_tokens": 30, "temperature": 0,
                                                 "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want


def test_prefix_caching_under_tp(checkpoints):
    """Prefix caching over two devices, with the host tier: a hit (blocks copied back to the
    devices with their sharding) gives bitwise the state of a miss, and greedy tokens equal one
    device's."""
    from spec_jax.engine.prefix_cache import PrefixCache

    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 500, 100).tolist()
    spec = {"method": "mtp", "num_speculative_tokens": 2, **FIXED_K}
    want = LLM(str(checkpoints["dense"]), speculative_config=spec, **ARGS).generate(
        prompt_token_ids=[prompt], sampling_params=DRAFT_GREEDY)[0].outputs[0].token_ids
    llm = LLM(str(checkpoints["dense"]), tensor_parallel_size=2, enable_prefix_caching=True, speculative_config=spec,
              **ARGS)
    seeded = dataclasses.replace(DRAFT_GREEDY, seed=1)  # states compare whole
    llm.engine.prefix_cache = PrefixCache("no hits", 64, 0)
    miss = llm.prefill([prompt], [seeded])
    llm.engine.prefix_cache = store = PrefixCache("tiered", 64, 1, host_budget_bytes=10**10)  # device keeps none
    llm.prefill([prompt], [seeded])
    hit = llm.prefill([prompt], [seeded])
    assert store.host_hits == 64
    for x, y in zip(jax.tree.leaves(miss), jax.tree.leaves(hit)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.array_equal(np.asarray(x), np.asarray(y))
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=DRAFT_GREEDY)[0].outputs[0].token_ids
    assert out == want


def test_batch_invariant_under_tp(checkpoints):
    """The batch-invariant mode over two devices: greedy MTP gives plain decoding's tokens and
    logprobs exactly, alone and in a mixed batch."""
    llm = LLM(str(checkpoints["dense"]), tensor_parallel_size=2, batch_invariant=True, **ARGS)
    params = dataclasses.replace(DRAFT_GREEDY, logprobs=1)

    def run(llm, params):
        outs = llm.generate(prompt_token_ids=drafter_prompts(), sampling_params=params)
        return [(o.outputs[0].token_ids, [[(t, x.logprob) for t, x in e.items()] for e in o.outputs[0].logprobs])
                for o in outs]

    plain = run(llm, params)
    speculating = llm.with_speculation({"method": "mtp", "num_speculative_tokens": 2, **FIXED_K})
    assert run(speculating, [params, dataclasses.replace(params, speculative=False), params]) == plain
