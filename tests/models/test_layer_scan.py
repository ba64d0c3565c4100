"""On the GPU the engine runs the target and its drafters in their decode layout (every layer's
weights arrays of their own, layers unrolled); forced on here, the unstacked target, its MTP head,
a block drafter's and a Qwen3 draft model's unstacked layers and the speculative step reproduce the
rolled model's greedy output."""

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DSPARK, FIXED_K, HF_FIXTURES, TINY, assert_greedy_equals_plain
from flax import nnx

from bench.models import geometry_config, random_model, streamed_bytes
from models import layers
from models.layers import Batch
from models.qwen3_5 import Qwen3_5Config
from spec_jax import LLM
from spec_jax.writing.random_checkpoint import write_dflash_checkpoint


def test_unrolled_layers_reproduce_the_rolled_model(tiny_dir, plain_greedy):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=[4],
              layout="decode", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    assert llm.model.layers is None and len(llm.model.groups) == llm.cfg.num_groups  # the decode layout
    assert llm.model.mtp.layer is not None
    assert_greedy_equals_plain(llm, plain_greedy)


def test_block_drafter_decode_layout_reproduces_plain_greedy(tmp_path, tiny_dir, plain_greedy):
    """DSpark (the DFlash backbone plus the Markov head) with its layers unstacked and unrolled."""
    drafter = write_dflash_checkpoint(tmp_path, DSPARK, seed=2, layout="dspark")
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=[4],
              layout="decode",
              speculative_config={"method": "dspark", "model": str(drafter), "num_speculative_tokens": 4, **FIXED_K})
    _, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    assert draft.layers is None and len(draft.unstacked) == DSPARK.num_hidden_layers
    assert_greedy_equals_plain(llm, plain_greedy)


def test_qwen3_draft_model_decode_layout_reproduces_plain_greedy(tiny_dir, plain_greedy):
    drafter = HF_FIXTURES.parent / "qwen3"  # a plain Qwen3 checkpoint in the target's vocabulary
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=[4],
              layout="decode",
              speculative_config={"method": "draft_model", "model": str(drafter), "num_speculative_tokens": 2,
                                  **FIXED_K})
    _, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    assert draft.layers is None and len(draft.unstacked) == draft.cfg.num_hidden_layers
    assert_greedy_equals_plain(llm, plain_greedy)


def layout_config(moe: str | None) -> Qwen3_5Config:
    """moe: None (dense), "shared apart" (a shared expert of another size than the routed ones:
    kept as its own MLP) or "shared folded" (the same size: joined to the experts as expert E)."""
    shared = {"shared apart": 48, "shared folded": 32}
    extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=shared[moe]) if moe else {}
    # Two groups of two layers: the stacks are scanned over more than one repeat, and the unrolled
    # program is half the size of TINY's eight layers.
    return dataclasses.replace(TINY, num_hidden_layers=4, full_attention_interval=2, layer_types=(), **extra)


@pytest.mark.parametrize("moe", [None, "shared apart", "shared folded"])
def test_decode_layout_keeps_the_outputs_and_releases_the_stacks(moe):
    """Unstacked, projections joined: the same logits for a prompt, a decode step and a verify
    pass with rollback as the loaded (stacked) model, and no stacked array left alive."""
    cfg = layout_config(moe)
    model = random_model(cfg, "float32", verbose=False)
    stacked_weight = model.layers[0].linear_attn.in_proj_qkv.weight[...]
    probe = weakref.ref(stacked_weight)
    del stacked_weight
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)

    def run(m):
        gdef, state = nnx.split(m)
        return jax.jit(lambda state: passes(nnx.merge(gdef, state)))(state)

    def passes(m):
        cache = m.init_cache(2, 32)
        prefilled = m(prompt, Batch(jnp.zeros(2, jnp.int32), jnp.array([9, 6])), cache, kv_len=32)
        hidden, cache = prefilled.hidden, prefilled.cache
        decoded = m(prompt[:, :1], Batch(jnp.array([9, 6]), jnp.ones(2, jnp.int32)), cache, kv_len=32)
        step, cache = decoded.hidden, decoded.cache
        verified = m(prompt[:, :3], Batch(jnp.array([10, 7]), jnp.array([3, 2])), cache, kv_len=32, rollback="replay")
        verify = verified.hidden
        committed = m.commit(cache, verified.pending, jnp.array([2, 1]))
        return [m.logits(h) for h in (hidden, step, verify)] + jax.tree.leaves(committed)

    before = run(model)
    model.use_decode_layout()
    gc.collect()
    assert probe() is None  # the stack was released, not kept beside the new arrays
    assert model.layers is None and len(model.groups) == cfg.num_groups
    joined = model.groups[0][0].linear_attn
    rows = joined.fused.weight.shape[0]
    assert joined.in_proj_qkv is None and rows % 128 == 0 and 0 <= rows - sum(joined.fused_sizes) < 128
    if moe:
        block = model.groups[0][0].mlp
        assert block.gate is None and block.fused_sizes == (cfg.num_experts, 1)  # router and shared gate joined
        folded = moe == "shared folded"
        assert (block.shared_expert is None) == folded
        assert block.experts.gate_up_proj.shape[0] == cfg.num_experts + folded
    # float32; a joined matmul sums in another order than three separate ones
    for a, b in zip(before, run(model)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_bench_geometries_build_and_count_their_bytes():
    """bench.models: a geometry cut to a few layers builds on the device with every parameter
    random (norm weights too), and streamed_bytes leaves out the MTP head and the untied embedding."""
    cfg = geometry_config("tiny", layers=4)
    assert cfg.num_hidden_layers == 4 and cfg.layer_types[-1] == "full_attention"
    model = random_model(dataclasses.replace(cfg, tie_word_embeddings=False), "float32", verbose=False)
    norm = np.asarray(model.layers[0].input_layernorm.weight[...])
    assert norm.std() > 0.1  # random, not the constant a (1 + w) bug hides behind
    leaves = nnx.to_flat_state(nnx.state(model))
    total = sum(v[...].nbytes for _, v in leaves)
    skipped = sum(v[...].nbytes for path, v in leaves if path[0] in ("mtp", "embed_tokens"))
    assert streamed_bytes(model) == total - skipped


def test_long_prompts_attend_in_query_blocks(monkeypatch):
    """Past QUERY_BLOCK queries attention runs block by block, with the same result."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 64, n, 16)), jnp.float32) for n in (4, 2, 2))
    visible = jnp.asarray(rng.random((2, 64, 64)) < 0.7)
    whole = layers.attend_masked(q, k, v, visible)
    monkeypatch.setattr(layers, "QUERY_BLOCK", 16)
    np.testing.assert_allclose(np.asarray(layers.attend_masked(q, k, v, visible)), np.asarray(whole),
                               rtol=1e-6, atol=1e-6)
