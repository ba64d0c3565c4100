"""Routed experts as grouped matmuls: prefill, verify and batch decode (many (token, expert) pairs).

The P = N x k pairs are laid out in expert order, each expert's run padded to whole tiles of
`block_m` rows, so that every tile belongs to one expert (`group_by_expert`). A tile then is an
ordinary [block_m, H] x [H, 2I] matmul against that expert's weights: each expert's bytes are read
once per tile of its tokens, and no intermediate is larger than rows x max(H, 2I), where
rows <= P + min(E, P) x block_m (at most one partial tile per expert that has a pair).

    h[r] = silu(x[r] @ G[e]^T) * (x[r] @ U[e]^T)        gate_up [E, 2I, H] (gate rows first)
    y[r] = w[r] * (h[r] @ D[e]^T)                        down [E, H, I]
for row r of a tile of expert e; each pair's y is then gathered back and summed over its token's k.

`expert_swiglu_tiled` runs the tiles in plain JAX, one after another (the CPU path);
`expert_swiglu_grouped_pallas` runs them as two Triton kernels, one program per (tile,
block of output channels), tiles past the last one used skipping their work. The SwiGLU is applied
in the gate_up kernel's epilogue (both halves of a channel block are computed by one program), the
routing weight in the down kernel's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


@dataclasses.dataclass(frozen=True)
class GroupTiling:
    """Pair rows per tile (block_m; Triton's dot takes 16 and up), output channels per program
    (block_n), the K step (block_k), and the Triton launch shape."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def fits(self, hidden: int, inner: int) -> bool:
        """Triton loads power-of-two blocks only, and every block must divide its dimension."""
        powers = all(n & (n - 1) == 0 for n in (hidden, inner, self.block_m, self.block_n, self.block_k))
        return powers and min(hidden, inner) >= max(self.block_n, self.block_k)


class Groups(NamedTuple):
    """Pairs laid out by expert. tile_expert [tiles]: each tile's expert, -1 past the last used
    tile. row_pair [rows]: each row's pair (P on padding rows). pair_row [P]: each pair's row."""

    tile_expert: jax.Array
    row_pair: jax.Array
    pair_row: jax.Array


def tile_count(pairs: int, experts: int, block_m: int) -> int:
    """Tiles enough for any routing of `pairs` pairs: one partial tile per expert that has a pair."""
    return pairs // block_m + min(experts, pairs)


def group_by_expert(ids: jax.Array, experts: int, block_m: int) -> Groups:
    """ids: [N, k] int32 chosen experts -> `Groups` of the N x k pairs (pair p = token p // k)."""
    flat = ids.reshape(-1).astype(jnp.int32)
    pairs = flat.shape[0]
    tiles = tile_count(pairs, experts, block_m)
    order = jnp.argsort(flat, stable=True)  # pairs in expert order
    counts = jnp.bincount(flat, length=experts).astype(jnp.int32)
    expert_tiles = (counts + block_m - 1) // block_m
    tiles_before = jnp.cumsum(expert_tiles) - expert_tiles
    pairs_before = jnp.cumsum(counts) - counts
    expert = flat[order]
    row = tiles_before[expert] * block_m + jnp.arange(pairs, dtype=jnp.int32) - pairs_before[expert]
    pair_row = jnp.zeros(pairs, jnp.int32).at[order].set(row)
    row_pair = jnp.full(tiles * block_m, pairs, jnp.int32).at[row].set(order.astype(jnp.int32))
    t = jnp.arange(tiles, dtype=jnp.int32)
    # compare_all: one fused [tiles, E] comparison rather than log2(E) dependent gathers
    tile_expert = jnp.searchsorted(jnp.cumsum(expert_tiles), t, side="right", method="compare_all")
    tile_expert = tile_expert.astype(jnp.int32)
    tile_expert = jnp.where(t < jnp.sum(expert_tiles), tile_expert, -1)
    return Groups(tile_expert, row_pair, pair_row)


def _rows(x: jax.Array, weights: jax.Array, groups: Groups, k: int) -> tuple[jax.Array, jax.Array]:
    """Each row's token [rows, H] and routing weight [rows] float32 (0 on padding rows)."""
    pairs = weights.size
    valid = groups.row_pair < pairs
    token = jnp.where(valid, groups.row_pair // k, 0)
    pair = jnp.where(valid, groups.row_pair, 0)
    return x[token], jnp.where(valid, weights.reshape(-1)[pair].astype(jnp.float32), 0.0)


def _combine(y_rows: jax.Array, groups: Groups, shape: tuple[int, int], k: int, dtype) -> jax.Array:
    """Rows' outputs [rows, H] -> each token's sum over its k pairs [N, H] in `dtype`."""
    return y_rows[groups.pair_row].reshape(shape[0], k, shape[1]).sum(axis=1).astype(dtype)


def expert_swiglu_tiled(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array, weights: jax.Array,
                        *, block_m: int = 64) -> jax.Array:
    """The tiles in plain JAX, one after another (each slices its one expert out of the stacks, so
    nothing holds more than one expert's weights). Shapes as
    `expert_matmul.expert_swiglu_reference`: x [N, H], gate_up [E, 2I, H], down [E, H, I],
    ids / weights [N, k] -> [N, H]."""
    k = ids.shape[1]
    groups = group_by_expert(ids, gate_up.shape[0], block_m)
    rows, r = _rows(x, weights, groups, k)
    tiles = groups.tile_expert.shape[0]
    half = down.shape[2]

    def tile(args):
        xt, e = args
        e = jnp.maximum(e, 0)  # an unused tile computes on expert 0; its rows are never read
        gu = jnp.dot(xt, gate_up[e].T, preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gu[:, :half]) * gu[:, half:]).astype(x.dtype)
        return jnp.dot(h, down[e].T, preferred_element_type=jnp.float32)

    y = jax.lax.map(tile, (rows.reshape(tiles, block_m, -1), groups.tile_expert))
    return _combine(y.reshape(tiles * block_m, -1) * r[:, None], groups, x.shape, k, x.dtype)


def _gate_up_tile(te_ref, x_ref, w_ref, h_ref, *, half: int, bn: int, bk: int, k_steps: int):
    """Tile t, channel block j: h[tile, j] = silu(x @ G[e, j]^T) * (x @ U[e, j]^T), G = w[e, :half]."""
    t, j = pl.program_id(0), pl.program_id(1)
    e = te_ref[t]

    @pl.when(e >= 0)
    def _():
        def step(i, acc):
            gate, up = acc
            xs = x_ref[:, pl.ds(i * bk, bk)]
            g = w_ref[e, pl.ds(j * bn, bn), pl.ds(i * bk, bk)]
            u = w_ref[e, pl.ds(half + j * bn, bn), pl.ds(i * bk, bk)]
            dims = (((1,), (1,)), ((), ()))
            return (gate + jax.lax.dot_general(xs, g, dims, preferred_element_type=jnp.float32),
                    up + jax.lax.dot_general(xs, u, dims, preferred_element_type=jnp.float32))

        zeros = jnp.zeros((x_ref.shape[0], bn), jnp.float32)
        gate, up = jax.lax.fori_loop(0, k_steps, step, (zeros, zeros))
        h_ref[...] = (gate * jax.nn.sigmoid(gate) * up).astype(h_ref.dtype)


def _down_tile(te_ref, h_ref, r_ref, w_ref, y_ref, *, bn: int, bk: int, k_steps: int):
    """Tile t, channel block j: y[tile, j] = r[tile] * (h @ D[e, j]^T)."""
    t, j = pl.program_id(0), pl.program_id(1)
    e = te_ref[t]

    @pl.when(e >= 0)
    def _():
        def step(i, acc):
            w = w_ref[e, pl.ds(j * bn, bn), pl.ds(i * bk, bk)]
            return acc + jax.lax.dot_general(h_ref[:, pl.ds(i * bk, bk)], w, (((1,), (1,)), ((), ())),
                                             preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, k_steps, step, jnp.zeros((h_ref.shape[0], bn), jnp.float32))
        y_ref[...] = acc * r_ref[...][:, None]


def _whole(shape) -> pl.BlockSpec:
    """The whole array as one block: in the Triton backend a pointer the kernel indexes itself."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def expert_swiglu_grouped_pallas(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array,
                                 weights: jax.Array, *, tiling: GroupTiling = GroupTiling(),
                                 interpret: bool = False) -> jax.Array:
    """The Triton kernels; same arguments and result as `expert_swiglu_tiled`."""
    k = ids.shape[1]
    H, inner = x.shape[1], down.shape[2]
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    groups = group_by_expert(ids, gate_up.shape[0], bm)
    rows, r = _rows(x, weights, groups, k)
    tiles = groups.tile_expert.shape[0]
    params = plt.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    h = pl.pallas_call(
        functools.partial(_gate_up_tile, half=inner, bn=bn, bk=bk, k_steps=H // bk),
        out_shape=jax.ShapeDtypeStruct((tiles * bm, inner), x.dtype),
        grid=(tiles, inner // bn),
        in_specs=[_whole((tiles,)), pl.BlockSpec((bm, H), lambda t, j: (t, 0)), _whole(gate_up.shape)],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        compiler_params=params, interpret=interpret, name="expert_grouped_gate_up",
    )(groups.tile_expert, rows, gate_up)
    y = pl.pallas_call(
        functools.partial(_down_tile, bn=bn, bk=bk, k_steps=inner // bk),
        out_shape=jax.ShapeDtypeStruct((tiles * bm, H), jnp.float32),
        grid=(tiles, H // bn),
        in_specs=[_whole((tiles,)), pl.BlockSpec((bm, inner), lambda t, j: (t, 0)),
                  pl.BlockSpec((bm,), lambda t, j: (t,)), _whole(down.shape)],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        compiler_params=params, interpret=interpret, name="expert_grouped_down",
    )(groups.tile_expert, h, r, down)
    return _combine(y, groups, x.shape, k, x.dtype)
