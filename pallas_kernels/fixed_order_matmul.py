"""A matmul that sums every output in one fixed order: the batch-invariant mode's projections on a GPU.

    y[r, n] = sum_k x[r, k] w[n, k],   x [R, K], w [N, K]

XLA chooses a GEMM's algorithm per program (cuBLAS or a Triton fusion, its tiles, a split of K),
by shape and by autotuning, so the same tile of rows can be summed in one order inside a decode
program and in another inside a verify or prefill program. This kernel leaves XLA no choice. K is
cut into `splits` equal ranges; one program per (tile of `ROWS` rows, `block_n` output columns,
range) walks its range in `block_k` steps, adding each step's tensor-core product into a float32
accumulator, and the ranges' partial sums are added in range order. A last tile with fewer rows
loads zeros in place of the missing ones, the values a padded tile would hold, so every row is
summed by the same [ROWS, block_k] products. `plan` picks the blocks and the split from K and N
alone, so a row's result depends on that row's values, K and N only: never on the other rows, the
program it runs in, or how many rows share it. The split is there for occupancy: a projection of
few output columns would otherwise run on a handful of the GPU's SMs. A K or N that is no whole
number of the smallest block is padded with zeros to one, so every projection runs here: XLA's dot
on tiles of rows is not invariant on a GPU, where autotuning may sum the same tile in another order
in another program. (That pads a copy of the weight per call; the decode layout's joined
projections are padded once, to whole widest blocks, when it joins them.)

The projections and the lm_head call it on all their rows at once where `use_fixed_order_matmul`
says so: on a GPU in the mode (the kernel tiles the rows itself, with no padded copy of them).
Elsewhere they keep XLA's dot on the mode's tiles of rows (on the CPU a fixed-shape tile compiles
to one loop nest whatever program holds it, which the CPU tests check bit for bit).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.batch_invariant import invariant_rows
from pallas_kernels.tensor_parallel import tp_size

ROWS = 64  # rows a program holds: a projection stays bound by its weight bytes well past 64 rows
BLOCK_N = (128, 64, 32, 16)  # output columns a program holds, the largest that divides N
BLOCK_K = (64, 32, 16)  # the K step, the largest that divides K
WAVE = 132  # programs that keep every SM of an H100/H200 streaming weights
LONG_RANGE = 4096  # of K, the most one program walks while fewer than two waves run


class Plan(NamedTuple):
    block_n: int
    block_k: int
    splits: int  # ranges of K summed apart, then added in order
    num_stages: int  # loads in flight per program: more where few programs share the GPU


def _divisor(n: int, choices: tuple[int, ...]) -> int | None:
    return next((c for c in choices if n % c == 0), None)


def plan(K: int, N: int) -> Plan:
    """The blocks and the split of K for a [*, K] @ [N, K]^T product, from K and N alone: the fewest
    splits (each a whole number of K steps, at most 8) that give a wave of programs, none walking
    more than LONG_RANGE of K unless there are two waves (a long walk holds up its wave's end)."""
    bn, bk = _divisor(N, BLOCK_N), _divisor(K, BLOCK_K)
    splits = 1

    def wanting(s: int) -> bool:
        programs = (N // bn) * s
        return programs < WAVE or (K // s > LONG_RANGE and programs < 2 * WAVE)

    while wanting(splits) and splits < 8 and K % (2 * splits * bk) == 0:
        splits *= 2
    return Plan(bn, bk, splits, 4 if (N // bn) * splits < 2 * WAVE else 3)


def _kernel(x_ref, w_ref, o_ref, *, block_k: int, n_rows: int):
    """One tile of rows and block of output columns over one range of K: x [ROWS, Ks],
    w [bn, Ks] -> o [ROWS, bn]; rows of the tile at or past n_rows (the last tile's) read as zeros
    and are not written."""
    R, K = x_ref.shape
    real = (pl.program_id(0) * R + jnp.arange(R) < n_rows)[:, None]

    def step(i, acc):
        at = pl.multiple_of(i * block_k, block_k)
        x = plt.load(x_ref.at[:, pl.ds(at, block_k)], mask=real, other=0.0)
        w = w_ref[:, pl.ds(at, block_k)]
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((R, o_ref.shape[-1]), jnp.float32))
    plt.store(o_ref, acc.astype(o_ref.dtype), mask=real)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "blocks"))
def fixed_order_matmul_pallas(x: jax.Array, w: jax.Array, *, out_dtype=None, interpret: bool = False,
                              blocks: Plan | None = None) -> jax.Array:
    """The Pallas kernel: x [..., K] @ w [N, K]^T -> [..., N] in out_dtype (default w's, as XLA's
    dot of x cast to w's dtype gives), products in w's dtype and sums in float32, x's rows
    `ROWS` at a time. Any K and N (zero-padded to whole blocks: a copy of w per call where they
    are not); `blocks` (default `plan` of the padded K, N) fixes the order of the sums."""
    *lead, K = x.shape
    N_out = w.shape[0]
    w = _zero_padded(_zero_padded(w, 0, BLOCK_N[-1]), 1, BLOCK_K[-1])
    rows = _zero_padded(x.reshape(-1, K).astype(w.dtype), 1, BLOCK_K[-1])
    (n, K), N = rows.shape, w.shape[0]
    out_dtype = out_dtype or w.dtype
    bn, bk, splits, stages = blocks or plan(K, N)
    ks = K // splits
    partials = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, n_rows=n),
        out_shape=jax.ShapeDtypeStruct((splits, n, N), out_dtype if splits == 1 else jnp.float32),
        grid=(-(-n // ROWS), N // bn, splits),
        in_specs=[pl.BlockSpec((ROWS, ks), lambda i, j, s: (i, s)), pl.BlockSpec((bn, ks), lambda i, j, s: (j, s))],
        out_specs=pl.BlockSpec((None, ROWS, bn), lambda i, j, s: (s, i, j)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=stages),
        interpret=interpret,
        name="fixed_order_matmul",
    )(rows, w)
    out = functools.reduce(jnp.add, list(partials)).astype(out_dtype)  # range 0 + range 1 + ...
    return out[:, :N_out].reshape(*lead, N_out)


def _zero_padded(a: jax.Array, axis: int, multiple: int) -> jax.Array:
    """a with zeros appended along axis up to a multiple of `multiple` (a itself if it is one)."""
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    return jnp.pad(a, [(0, extra if i == axis else 0) for i in range(a.ndim)])


def use_fixed_order_matmul() -> bool:
    """Whether the projections run this kernel, whatever their shapes: on a GPU, inside
    batch-invariant mode, on one device (a split weight's partial sums are XLA's)."""
    return jax.default_backend() == "gpu" and invariant_rows() is not None and tp_size() == 1
