"""DFlash: the target's layer taps match HF's hidden_states, the drafter runs inside the step with
greedy output equal to plain decoding, its context cache follows the committed prefix, and
drafters that do not fit the target are refused by name."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DRAFT_GREEDY as GREEDY
from helpers import DRAFTER, HF_FIXTURES, assert_greedy_equals_plain, drafter_spec
from flax import nnx
from safetensors import safe_open

from models.layers import Batch
from models.qwen3_5 import ForwardOut, init_cache
from spec_jax.loading import load_model
from spec_jax.writing.random_checkpoint import write_dflash_checkpoint

@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory):
    return write_dflash_checkpoint(tmp_path_factory.mktemp("dflash"), DRAFTER, seed=2)


def spec(d, k=3):
    return drafter_spec("dflash", d, k)


@pytest.mark.parametrize("case", ["dense_vl", "moe_vl"])
def test_layer_taps_are_hfs_hidden_states(case):
    ref = np.load(HF_FIXTURES / case / "reference.npz")
    model, cfg = load_model(HF_FIXTURES / case, "float32")
    ids = jnp.asarray(ref["input_ids"])[None]
    L = cfg.num_hidden_layers
    out = model(ids, Batch(jnp.zeros(1, jnp.int32), jnp.asarray([32])), init_cache(cfg, 1, 64, jnp.float32),
                kv_len=32, taps=tuple(range(L)))
    assert isinstance(out, ForwardOut)
    taps = np.asarray(out.taps[0]).reshape(32, L, -1).transpose(1, 0, 2)  # [L, T, H]
    want = ref["hidden_states"]  # HF: layer i's output at i; the last one after the final norm
    for i in range(L - 1):
        assert np.linalg.norm(taps[i] - want[i]) / np.linalg.norm(want[i]) < 1e-5
    last = np.asarray(model.norm(jnp.asarray(taps[-1])))
    assert np.linalg.norm(last - want[-1]) / np.linalg.norm(want[-1]) < 1e-5


def test_checkpoint_uses_z_labs_names(dflash_dir):
    with safe_open(str(dflash_dir / "model.safetensors"), "numpy") as f:
        names = set(f.keys())
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
                 "layers.0.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight",
                 "layers.1.input_layernorm.weight"):
        assert name in names
    cfg = json.loads((dflash_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["target_layer_ids"] == [1, 4, 6]


def test_greedy_equals_plain_alone_and_in_a_mixed_batch(tiny_llm, plain_greedy, dflash_dir):
    llm = tiny_llm.with_speculation(spec(dflash_dir))
    assert_greedy_equals_plain(llm, plain_greedy)
    assert llm.metrics["num_draft_tokens"] > 0 and len(llm.metrics["acceptance_per_position"]) == 3


def test_context_cache_holds_the_committed_prefix(tiny_llm, dflash_dir):
    """After several steps, the drafter's context K/V equals what a fresh pass over the whole
    committed sequence gives (rejected positions were overwritten or are past the length)."""
    llm = tiny_llm.with_speculation(spec(dflash_dir))
    # in the batch bucket the greedy test compiled: row 0 is the prompt, the others padding
    state, do_sample, _ = llm.engine.start([[3, 1, 4, 1, 5, 9, 2, 6]], [GREEDY])
    state = llm.engine.decode(state, 4, do_sample)
    n = int(state.lengths[0]) - 1  # committed positions
    model, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    out = model(state.tokens[:1, :n], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([n])),
                init_cache(model.cfg, 1, n, jnp.float32), kv_len=n, taps=DRAFTER.target_layer_ids)
    k, v = draft.context_kv(out.taps, jnp.arange(n)[None])
    (ctx,) = state.proposer  # one full-attention run, K/V head-major [layers, B, kv, L, d]
    for got, want in ((ctx.k[:, :1, :, :n], k), (ctx.v[:, :1, :, :n], v)):
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5


def test_fewer_drafts_are_the_full_blocks_first(tiny_llm, dflash_dir):
    """A step that verifies n < k drafts scores only the first n positions of the same block."""
    llm = tiny_llm.with_speculation(spec(dflash_dir))
    state, _, _ = llm.engine.start([[3, 1, 4, 1, 5, 9, 2, 6]], [GREEDY], rows=1)
    model, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    proposer = llm.engine.plan.proposer
    def choose(logits, pos):
        return jnp.argmax(logits, -1).astype(jnp.int32), None
    full, n_full, _, _ = proposer.propose(model, draft, state.proposer, state.tokens, state.lengths, choose)
    for n in (1, 2):
        fewer, n_fewer, _, _ = proposer.with_drafts(n).propose(model, draft, state.proposer, state.tokens,
                                                               state.lengths, choose)
        assert fewer.shape == (1, n) and int(n_fewer[0]) == n and int(n_full[0]) == 3
        np.testing.assert_array_equal(np.asarray(fewer), np.asarray(full[:, :n]))


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=32, num_attention_heads=2), "hidden_size 32 but the target has 64"),
    (dict(target_layer_ids=(1, 8)), "taps target layer 8, but the target has layers 0..7"),
    (dict(mask_token_id=600), "mask_token_id 600 outside the target's vocabulary of 512"),
])
def test_drafters_that_do_not_fit_are_refused(tiny_llm, tmp_path, change, message):
    d = write_dflash_checkpoint(tmp_path / "bad", dataclasses.replace(DRAFTER, **change))
    with pytest.raises(ValueError, match=message):
        tiny_llm.with_speculation(spec(d))


def test_k_must_match_the_block(tiny_llm, dflash_dir):
    with pytest.raises(ValueError,
                       match="num_speculative_tokens=5 but the DFlash drafter .* drafts block_size - 1 = 3"):
        tiny_llm.with_speculation(spec(dflash_dir, 5))


def test_an_unknown_drafter_architecture_is_refused(tiny_llm, dflash_dir, tmp_path):
    d = tmp_path / "d3"
    d.mkdir()
    cfg = json.loads((dflash_dir / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlash3DraftModel"]}))
    with pytest.raises(ValueError, match="unsupported drafter architecture 'DFlash3DraftModel'"):
        tiny_llm.with_speculation(spec(d))


def test_dflash_needs_its_model(tiny_llm):
    with pytest.raises(ValueError, match="'dflash' needs 'model'"):
        tiny_llm.with_speculation({"method": "dflash", "num_speculative_tokens": 3})
