"""The Pallas flash-attention kernel in interpret mode against `attend_masked` (XLA's masked
softmax): a prefill from slot 0, a block of queries in the middle of a longer cache (a prefix-cache
block pass), padding queries pointing past the cache, and GQA groups."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers import attend_masked
from pallas_kernels.attention_common import key_range
from pallas_kernels.flash_attention import (
    BLOCK_K,
    BLOCK_Q,
    BLOCKS,
    FIXED_ORDER,
    blocks_for,
    flash_attention_packed,
    flash_attention_pallas,
    kernel_fits,
    key_splits,
)


def random_qkv(seed, B, T, S, nq, nkv, d):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, nq, d)), jax.random.normal(kk, (B, S, nkv, d)),
            jax.random.normal(kv, (B, S, nkv, d)))


def causal_reference(q, k, v, q_pos):
    return attend_masked(q, k, v, jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None])


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("B,T,S,nq,nkv,start", [
    (1, 2 * BLOCK_Q, 2 * BLOCK_Q, 2, 1, (0,)),                    # a prompt's prefill: T = S
    (2, 2 * BLOCK_Q, 4 * BLOCK_Q, 4, 2, (BLOCK_Q, BLOCK_Q + 7)),  # a block deep in the cache, per-row starts
    (1, 4 * BLOCK_Q, 5 * BLOCK_Q, 4, 1, (BLOCK_Q - BLOCK_K,)),    # query blocks seeing different key ranges
    (1, 2 * BLOCK_Q, 16 * BLOCK_Q, 2, 1, (BLOCK_Q,)),             # a long cache the queries see a little of
])
def test_kernel_matches_the_masked_softmax(B, T, S, nq, nkv, start, splits, blocks):
    q, k, v = random_qkv(0, B, T, S, nq, nkv, 16)
    q_pos = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(T)[None]
    q_pos = jnp.minimum(q_pos, S - 1)
    out = flash_attention_pallas(q, k, v, q_pos, splits=splits, blocks=blocks, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(causal_reference(q, k, v, q_pos)), rtol=2e-5, atol=2e-5)


def test_queries_past_the_cache_see_all_of_it():
    """Padding tokens of a bucket may sit at positions past the cache: they attend to every slot
    (their output is never read, but it must be finite)."""
    q, k, v = random_qkv(1, 1, BLOCK_Q, BLOCK_Q, 2, 2, 16)
    q_pos = jnp.full((1, BLOCK_Q), 10 * BLOCK_Q, jnp.int32)
    out = flash_attention_pallas(q, k, v, q_pos, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(causal_reference(q, k, v, q_pos)), rtol=2e-5, atol=2e-5)


def test_bf16_inputs_give_bf16_outputs_close_to_the_reference():
    q, k, v = (x.astype(jnp.bfloat16) for x in random_qkv(2, 1, BLOCK_Q, 2 * BLOCK_Q, 2, 1, 32))
    q_pos = BLOCK_Q // 2 + jnp.arange(BLOCK_Q)[None]
    out = flash_attention_pallas(q, k, v, q_pos, interpret=True)
    assert out.dtype == jnp.bfloat16
    want = causal_reference(*(x.astype(jnp.float32) for x in (q, k, v)), q_pos)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=3e-2)


def test_shapes_the_kernel_refuses_stay_on_the_reference():
    q, _, _ = random_qkv(3, 1, BLOCK_Q, BLOCK_Q, 2, 1, 16)
    assert kernel_fits(q, BLOCK_Q)
    assert not kernel_fits(q[:, :8], BLOCK_Q)                  # decode / verify: too few queries
    assert not kernel_fits(q, BLOCK_Q - 1)                     # a cache not in whole key blocks
    assert not kernel_fits(jnp.zeros((1, BLOCK_Q, 2, 24)), BLOCK_Q)  # head dim 24


def test_a_repeat_of_a_stacked_cache_is_read_in_place():
    """The model's caches stack every repeat of a layer [G, B, L, nkv, d]: the kernel reads repeat g's
    first kv_len slots where they lie, giving what it gives on that repeat's slice."""
    B, T, L, nq, nkv, d, G = 2, BLOCK_Q, 3 * BLOCK_Q, 4, 2, 16, 3
    q, k, v = random_qkv(5, B, T, L, nq, nkv, d)
    stack = [jax.random.normal(jax.random.key(i), (G, B, L, nkv, d)) for i in (6, 7)]
    k_stack, v_stack = (s.at[1].set(x) for s, x in zip(stack, (k, v)))
    q_pos = jnp.asarray([[5], [BLOCK_Q + 3]], jnp.int32) + jnp.arange(T)[None]
    kv_len = 2 * BLOCK_Q
    whole = flash_attention_pallas(q, k_stack, v_stack, q_pos, jnp.int32(1), kv_len=kv_len, interpret=True)
    sliced = flash_attention_pallas(q, k[:, :kv_len], v[:, :kv_len], q_pos, interpret=True)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(sliced))
    want = causal_reference(q, k[:, :kv_len], v[:, :kv_len], jnp.minimum(q_pos, kv_len - 1))
    np.testing.assert_allclose(np.asarray(whole), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_short_passes_over_long_caches_split_their_keys():
    wide = BLOCKS[0]
    assert key_splits(1, 256, 24, 16640, wide) == 11    # a prefix-cache block pass at 27B dims: 48 -> 528 programs
    assert key_splits(1, 16384, 24, 16384, wide) == 1   # a long prompt has programs enough
    assert key_splits(1, BLOCK_Q, 2, 4 * BLOCK_K, FIXED_ORDER) == 1  # never fewer than 4 key blocks a range


def test_the_ranges_of_a_split_share_the_seen_blocks_evenly_whatever_the_caches_length():
    for seen, splits in ((260, 11), (4, 11), (7, 3), (1, 1), (12, 4)):
        ranges = [tuple(int(x) for x in key_range(jnp.int32(seen), jnp.int32(s), splits)) for s in range(splits)]
        walked = [b for first, steps in ranges for b in range(first, first + steps)]
        assert walked == list(range(seen))  # every seen block once, in order
        assert max(steps for _, steps in ranges) == -(-seen // splits)


def test_each_pass_takes_the_largest_blocks_that_tile_it_and_fit():
    assert blocks_for(256, 16640, 256, 2) == BLOCKS[0]      # 27B bf16: 128 queries a program
    assert blocks_for(192, 16640, 256, 2).q == 64           # 192 queries: not whole blocks of 128
    assert blocks_for(256, 16640 + 32, 256, 2) == FIXED_ORDER  # a cache in 32-slot blocks only
    assert blocks_for(256, 16640, 256, 4) == FIXED_ORDER    # float32 tiles of 128 rows overflow shared memory
    for T, S, d, size in [(256, 16640, 256, 2), (64, 96, 512, 2), (128, 128, 16, 4)]:
        b = blocks_for(T, S, d, size)
        assert T % b.q == 0 and S % b.k == 0


def test_the_gpu_runs_it_for_every_pass(monkeypatch):
    """Prefill in whole blocks, decode and verify packed by key head; in batch-invariant mode every
    pass padded to whole query blocks (XLA picks its einsums' algorithms per program, the kernel
    does not). A prefill not in whole blocks stays on XLA outside the mode."""
    from pallas_kernels import flash_attention as fa
    from pallas_kernels.batch_invariant import batch_invariant

    q, _, _ = random_qkv(4, 1, BLOCK_Q, BLOCK_Q, 2, 1, 16)
    assert not fa.use_flash_attention(q, BLOCK_Q)  # the CPU: the reference
    monkeypatch.setattr(fa.jax, "default_backend", lambda: "gpu")
    assert fa.use_flash_attention(q, BLOCK_Q)
    assert fa.use_flash_attention(q[:, :1], BLOCK_Q)  # decode, packed
    assert not fa.use_flash_attention(jnp.concatenate([q, q[:, :1]], axis=1), BLOCK_Q)
    assert not fa.use_flash_attention(q[:, :1], BLOCK_Q - 1)  # a cache not in whole key blocks
    with batch_invariant(8):
        assert fa.use_flash_attention(q, BLOCK_Q)
        assert fa.use_flash_attention(q[:, :1], BLOCK_Q)


@pytest.mark.parametrize("T,nq,nkv", [(1, 6, 2), (1, 2, 2), (4, 6, 1), (16, 12, 2)])
def test_decode_and_verify_passes_packed_by_key_head(T, nq, nkv):
    """Each row's T queries at their own positions (rows at different depths), the query heads of
    one key head packed into a query block, over repeat 1 of a stacked cache of 2."""
    B, S, d = 3, 4 * BLOCK_K, 16
    q, k, v = random_qkv(5, B, T, S, nq, nkv, d)
    _, k2, v2 = random_qkv(6, B, T, S, nq, nkv, d)
    q_pos = jnp.asarray([0, 37, S - T], jnp.int32)[:, None] + jnp.arange(T)[None]
    out = flash_attention_packed(q, jnp.stack([k2, k]), jnp.stack([v2, v]), q_pos, 1, interpret=True)
    np.testing.assert_allclose(np.asarray(out), np.asarray(causal_reference(q, k, v, q_pos)), rtol=2e-5, atol=2e-5)
