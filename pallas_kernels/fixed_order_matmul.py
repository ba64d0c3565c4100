"""A matmul that sums every output in one fixed order: the batch-invariant mode's projections on a GPU.

    y[r, n] = sum_k x[r, k] w[n, k],   x [R, K], w [N, K]

XLA chooses a GEMM's algorithm per program (cuBLAS or a Triton fusion, its tiles, a split of K),
by shape and by autotuning, so the same tile of rows can be summed in one order inside a decode
program and in another inside a verify or prefill program. This kernel leaves XLA no choice: one
program per `block_n` output columns walks K from 0 in `block_k` steps and adds each step's
tensor-core product into a float32 accumulator. A row's result then depends on that row's values
and on K, N and the block sizes only: never on the other rows, the program it runs in, or how
many rows share it.

The projections and the lm_head call it from their tiles where `use_fixed_order_matmul` says so:
on a GPU in the mode. Elsewhere they keep XLA's dot (on the CPU a fixed-shape tile compiles to
one loop nest whatever program holds it, which the CPU tests check bit for bit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.batch_invariant import invariant_rows
from pallas_kernels.tensor_parallel import tp_size

BLOCK_N = (128, 64, 32, 16)  # output columns a program holds, the largest that divides N
BLOCK_K = (64, 32, 16)  # the K step, the largest that divides K


def _divisor(n: int, choices: tuple[int, ...]) -> int | None:
    return next((c for c in choices if n % c == 0), None)


def kernel_fits(x: jax.Array, w: jax.Array) -> bool:
    """Shapes the kernel takes: x [R, K] with R a power of two of 16 or more (Triton's smallest
    dot), K and N whole numbers of some block."""
    if x.ndim != 2:
        return False
    R, K = x.shape
    whole_blocks = _divisor(K, BLOCK_K) is not None and _divisor(w.shape[0], BLOCK_N) is not None
    return R >= 16 and R & (R - 1) == 0 and whole_blocks


def _kernel(x_ref, w_ref, o_ref, *, block_k: int):
    """One block of output columns: x [R, K], w [bn, K] -> o [R, bn]."""
    R, K = x_ref.shape

    def step(i, acc):
        at = pl.multiple_of(i * block_k, block_k)
        x = x_ref[:, pl.ds(at, block_k)]
        w = w_ref[:, pl.ds(at, block_k)]
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((R, o_ref.shape[1]), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def fixed_order_matmul_pallas(x: jax.Array, w: jax.Array, *, out_dtype=None, interpret: bool = False) -> jax.Array:
    """The Pallas kernel: x [R, K] @ w [N, K]^T -> [R, N] in out_dtype (default w's, as XLA's dot
    of x cast to w's dtype gives), products in w's dtype and sums in float32. Shapes as
    `kernel_fits` says."""
    R, K = x.shape
    N = w.shape[0]
    bn, bk = _divisor(N, BLOCK_N), _divisor(K, BLOCK_K)
    return pl.pallas_call(
        functools.partial(_kernel, block_k=bk),
        out_shape=jax.ShapeDtypeStruct((R, N), out_dtype or w.dtype),
        grid=(N // bn,),
        in_specs=[pl.BlockSpec((R, K), lambda j: (0, 0)), pl.BlockSpec((bn, K), lambda j: (j, 0))],
        out_specs=pl.BlockSpec((R, bn), lambda j: (0, j)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="fixed_order_matmul",
    )(x.astype(w.dtype), w)


def use_fixed_order_matmul(x: jax.Array, w: jax.Array) -> bool:
    """Whether a projection runs this kernel: on a GPU, inside batch-invariant mode (which hands
    it one tile of rows at a time), on one device (a split weight's partial sums are XLA's), for
    shapes it takes."""
    return (jax.default_backend() == "gpu" and invariant_rows() is not None and tp_size() == 1
            and kernel_fits(x, w))
