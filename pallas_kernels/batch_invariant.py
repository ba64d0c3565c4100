"""Batch-invariant mode: a token's logits come out bitwise the same whatever else shares its pass.

XLA picks a matmul's algorithm (GEMV or tiled GEMM, the split of the reduction) by the number of
rows, so the same token's logits differ in the last bits between a one-token decode step, a
(k+1)-token verify pass, a prefill and another batch size, and greedy speculation can leave plain
decoding at a near-tie. In this mode every computation that mixes values within a token (the
projections, norms, the lm_head, attention) runs on fixed-shape tiles of rows, one tile at a
time, behind an optimization barrier that keeps XLA from fusing a tile with the ops around it; a
token's result then depends only on its own inputs. Ops that compute each element on its own
(activations, gates, rope) go through `elementwise`, tiled only where the backend needs it. A tile
holds `rows` rows of a full-width op and more of a narrow one (`tile_rows`: a per-head norm's
256-wide rows, 16 times as many), so a verify pass of a batch loops over few tiles. GDN runs its
recurrent rule token by token (the chunked rule is another order of the same sums), and attention
always spans the whole cache.

On the CPU XLA computes each tile: a fixed-shape tile compiles to one loop nest whatever program
holds it. On a GPU XLA may choose a matmul's algorithm per program (cuBLAS or Triton, tiles, split
of the reduction, by autotuning), so there the sums that mix a token's values run in Pallas kernels
whose order XLA cannot change: the projections and the lm_head in `fixed_order_matmul` and the
norms in `rms_norm` (each tiles the rows itself, so no padded copy of them is made), attention in
the flash kernel (whole query blocks, one key range) and the gated delta rule in its recurrent
kernel, whose unrolled step is the same code for every token. Routed experts run each (token,
expert) pair alone, whatever the pass size, and add a token's pairs in order
(`expert_matmul.expert_swiglu_invariant`); the router picks experts on fixed tiles of tokens.
The mode is entered with `batch_invariant(rows)` around tracing, as `spec_jax.engine.runner.Runner`
does; the layers call `row_tiled`, which is the plain call outside it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("batch_invariant_rows", default=None)


def invariant_tile_rows() -> int:
    """Tokens a tile holds on this backend: on the GPU a projection stays bound by its weight
    bytes well past 64 rows (an H200 does ~206 bf16 FLOP per HBM byte), so a tile of 64 should
    cost about what one row does and holds batch 8 x k = 7; on the CPU every padded row is
    arithmetic, so 8 (a verify of up to 7 drafts in one tile)."""
    return 64 if jax.default_backend() == "gpu" else 8


def tile_width() -> int:
    """The row width a tile of `invariant_rows()` rows is sized for: on the GPU a 4096-wide tile of
    64 rows is 1 MB of float32, a handful of microseconds of HBM traffic; on the CPU every padded
    element is arithmetic, so 512."""
    return 4096 if jax.default_backend() == "gpu" else 512


def tile_rows(width: int) -> int:
    """Rows a tile of `width`-wide rows holds: `invariant_rows()`, times the largest power of two
    that keeps the tile within `invariant_rows() * tile_width()` elements. A function of the op's
    width alone, so a row's tile has the same shape in every pass."""
    rows = invariant_rows()
    scale = max(1, tile_width() // width)
    return rows * (1 << (scale.bit_length() - 1))


@contextlib.contextmanager
def batch_invariant(rows: int | None):
    """Trace in batch-invariant mode with tiles of `rows` tokens (None: the default fast path)."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def invariant_rows() -> int | None:
    """The tile size of the batch-invariant mode being traced in, or None outside it."""
    return _ROWS.get()


def elementwise(fn: Callable, *xs: jax.Array, lead: int | None = None):
    """fn(*xs) for an op that computes each output element from the same elements of its inputs
    (an activation, a gate, rope): there is no sum across a row to pin. On the GPU it runs on the
    rows as they are: a fusion computes every element by the same per-thread code in any program.
    On the CPU it runs on `row_tiled` tiles (lead as there): XLA's CPU loops evaluate exp and log
    by code that depends on the loop's shape (vector body or scalar remainder), which moved a
    GDN decay's last bit between passes."""
    if invariant_rows() is None or jax.default_backend() == "gpu":
        return fn(*xs)
    return row_tiled(fn, *xs, lead=lead)


def row_tiled(fn: Callable, *xs: jax.Array, lead: int | None = None, fixed_rows: bool = False):
    """fn(*xs) with the first `lead` axes of every x (default: all but the last) flattened into
    rows and run `tile_rows(width of xs[0]'s rows)` rows at a time: fn sees [R, ...] tiles only,
    so a row's result does not depend on how many rows there are. fn returns an array [R, ...] or
    a tuple of them. fixed_rows: `invariant_rows()` rows whatever the width (a projection: its
    [R, N] output is far wider than its input rows). Outside the mode, fn(*xs) itself."""
    if invariant_rows() is None:
        return fn(*xs)
    lead = xs[0].ndim - 1 if lead is None else lead
    shape = xs[0].shape[:lead]
    n = math.prod(shape)
    rows = invariant_rows() if fixed_rows else tile_rows(math.prod(xs[0].shape[lead:]))
    tiles = -(-n // rows)

    def tiled(x):
        flat = x.reshape(n, *x.shape[lead:])
        flat = jnp.pad(flat, [(0, tiles * rows - n)] + [(0, 0)] * (flat.ndim - 1))
        return flat.reshape(tiles, rows, *flat.shape[1:])

    def one(tile):
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(tile)))

    def untiled(out):
        return out.reshape(tiles * rows, *out.shape[2:])[:n].reshape(*shape, *out.shape[2:])

    return jax.tree.map(untiled, jax.lax.map(one, tuple(tiled(x) for x in xs)))


def ordered_sum(x: jax.Array, axis: int) -> jax.Array:
    """x summed over `axis` term by term from index 0, as explicit adds: an order no backend's
    reduction can change, for the few terms of a token's expert pairs."""
    terms = jnp.moveaxis(x, axis, 0)
    return functools.reduce(jnp.add, list(terms))
