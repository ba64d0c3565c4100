"""An RMS norm that sums every row in one fixed order: the batch-invariant mode's norms on a GPU,
and the residual stream's norms at decode sizes (one launch, the residual add joined to it).

    y[r] = x[r] * rsqrt(mean_i x[r, i]^2 + eps) * scale   [* silu(z[r])],   x [R, W], scale [W]

One program holds a tile of rows (`rows_per_program(W)`, a function of the width alone), loaded in
`chunk(W)`-wide pieces: the pieces' squares are added in order, element by element, the result
summed across the piece, and each piece scaled and written. A last tile with fewer rows reads
zeros in place of the missing ones and writes only its real rows, so a row is summed the same way
whether it is alone in its pass or one of a thousand: the kernel tiles the rows itself, where
XLA's norm needs them padded to a fixed tile (a copy in, a slice out, per norm) to be pinned.

The model's norms call `rms_norm` (or `add_rms_norm`, the residual add joined to the norm after
it), which runs the kernel where `use_rms_norm_kernel` says (on a GPU on one device, in the mode,
and for the residual stream's norms of a few rows) and the norm's own XLA formula, on `row_tiled`
tiles, elsewhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.batch_invariant import invariant_rows, row_tiled
from pallas_kernels.tensor_parallel import tp_size

CHUNK = 1024  # widest piece of a row loaded at once (Triton tiles are powers of two)
TILE = 8192  # elements of x a program holds in registers: one 5120-wide row, 32 rows of 256
# Rows up to which the residual stream's norms run the kernel outside batch-invariant mode too
# (decode and short verify passes): one launch where XLA takes two or three, ~1.5 us each.
FEW_ROWS = 64


def chunk(W: int) -> int:
    """The piece of a row loaded at once: the largest power of two up to `CHUNK` dividing W."""
    return min(CHUNK, W & -W)


def rows_per_program(W: int) -> int:
    """Rows a program holds: the largest power of two whose rows fit `TILE` elements, at least one."""
    return 1 << max(0, (TILE // W).bit_length() - 1)


def kernel_fits(x: jax.Array) -> bool:
    """Widths the kernel takes: a whole number of pieces of at least 16 elements."""
    return chunk(x.shape[-1]) >= 16


def _kernel(x_ref, scale_ref, *refs, eps: float, n_rows: int, gated: bool, added: bool):
    """One tile of rows: x [R, W], scale [W], (z [R, W]), (h [R, W]) -> o [R, W] (and x + h
    [R, W], in x's dtype, which is the row normalised); rows at or past n_rows (the last tile's)
    read as zeros and are not written. Every piece of the tile is loaded before any is summed, so
    the loads overlap."""
    z_ref = refs[0] if gated else None
    h_ref = refs[gated] if added else None
    o_ref, *sum_ref = refs[gated + added:]
    R, W = x_ref.shape
    C = chunk(W)
    real = (pl.program_id(0) * R + jnp.arange(R) < n_rows)[:, None]
    pieces = [pl.ds(i * C, C) for i in range(W // C)]
    load = lambda ref, piece: plt.load(ref.at[:, piece], mask=real, other=0.0)  # noqa: E731
    xs = [load(x_ref, piece) for piece in pieces]
    if added:  # the residual stream's add, rounded to its dtype as the unfused add is
        xs = [(x.astype(jnp.float32) + load(h_ref, piece).astype(jnp.float32)).astype(x_ref.dtype)
              for x, piece in zip(xs, pieces)]
        for piece, x in zip(pieces, xs):
            plt.store(sum_ref[0].at[:, piece], x, mask=real)
    xs = [x.astype(jnp.float32) for x in xs]
    squares = functools.reduce(jnp.add, [x * x for x in xs])  # [R, C]: the pieces added in order
    inv = jax.lax.rsqrt(jnp.sum(squares, axis=1) / W + eps)[:, None]
    for piece, x in zip(pieces, xs):
        y = x * inv * scale_ref[piece][None, :]
        if gated:
            y = y * jax.nn.silu(load(z_ref, piece).astype(jnp.float32))
        plt.store(o_ref.at[:, piece], y.astype(o_ref.dtype), mask=real)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret"))
def rms_norm_pallas(x: jax.Array, scale: jax.Array, eps: float, z: jax.Array | None = None, *, out_dtype=None,
                    added: jax.Array | None = None, interpret: bool = False):
    """The Pallas kernel: x [..., W] normalised over its last axis, times scale [W] (float32) and,
    given z [..., W], times silu(z); computed in float32, returned in out_dtype (default x's).
    Given added [..., W], the row normalised is x + added (in x's dtype), and the result is the
    pair (x + added, normalised). W as `kernel_fits` says."""
    *lead, W = x.shape
    rows = x.reshape(-1, W)
    n, R = rows.shape[0], rows_per_program(W)
    tile = pl.BlockSpec((R, W), lambda i: (i, 0))
    extra = tuple(a.reshape(-1, W) for a in (z, added) if a is not None)
    out_shape = [jax.ShapeDtypeStruct((n, W), out_dtype or x.dtype)]
    if added is not None:
        out_shape.append(jax.ShapeDtypeStruct((n, W), x.dtype))
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, n_rows=n, gated=z is not None, added=added is not None),
        out_shape=out_shape,
        grid=(-(-n // R),),
        in_specs=[tile, pl.BlockSpec((W,), lambda i: (0,))] + [tile] * len(extra),
        out_specs=[tile] * len(out_shape),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="rms_norm",
    )(rows, scale.astype(jnp.float32), *extra)
    normed = out[0].reshape(*lead, W)
    return normed if added is None else (out[1].reshape(*lead, W), normed)


def use_rms_norm_kernel(x: jax.Array, few_rows: bool = False) -> bool:
    """Whether a norm of x [..., W] runs this kernel: on a GPU, on one device (a sharded norm's rows
    are split over devices), for widths it takes; inside batch-invariant mode, or with few_rows
    (the caller's choice, for norms XLA would not fuse into a neighbour) up to `FEW_ROWS` rows."""
    if not (jax.default_backend() == "gpu" and tp_size() == 1 and kernel_fits(x)):
        return False
    return invariant_rows() is not None or (few_rows and math.prod(x.shape[:-1]) <= FEW_ROWS)


def rms_norm(reference, x: jax.Array, scale: jax.Array, eps: float, z: jax.Array | None = None, *, out_dtype=None,
             few_rows: bool = False):
    """A model's norm of x [..., W] (times silu(z [..., W]) where given): the kernel where
    `use_rms_norm_kernel` says, else reference(x[, z]), the same norm in XLA, on the mode's tiles
    (`row_tiled`: the plain call outside the mode). scale [W] float32 multiplies the normalised
    row; out_dtype as the kernel's."""
    if use_rms_norm_kernel(x, few_rows):
        return rms_norm_pallas(x, scale, eps, z, out_dtype=out_dtype)
    return row_tiled(reference, *((x,) if z is None else (x, z)))


def add_rms_norm(reference, x: jax.Array, added: jax.Array, scale: jax.Array, eps: float):
    """The residual stream's add and the norm after it: x, added [..., W] -> (x + added,
    normalised x + added). Where `use_rms_norm_kernel(x, few_rows=True)` says, one kernel
    (XLA runs an add, a reduction and the scaling, three launches at decode sizes); else the add
    then reference(x + added) as `rms_norm` runs it."""
    if use_rms_norm_kernel(x, few_rows=True):
        return rms_norm_pallas(x, scale, eps, added=added)
    y = x + added
    return y, row_tiled(reference, y)
