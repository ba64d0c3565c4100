"""The wgmma flash-attention kernel (Mosaic GPU) on the CPU: it lowers for CUDA to one kernel whose
products are wgmma, its key split fills the H200's waves, it takes only the shapes it can, and the
dispatcher sends it the default path's prefill passes on a Hopper GPU but never batch-invariant mode's.
Mosaic GPU's wgmma has no CPU interpreter: its numbers are checked on the GPU against XLA's masked
softmax in float32 (`python -m bench.kernels --only attention`, BENCHMARKS.md)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import flash_attention as fa
from pallas_kernels import flash_attention_wgmma as wg
from pallas_kernels.batch_invariant import batch_invariant

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("B, T, nq, nkv, d, L, dtype", [(1, 256, 24, 4, 256, 16896, jnp.bfloat16),
                                                         (2, 256, 8, 2, 128, 1024, jnp.bfloat16),
                                                         (1, 128, 16, 2, 64, 512, jnp.float16)])
def test_lowers_to_one_mosaic_gpu_kernel_of_wgmma_products(B, T, nq, nkv, d, L, dtype):
    args = (S((B, T, nq, d), dtype), S((3, B, L, nkv, d), dtype), S((3, B, L, nkv, d), dtype), S((B, T), jnp.int32))
    run = jax.jit(lambda q, k, v, pos: wg.flash_attention_wgmma(q, k, v, pos, 1, kv_len=L))
    module = run.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert module.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert "wgmma" in module


def test_a_short_pass_over_a_long_cache_splits_its_keys_to_fill_whole_waves():
    assert wg.key_splits(1, 256, 24, 16896) == 11  # 27B block pass: 48 (head, tile) CTAs -> 528, 4 waves of 132
    assert wg.key_splits(2, 256, 24, 256) == 1  # a 256-token prefill: 4 key blocks, never fewer than 4 a range
    for args in ((1, 256, 24, 16896), (1, 4096, 24, 4096), (2, 256, 8, 1024)):
        assert 1 <= wg.key_splits(*args) <= 16


def test_it_takes_whole_tiles_of_half_precision_queries_on_hopper(monkeypatch):
    q = jnp.zeros((1, 256, 24, 256), jnp.bfloat16)
    assert not wg.use_wgmma_attention(q, 16896)  # the CPU
    monkeypatch.setattr(wg.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(wg, "_hopper", lambda: True)
    assert wg.use_wgmma_attention(q, 16896) and wg.use_wgmma_attention(q.astype(jnp.float16), 256)
    assert not wg.use_wgmma_attention(q[:, :192], 16896)  # not whole 128-query tiles
    assert not wg.use_wgmma_attention(q[:, :64], 16896)  # a pass shorter than a tile
    assert not wg.use_wgmma_attention(q, 16896 + 32)  # not whole 64-slot blocks
    assert not wg.use_wgmma_attention(q.astype(jnp.float32), 16896)
    assert not wg.use_wgmma_attention(jnp.zeros((1, 256, 24, 96), jnp.bfloat16), 16896)  # d not a multiple of 64
    assert not wg.use_wgmma_attention(jnp.zeros((1, 256, 24, 512), jnp.bfloat16), 16896)  # d past 256
    monkeypatch.setattr(wg, "_hopper", lambda: False)
    assert not wg.use_wgmma_attention(q, 16896)  # wgmma is Hopper's


def test_the_dispatcher_sends_it_prefill_passes_but_never_the_invariant_modes(monkeypatch):
    ran = []

    def recorder(name):
        def kernel(q, k, v, q_pos, group, *, kv_len):
            ran.append(name)
            return q
        return kernel

    for name in ("flash_attention_wgmma", "flash_attention_pallas", "flash_attention_fixed_order"):
        monkeypatch.setattr(fa, name, recorder(name))
    q, kv = jnp.zeros((1, 256, 4, 64), jnp.bfloat16), jnp.zeros((2, 1, 512, 2, 64), jnp.bfloat16)
    pos = jnp.arange(256, dtype=jnp.int32)[None]
    monkeypatch.setattr(fa, "use_wgmma_attention", lambda q, slots: True)
    fa.flash_attention(q, kv, kv, pos, 0, 512)
    with batch_invariant(8):
        fa.flash_attention(q, kv, kv, pos, 0, 512)
    monkeypatch.setattr(fa, "use_wgmma_attention", lambda q, slots: False)
    fa.flash_attention(q, kv, kv, pos, 0, 512)
    assert ran == ["flash_attention_wgmma", "flash_attention_fixed_order", "flash_attention_pallas"]
