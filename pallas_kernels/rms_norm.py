"""An RMS norm that sums every row in one fixed order: the batch-invariant mode's norms on a GPU.

    y[r] = x[r] * rsqrt(mean_i x[r, i]^2 + eps) * scale   [* silu(z[r])],   x [R, W], scale [W]

One program holds a tile of rows (`rows_per_program(W)`, a function of the width alone), loaded in
`chunk(W)`-wide pieces: the pieces' squares are added in order, element by element, the result
summed across the piece, and each piece scaled and written. A last tile with fewer rows reads
zeros in place of the missing ones and writes only its real rows, so a row is summed the same way
whether it is alone in its pass or one of a thousand: the kernel tiles the rows itself, where
XLA's norm needs them padded to a fixed tile (a copy in, a slice out, per norm) to be pinned.

The model's norms call `rms_norm`, which runs the kernel where `use_rms_norm_kernel` says (on a GPU
in the mode, on one device) and the norm's own XLA formula, on `row_tiled` tiles, elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.batch_invariant import invariant_rows, row_tiled
from pallas_kernels.tensor_parallel import tp_size

CHUNK = 1024  # widest piece of a row loaded at once (Triton tiles are powers of two)
TILE = 8192  # elements of x a program holds in registers: one 5120-wide row, 32 rows of 256


def chunk(W: int) -> int:
    """The piece of a row loaded at once: the largest power of two up to `CHUNK` dividing W."""
    return min(CHUNK, W & -W)


def rows_per_program(W: int) -> int:
    """Rows a program holds: the largest power of two whose rows fit `TILE` elements, at least one."""
    return 1 << max(0, (TILE // W).bit_length() - 1)


def kernel_fits(x: jax.Array) -> bool:
    """Widths the kernel takes: a whole number of pieces of at least 16 elements."""
    return chunk(x.shape[-1]) >= 16


def _kernel(x_ref, scale_ref, *refs, eps: float, n_rows: int, gated: bool):
    """One tile of rows: x [R, W], scale [W], (z [R, W]) -> o [R, W]; rows at or past n_rows
    (the last tile's) read as zeros and are not written. Every piece of the tile is loaded
    before any is summed, so the loads overlap."""
    z_ref, o_ref = refs if gated else (None, *refs)
    R, W = x_ref.shape
    C = chunk(W)
    real = (pl.program_id(0) * R + jnp.arange(R) < n_rows)[:, None]
    pieces = [pl.ds(i * C, C) for i in range(W // C)]
    load = lambda ref, piece: plt.load(ref.at[:, piece], mask=real, other=0.0).astype(jnp.float32)  # noqa: E731
    xs = [load(x_ref, piece) for piece in pieces]
    squares = functools.reduce(jnp.add, [x * x for x in xs])  # [R, C]: the pieces added in order
    inv = jax.lax.rsqrt(jnp.sum(squares, axis=1) / W + eps)[:, None]
    for piece, x in zip(pieces, xs):
        y = x * inv * scale_ref[piece][None, :]
        if gated:
            y = y * jax.nn.silu(load(z_ref, piece))
        plt.store(o_ref.at[:, piece], y.astype(o_ref.dtype), mask=real)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret"))
def rms_norm_pallas(x: jax.Array, scale: jax.Array, eps: float, z: jax.Array | None = None, *, out_dtype=None,
                    interpret: bool = False) -> jax.Array:
    """The Pallas kernel: x [..., W] normalised over its last axis, times scale [W] (float32) and,
    given z [..., W], times silu(z); computed in float32, returned in out_dtype (default x's).
    W as `kernel_fits` says."""
    *lead, W = x.shape
    rows = x.reshape(-1, W)
    n, R = rows.shape[0], rows_per_program(W)
    tile = pl.BlockSpec((R, W), lambda i: (i, 0))
    operands = (rows, scale.astype(jnp.float32)) + (() if z is None else (z.reshape(-1, W),))
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, n_rows=n, gated=z is not None),
        out_shape=jax.ShapeDtypeStruct((n, W), out_dtype or x.dtype),
        grid=(-(-n // R),),
        in_specs=[tile, pl.BlockSpec((W,), lambda i: (0,))] + ([] if z is None else [tile]),
        out_specs=tile,
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rms_norm",
    )(*operands)
    return out.reshape(*lead, W)


def use_rms_norm_kernel(x: jax.Array) -> bool:
    """Whether a norm of x [..., W] runs this kernel: on a GPU, inside batch-invariant mode, on one
    device (a sharded norm's rows are split over devices), for widths it takes."""
    return jax.default_backend() == "gpu" and invariant_rows() is not None and tp_size() == 1 and kernel_fits(x)


def rms_norm(reference, x: jax.Array, scale: jax.Array, eps: float, z: jax.Array | None = None, *, out_dtype=None):
    """A model's norm of x [..., W] (times silu(z [..., W]) where given): the kernel where
    `use_rms_norm_kernel` says, else reference(x[, z]), the same norm in XLA, on the mode's tiles
    (`row_tiled`: the plain call outside the mode). scale [W] float32 multiplies the normalised
    row; out_dtype as the kernel's."""
    if use_rms_norm_kernel(x):
        return rms_norm_pallas(x, scale, eps, z, out_dtype=out_dtype)
    return row_tiled(reference, *((x,) if z is None else (x, z)))
