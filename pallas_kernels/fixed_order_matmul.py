"""A matmul that sums every output in one fixed order: the batch-invariant mode's projections on a GPU.

    y[r, n] = sum_k x[r, k] w[n, k],   x [R, K], w [N, K]

XLA chooses a GEMM's algorithm per program (cuBLAS or a Triton fusion, its tiles, a split of K),
by shape and by autotuning, so the same tile of rows can be summed in one order inside a decode
program and in another inside a verify or prefill program. This kernel leaves XLA no choice. K is
cut into `splits` equal ranges; one program per (`block_n` output columns, range) walks its range
in `block_k` steps, adding each step's tensor-core product into a float32 accumulator, and the
ranges' partial sums are added in range order. `plan` picks the blocks and the split from K and N
alone, so a row's result depends on that row's values, K and N only: never on the other rows, the
program it runs in, or how many rows share it. The split is there for occupancy: a projection of
few output columns would otherwise run on a handful of the GPU's SMs.

The projections and the lm_head call it from their tiles where `use_fixed_order_matmul` says so:
on a GPU in the mode. Elsewhere they keep XLA's dot (on the CPU a fixed-shape tile compiles to
one loop nest whatever program holds it, which the CPU tests check bit for bit).
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

BLOCK_N = (128, 64, 32, 16)  # output columns a program holds, the largest that divides N
BLOCK_K = (64, 32, 16)  # the K step, the largest that divides K
WAVE = 132  # programs that keep every SM of an H100/H200 streaming weights


class Plan(NamedTuple):
    block_n: int
    block_k: int
    splits: int  # ranges of K summed apart, then added in order
    num_stages: int  # loads in flight per program: more where few programs share the GPU


def _divisor(n: int, choices: tuple[int, ...]) -> int | None:
    return next((c for c in choices if n % c == 0), None)


def plan(K: int, N: int) -> Plan:
    """The blocks and the split of K for a [*, K] @ [N, K]^T product, from K and N alone: the fewest
    splits (each a whole number of K steps, at most 8) that give a wave of programs."""
    bn, bk = _divisor(N, BLOCK_N), _divisor(K, BLOCK_K)
    splits = 1
    while (N // bn) * splits < WAVE and splits < 8 and K % (2 * splits * bk) == 0:
        splits *= 2
    return Plan(bn, bk, splits, 4 if (N // bn) * splits < 2 * WAVE else 3)


def kernel_fits(x: jax.Array, w: jax.Array) -> bool:
    """Shapes the kernel takes: x [R, K] with R a power of two of 16 or more (Triton's smallest
    dot), K and N whole numbers of some block."""
    if x.ndim != 2:
        return False
    R, K = x.shape
    whole_blocks = _divisor(K, BLOCK_K) is not None and _divisor(w.shape[0], BLOCK_N) is not None
    return R >= 16 and R & (R - 1) == 0 and whole_blocks


def _kernel(x_ref, w_ref, o_ref, *, block_k: int):
    """One block of output columns over one range of K: x [R, Ks], w [bn, Ks] -> o [R, bn]."""
    R, K = x_ref.shape

    def step(i, acc):
        at = pl.multiple_of(i * block_k, block_k)
        x = x_ref[:, pl.ds(at, block_k)]
        w = w_ref[:, pl.ds(at, block_k)]
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((R, o_ref.shape[-1]), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "blocks"))
def fixed_order_matmul_pallas(x: jax.Array, w: jax.Array, *, out_dtype=None, interpret: bool = False,
                              blocks: Plan | None = None) -> jax.Array:
    """The Pallas kernel: x [R, K] @ w [N, K]^T -> [R, N] in out_dtype (default w's, as XLA's dot
    of x cast to w's dtype gives), products in w's dtype and sums in float32. Shapes as
    `kernel_fits` says; `blocks` (default `plan(K, N)`) fixes the order of the sums."""
    R, K = x.shape
    N = w.shape[0]
    out_dtype = out_dtype or w.dtype
    bn, bk, splits, stages = blocks or plan(K, N)
    ks = K // splits
    partials = pl.pallas_call(
        functools.partial(_kernel, block_k=bk),
        out_shape=jax.ShapeDtypeStruct((splits, R, N), out_dtype if splits == 1 else jnp.float32),
        grid=(N // bn, splits),
        in_specs=[pl.BlockSpec((R, ks), lambda j, s: (0, s)), pl.BlockSpec((bn, ks), lambda j, s: (j, s))],
        out_specs=pl.BlockSpec((None, R, bn), lambda j, s: (s, 0, j)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=stages),
        interpret=interpret,
        name="fixed_order_matmul",
    )(x.astype(w.dtype), w)
    return functools.reduce(jnp.add, list(partials)).astype(out_dtype)  # range 0 + range 1 + ...


def use_fixed_order_matmul(x: jax.Array, w: jax.Array) -> bool:
    """Whether a projection runs this kernel: on a GPU, inside batch-invariant mode (which hands
    it one tile of rows at a time), on one device (a split weight's partial sums are XLA's), for
    shapes it takes."""
    return (jax.default_backend() == "gpu" and invariant_rows() is not None and tp_size() == 1
            and kernel_fits(x, w))
