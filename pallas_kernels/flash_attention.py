"""Causal GQA attention of a block of queries over a cache: prefill and prefix-cache block passes.

    o[t] = softmax_j(q[t] . k[j] / sqrt(d), over cache slots j <= pos[t]) @ v

`models.layers.attend` runs this Pallas (Triton) flash kernel on a GPU for passes of `BLOCK_Q` or
more queries, and for every pass in batch-invariant mode (`use_flash_attention`), and its
reference, XLA's masked softmax (`models.layers.attend_masked`), elsewhere. On a Hopper GPU the
default path's passes of whole 128-query tiles go to flash_attention_wgmma.py's kernel instead
(wgmma fed by TMA: 1.6x this one on a prefix-cache block pass); this one serves the other shapes
and batch-invariant mode, whose single fixed configuration it provides. XLA writes every
[T, S] score matrix to memory and reads it back for the softmax; the kernel keeps a [BLOCK_Q, d]
output tile and its running max and sum in registers while it walks the key blocks (online
softmax), and stops at the last key block its queries can see.

One program per (row, query head, block of queries, range of keys); query head h reads key head
h // (nq // nkv), from repeat g of the model's stacked caches [G, B, L, nkv, d] where it lies (the
layer scan's repeat is an index into the stack: a slice of it would be a copy XLA makes first).
A pass with few query blocks over a long cache (a prefix-cache block pass) splits its keys into
ranges so the GPU has enough programs, and the ranges' partial outputs merge by their running
maxima (`key_splits`). The blocks are picked per pass (`blocks_for`): the largest
whose query block divides the pass and whose tiles fit in shared memory. Decode and verify
passes (T < BLOCK_Q) pack the T x (nq / nkv) queries that read one key head into one query block
(`flash_attention_packed`): the kernel then reads each row's cache in place and only up to its
position, where XLA's masked einsum reads every slot of the compiled length and may first copy
the whole cache into the layout its dot wants.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.attention_common import key_range
from pallas_kernels.batch_invariant import invariant_rows
from pallas_kernels.flash_attention_wgmma import flash_attention_wgmma, use_wgmma_attention
from pallas_kernels.tensor_parallel import on_axis, per_device


class Blocks(NamedTuple):
    q: int  # query rows a program holds: the output tile [q, d] in float32 registers
    k: int  # cache slots a loop iteration scores: [q, k] scores next to the output tile
    warps: int
    stages: int  # key / value tiles in flight


# Largest first. At the 27B shapes (d 256, bf16) 128 query rows over 8 warps with 64-slot key steps
# ran 1.7x as fast as 64 rows over 4 warps with 32-slot steps on a 256-query block pass over 16k
# slots (BENCHMARKS.md, "Flash attention (prefill)").
BLOCKS = (Blocks(128, 64, 8, 2), Blocks(64, 64, 4, 3), Blocks(64, 32, 4, 2))
FIXED_ORDER = BLOCKS[-1]  # batch-invariant mode: one configuration for every pass
BLOCK_Q = min(b.q for b in BLOCKS)  # a pass's queries come in whole blocks of this many
BLOCK_K = min(b.k for b in BLOCKS)  # and its cache in whole blocks of this many slots
SHARED_BYTES = 200 * 1024  # of an H100/H200 SM's 227 KB, with room for the compiler's own
# Programs enough to give each of the H200's 132 SMs four: a short block of queries over a long
# cache (256 after 16k: 48 programs of (head, query block)) splits its key range to get there.
TARGET_PROGRAMS = 528


def _flash_kernel(q_ref, k_ref, v_ref, pos_ref, group_ref, acc_ref, max_ref, sum_ref, *, block_k: int,
                  splits: int):
    """One (row, query head, query block, key split): q [BQ, d]; k, v [G, S, d] (the row's stacked
    caches for the query head's key head, of which repeat group [1] is read); pos [BQ] the
    queries' positions. Walks its split's share (`key_range`) of the key blocks up to the last one
    a query sees and writes the unnormalised output acc [BQ, d], the running max [BQ] and the sum
    of exponentials [BQ]."""
    q = q_ref[...]
    pos = pos_ref[...]
    g = group_ref[0]
    _, S, d = k_ref.shape
    first, steps = key_range(jnp.minimum(jnp.max(pos) // block_k + 1, S // block_k), pl.program_id(3), splits)

    def step(j, carry):
        m, total, acc = carry
        at = pl.multiple_of(j * block_k, block_k)
        k = k_ref[g, pl.ds(at, block_k), :]
        v = v_ref[g, pl.ds(at, block_k), :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * d**-0.5
        s = jnp.where(at + jnp.arange(block_k)[None, :] <= pos[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)  # rescales what earlier blocks summed to the new running max
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc

    BQ = q.shape[0]
    # A finite start for the max: a split whose keys no query sees keeps it, and weighs nothing.
    init = (jnp.full((BQ,), -1e30, jnp.float32), jnp.zeros((BQ,), jnp.float32), jnp.zeros((BQ, d), jnp.float32))
    m, total, acc = jax.lax.fori_loop(first, first + steps, step, init)
    acc_ref[...] = acc
    max_ref[...] = m
    sum_ref[...] = total


def blocks_for(T: int, S: int, d: int, itemsize: int) -> Blocks:
    """The first of `BLOCKS` that tiles T queries and S slots whole and whose query tile and key /
    value tiles in flight fit in shared memory (T a multiple of BLOCK_Q, S of BLOCK_K)."""
    def fits(b: Blocks) -> bool:
        return T % b.q == 0 and S % b.k == 0 and (b.q + 2 * b.stages * b.k) * d * itemsize <= SHARED_BYTES
    return next((b for b in BLOCKS if fits(b)), FIXED_ORDER)


def key_splits(B: int, T: int, nq: int, S: int, blocks: Blocks) -> int:
    """How many ranges a pass's keys split into: enough programs for `TARGET_PROGRAMS`, at least
    4 key blocks a range."""
    programs = B * nq * (T // blocks.q)
    return max(1, min(-(-TARGET_PROGRAMS // programs), S // blocks.k // 4))


@functools.partial(jax.jit, static_argnames=("kv_len", "interpret", "splits", "blocks"))
def flash_attention_pallas(q, k, v, q_pos, group=0, *, kv_len: int | None = None, splits: int | None = None,
                           blocks: Blocks | None = None, interpret: bool = False):
    """The Pallas kernel. q [B, T, nq, d]; k, v the stacked caches [G, B, L, nkv, d] (or one
    repeat's [B, L, nkv, d]), of which repeat `group` (int32 []) and its slots 0..kv_len-1
    (default L) are read in place: slicing a repeat out of a scanned stack first would copy it;
    q_pos [B, T] int32. Returns o [B, T, nq, d] in q's dtype. T a multiple of BLOCK_Q, kv_len of
    BLOCK_K, d a power of two (`kernel_fits`). splits: key ranges scored by programs of their own
    and merged here (None: `key_splits`); blocks: the tiles (None: `blocks_for`)."""
    if k.ndim == 4:
        k, v = k[None], v[None]
    B, T, nq, d = q.shape
    G, nkv, S = k.shape[0], k.shape[3], kv_len or k.shape[2]
    blocks = blocks or blocks_for(T, S, d, q.dtype.itemsize)
    bq, bk = blocks.q, blocks.k
    rep, n = nq // nkv, splits or key_splits(B, T, nq, S, blocks)
    q_pos = jnp.clip(q_pos.astype(jnp.int32), 0, S - 1)  # padding queries may point past the cache
    queries = pl.BlockSpec((None, bq, None, d), lambda b, h, i, s: (b, i, h, 0))
    cache = pl.BlockSpec((G, None, S, None, d), lambda b, h, i, s: (0, b, 0, h // rep, 0))
    positions = pl.BlockSpec((None, bq), lambda b, h, i, s: (b, i))
    repeat = pl.BlockSpec((1,), lambda b, h, i, s: (0,))
    partial_out = pl.BlockSpec((None, None, bq, None, d), lambda b, h, i, s: (s, b, i, h, 0))
    partial_row = pl.BlockSpec((None, None, bq, None), lambda b, h, i, s: (s, b, i, h))
    acc, m, total = pl.pallas_call(
        functools.partial(_flash_kernel, block_k=bk, splits=n),
        out_shape=[jax.ShapeDtypeStruct((n, B, T, nq, d), jnp.float32),
                   jax.ShapeDtypeStruct((n, B, T, nq), jnp.float32), jax.ShapeDtypeStruct((n, B, T, nq), jnp.float32)],
        grid=(B, nq, T // bq, n),
        in_specs=[queries, cache, cache, positions, repeat],
        out_specs=[partial_out, partial_row, partial_row],
        compiler_params=plt.CompilerParams(num_warps=blocks.warps, num_stages=blocks.stages),
        interpret=interpret,
        name="flash_attention",
    )(q, k.astype(q.dtype), v.astype(q.dtype), q_pos, jnp.reshape(group, (1,)).astype(jnp.int32))
    weight = jnp.exp(m - jnp.max(m, axis=0))  # each split's share, against the largest max over splits
    out = jnp.sum(acc * weight[..., None], axis=0) / jnp.sum(total * weight, axis=0)[..., None]
    return out.astype(q.dtype)


def whole_blocks(T: int) -> int:
    """T queries padded to whole BLOCK_Q blocks."""
    return -(-T // BLOCK_Q) * BLOCK_Q


def kernel_fits(q, slots: int, *, padded: bool = False) -> bool:
    """Shapes the kernel takes, for queries q [B, T, nq, d] over `slots` cache slots: whole query
    blocks (padded: once padded to them), whole key blocks, a power-of-two head dim."""
    T, d = q.shape[1], q.shape[-1]
    T = whole_blocks(T) if padded else T
    return T >= BLOCK_Q and T % BLOCK_Q == 0 and slots % BLOCK_K == 0 and d & (d - 1) == 0 and d >= 16


def use_flash_attention(q, slots: int) -> bool:
    """Whether `attend` runs this kernel for queries q over `slots` slots: on a GPU, for shapes it
    takes, decode and verify passes packed by key head. In batch-invariant mode every pass is
    padded to whole query blocks instead: XLA may pick its masked einsums' algorithms per program,
    the kernel sums each query the same way in all of them (`flash_attention_fixed_order`)."""
    short = q.shape[1] < BLOCK_Q  # packed by key head (`flash_attention_packed`), then padded
    return jax.default_backend() == "gpu" and kernel_fits(q, slots, padded=short or invariant_rows() is not None)


def flash_attention_fixed_order(q, k, v, q_pos, group=0, *, kv_len: int | None = None, interpret: bool = False):
    """The kernel with the queries padded to whole blocks and one key range (no split to merge), in
    one configuration (`FIXED_ORDER`) for every shape: a query's output then comes from the same
    key blocks added in the same order whatever else shares its pass. Its block may walk further,
    to the last slot another query sees, but a block a query cannot see adds exactly nothing to it
    (weights exp(-inf) = 0, rescale exp(0) = 1).
    Same arguments and result as `flash_attention_pallas`."""
    T = q.shape[1]
    pad = lambda x: jnp.pad(x, [(0, 0), (0, whole_blocks(T) - T)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    out = flash_attention_pallas(pad(q), k, v, pad(q_pos), group, kv_len=kv_len, splits=1, blocks=FIXED_ORDER,
                                 interpret=interpret)
    return out[:, :T]


def flash_attention_packed(q, k, v, q_pos, group=0, *, kv_len: int | None = None, interpret: bool = False):
    """A decode or verify pass (few queries a row) as whole query blocks: the T x rep queries of a
    row that read one key head (rep = nq / nkv query heads, each with its own position) become one
    block of the kernel with one query head per key head, padded with queries at slot 0 whose
    output is dropped. Same arguments and result as `flash_attention_pallas`."""
    B, T, nq, d = q.shape
    nkv = k.shape[-2]
    rep = nq // nkv
    by_key_head = q.reshape(B, T, nkv, rep, d).transpose(0, 1, 3, 2, 4).reshape(B, T * rep, nkv, d)
    n = whole_blocks(T * rep)
    padded = jnp.pad(by_key_head, [(0, 0), (0, n - T * rep), (0, 0), (0, 0)])
    pos = jnp.pad(jnp.repeat(q_pos, rep, axis=1), [(0, 0), (0, n - T * rep)])
    out = flash_attention_pallas(padded, k, v, pos, group, kv_len=kv_len, interpret=interpret)[:, :T * rep]
    return out.reshape(B, T, rep, nkv, d).transpose(0, 1, 3, 2, 4).reshape(B, T, nq, d)


def flash_attention(q, k, v, q_pos, group, kv_len: int):
    """The kernel on the stacked caches k, v [G, B, L, nkv, d]: `flash_attention_fixed_order` in
    batch-invariant mode, else the wgmma kernel where it takes the shapes, else the Triton one;
    under a tensor-parallel mesh per device on the heads it holds. q_pos [B, T]: each row's
    start + t."""
    if invariant_rows() is not None:
        kernel = flash_attention_fixed_order
    elif q.shape[1] < BLOCK_Q:
        kernel = flash_attention_packed
    elif use_wgmma_attention(q, kv_len):
        kernel = flash_attention_wgmma
    else:
        kernel = flash_attention_pallas
    run = lambda q, k, v, q_pos, group: kernel(q, k, v, q_pos, group, kv_len=kv_len)  # noqa: E731
    heads, kv_heads, whole = on_axis(4, 2), on_axis(5, 3), jax.sharding.PartitionSpec()
    return per_device(run, (heads, kv_heads, kv_heads, whole, whole), heads)(q, k, v, q_pos,
                                                                             jnp.asarray(group, jnp.int32))
