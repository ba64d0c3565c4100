"""Causal GQA attention of a block of queries over a long cache on Hopper: wgmma and TMA (Pallas Mosaic GPU).

    o[t] = softmax_j(q[t] . k[j] / sqrt(d), over cache slots j <= start + t) @ v

The same contract as flash_attention.py's Triton kernel, for the passes that dominate a
prefix-cache hit (256 queries over 16k cached slots at 27B, where the Triton kernel reaches about
310 TFLOP/s on the H200 and this one about 500). Here the tensor
cores run wgmma from shared memory while a producer warpgroup streams key and value blocks in by
TMA, FlashAttention-3 style:

  * one CTA per (query head, tile of 2 x 64 queries, row and range of keys); warpgroups 0 and 1
    each own 64 queries, their [64, d] float32 output and running max and sum in registers;
    warpgroup 2 issues the TMA copies of key and value blocks into a ring of `STAGES` buffers
    and waits for both consumers to free a slot before refilling it;
  * per key block a consumer scores [64, BLOCK_K] with one wgmma, masks slots past each query's
    position, updates the online softmax in base 2 (the scale folded into log2(e)), and adds
    p @ v with a second wgmma; a shared barrier staggers the two consumers so that one's softmax
    overlaps the other's matmuls;
  * a CTA walks only the key blocks its queries can see, cut into `splits` ranges of their own
    CTAs (`key_range`; a 256-query pass has 48 (head, tile) pairs for 132 SMs), and each range
    writes its normalised output and log-sum-exp, merged after the call.

Positions are each row's start + t, as `Batch.positions_for` makes them; the row's start is read
from q_pos[:, 0]. `use_wgmma_attention` says which passes take it (float16 or bfloat16, head dim a
multiple of 64 up to 256, whole 128-query tiles over whole 64-slot blocks, on an H100/H200); the
others, and batch-invariant mode, keep the Triton kernel. There is no CPU interpreter for wgmma:
the tests check the dispatch and that it lowers; `bench.kernels --only attention` checks its
numbers on the GPU against XLA's masked softmax in float32 (BENCHMARKS.md, "Flash attention").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention_common import key_range

BLOCK_Q = 64  # queries a consumer warpgroup owns: wgmma's M
TILE_Q = 2 * BLOCK_Q  # queries a CTA owns
BLOCK_K = 64  # cache slots a step scores
STAGES = 2  # key / value blocks in flight: at head dim 256 two fill the shared memory with Q
SMS = 132  # an H100/H200's SMs; one CTA fits an SM
LOG2E = math.log2(math.e)
MASKED = -1e30  # a finite start for the running max: a range whose keys a query cannot see weighs 0


def key_splits(B: int, T: int, nq: int, S: int) -> int:
    """Ranges a pass's cache blocks are cut into: the count up to 16 whose CTAs fill the SMs'
    waves best (at least 4 blocks a range), the fewest among equals."""
    ctas = B * nq * (T // TILE_Q)
    most = max(1, min(16, S // BLOCK_K // 4))
    fill = lambda n: n * ctas / (-(-n * ctas // SMS) * SMS)  # noqa: E731 - share of the last wave's SMs busy
    return max(range(1, most + 1), key=lambda n: (round(fill(n), 2), -n))


def _kernel(q_ref, k_ref, v_ref, start_ref, group_ref, o_ref, lse_ref, scoped, *, splits: int, n_blocks: int,
            rep: int, scale: float):
    """One CTA: query head, tile of TILE_Q queries, and (row, key range) from the grid. q [B, T, nq, d];
    k, v [G, B, L, nkv, d], repeat group [1] read; start [B] each row's first position. Writes the
    tile's output, normalised over the range's keys, to o [splits, B, T, nq, d] and its base-2
    log-sum-exp (-inf where the range holds no key a query sees) to lse [splits, B, nq, T]."""
    (q_smem, k_smem, v_smem, lse_smem), (k_ready, v_ready, q_ready), (k_free, v_free), turn = scoped
    head, tile, cell = lax.axis_index("heads"), lax.axis_index("tiles"), lax.axis_index("cells")
    row, split = lax.div(cell, jnp.int32(splits)), lax.rem(cell, jnp.int32(splits))
    wg = lax.axis_index("wg")
    start = start_ref[row]
    g = group_ref[0]
    seen = jnp.minimum((start + tile * TILE_Q + TILE_Q - 1) // BLOCK_K + 1, n_blocks)  # blocks the tile sees
    first, steps = key_range(seen, split, splits)
    d = q_smem.shape[-1]

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        q_at = tile * TILE_Q + wg * BLOCK_Q
        q_tile = q_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[row, pl.ds(q_at, BLOCK_Q), head], q_tile, q_ready.at[wg])
        plgpu.barrier_wait(q_ready.at[wg])
        rows = plgpu.Layout.WGMMA.reduce(1)
        m = plgpu.layout_cast(jnp.full((BLOCK_Q,), MASKED, jnp.float32), rows)
        total = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), rows)
        acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, d), jnp.float32), plgpu.Layout.WGMMA)
        query_pos = start + q_at + plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, BLOCK_K), 0,
                                                          layout=plgpu.Layout.WGMMA)
        slot_in_block = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, BLOCK_K), 1, layout=plgpu.Layout.WGMMA)
        pl.when(wg == 1)(take_turn)  # the second consumer starts half a step behind the first

        def step(i, carry):
            acc, m, total = carry
            slot = lax.rem(i, jnp.int32(STAGES))
            plgpu.barrier_wait(k_ready.at[slot])

            def score(ref):
                plgpu.wgmma(ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                take_turn()
                return ref[...]

            s = pl.run_scoped(score, plgpu.ACC((BLOCK_Q, BLOCK_K), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            key_pos = (first + i) * BLOCK_K + slot_in_block
            s = jnp.where(key_pos <= query_pos, s * (scale * LOG2E), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)  # rescales what earlier blocks summed to the new running max
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)
            total = total * alpha + p.sum(axis=1)

            def add_values(ref):
                plgpu.wgmma(ref, p.astype(q_tile.dtype), v_smem.at[slot])

            acc = pl.run_state(add_values)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, total

        acc, m, total = lax.fori_loop(0, steps, step, (acc, m, total))
        pl.when(wg == 0)(take_turn)  # pairs the second consumer's head start
        some = total > 0  # a range of keys this tile's queries cannot see: output 0, weight 0
        acc = acc / lax.broadcast_in_dim(jnp.where(some, total, 1.0), acc.shape, [0])
        q_tile[...] = acc.astype(q_tile.dtype)
        lse_smem.at[wg][...] = jnp.where(some, m + jnp.log2(jnp.where(some, total, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[split, row, pl.ds(q_at, BLOCK_Q), head])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[split, row, head, pl.ds(q_at, BLOCK_Q)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.int32(rep))

        def fetch(i, slot):
            at = pl.ds((first + i) * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(k_ref.at[g, row, at, kv_head], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[g, row, at, kv_head], v_smem.at[slot], v_ready.at[slot])

        for i in range(STAGES):
            pl.when(i < steps)(functools.partial(fetch, i, i))

        @pl.loop(0, jnp.maximum(steps - STAGES, 0))
        def _refill(i):
            slot = lax.rem(i, jnp.int32(STAGES))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            fetch(i + STAGES, slot)


@functools.partial(jax.jit, static_argnames=("kv_len", "splits"))
def flash_attention_wgmma(q, k, v, q_pos, group=0, *, kv_len: int | None = None, splits: int | None = None):
    """q [B, T, nq, d]; k, v the stacked caches [G, B, L, nkv, d] (or one repeat's [B, L, nkv, d]), of
    which repeat `group` and its slots 0..kv_len-1 (default L) are read in place; q_pos [B, T]
    int32, each row start + t. Returns o [B, T, nq, d] in q's dtype. Shapes as
    `use_wgmma_attention` takes them; splits: ranges of cache blocks (None: `key_splits`)."""
    if k.ndim == 4:
        k, v = k[None], v[None]
    B, T, nq, d = q.shape
    nkv, S = k.shape[3], kv_len or k.shape[2]
    n_blocks = S // BLOCK_K
    n = splits or key_splits(B, T, nq, S)
    dtype = q.dtype
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(q_ref, k_ref, v_ref, start_ref, group_ref, o_ref, lse_ref):
        scratch = (plgpu.SMEM((2, BLOCK_Q, d), dtype, transforms=tiled),
                   plgpu.SMEM((STAGES, BLOCK_K, d), dtype, transforms=tiled),
                   plgpu.SMEM((STAGES, BLOCK_K, d), dtype, transforms=tiled),
                   plgpu.SMEM((2, BLOCK_Q), jnp.float32))
        ready = (plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=STAGES), plgpu.Barrier(num_barriers=2))
        free = (plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),) * 2
        pl.run_scoped(lambda *scoped: _kernel(q_ref, k_ref, v_ref, start_ref, group_ref, o_ref, lse_ref, scoped,
                                              splits=n, n_blocks=n_blocks, rep=nq // nkv,
                                              scale=d ** -0.5),
                      scratch, ready, free, plgpu.Barrier(num_arrivals=2), collective_axes="wg")

    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((n, B, T, nq, d), dtype), jax.ShapeDtypeStruct((n, B, nq, T), jnp.float32)),
        grid=(nq, T // TILE_Q, B * n),
        grid_names=("heads", "tiles", "cells"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(q, k.astype(dtype), v.astype(dtype), q_pos[:, 0].astype(jnp.int32), jnp.reshape(group, (1,)).astype(jnp.int32))
    if n == 1:
        return out[0]
    lse = jnp.swapaxes(lse, 2, 3)  # [n, B, T, nq], base 2
    weight = jnp.exp2(lse - jnp.max(lse, axis=0))  # each range's share, against the largest
    merged = jnp.sum(out.astype(jnp.float32) * weight[..., None], axis=0) / jnp.sum(weight, axis=0)[..., None]
    return merged.astype(dtype)


def use_wgmma_attention(q, slots: int) -> bool:
    """Whether queries q [B, T, nq, d] over `slots` cache slots take this kernel: on a Hopper GPU,
    float16 or bfloat16, d a multiple of 64 up to 256, whole TILE_Q tiles over whole BLOCK_K blocks."""
    T, d = q.shape[1], q.shape[-1]
    return (jax.default_backend() == "gpu" and _hopper() and q.dtype in (jnp.bfloat16, jnp.float16)
            and d % 64 == 0 and d <= 256 and T >= TILE_Q and T % TILE_Q == 0 and slots % BLOCK_K == 0)


@functools.cache
def _hopper() -> bool:
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0"
