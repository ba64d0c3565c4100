"""A token's chosen experts, multiplied in place: the routed-expert SwiGLU for decode and verify.

For P = N x k (token, expert) pairs with expert ids e[p] and routing weights r[p]:
    h[p] = silu(x[p // k] @ G[e[p]]^T) * (x[p // k] @ U[e[p]]^T)      gate_up [E, 2I, H]
    y[p] = r[p] * (h[p] @ D[e[p]]^T)                                   down [E, H, I]
and the caller sums y over each token's k pairs.

Indexing the stacked weights by the expert ids in XLA (`w[ids]`) gathers the chosen experts into a
new array before the dot, so each of their bytes is read, written and read again. The kernels
here read an expert's rows straight from the stack: one program per (pair, block of BN output
channels) loads the expert id, then streams its [BN, BK] weight tiles against the pair's input
row in float32 (a GEMV: decode moves weights, not FLOPs). The SwiGLU between the two products is
applied as the down kernel loads its input, and the routing weight as it stores its output.

`expert_swiglu` is the dispatcher the model calls. Up to `GEMV_MAX_PAIRS` pairs (decode of a few
rows) these kernels on a GPU, the gathering reference elsewhere. Past it pairs repeat experts often
enough that the grouped matmuls of `expert_grouped` read less (each expert once per tile of its
pairs): the Triton kernels on a GPU, their plain-JAX form elsewhere.

In batch-invariant mode (`expert_swiglu_invariant`) a pair's output must not depend on how many
pairs share the pass, and the switch at `GEMV_MAX_PAIRS` (GEMV or grouped tiles, two orders of the
same sums) would make it. So every pass runs one per-pair form: on a GPU these kernels, which
reduce each pair alone over K in fixed `Tiling` steps whatever the grid, fed in expert order past
`GEMV_MAX_PAIRS` pairs so that programs running together share an expert's weights in cache (the
order changes which program computes a pair, never its sums); elsewhere `pair_swiglu_reference` on
fixed tiles of pairs. Each token's k pair outputs are then added in pair order.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import PartitionSpec as P

from pallas_kernels.batch_invariant import invariant_rows, ordered_sum, row_tiled
from pallas_kernels.expert_grouped import GroupTiling, expert_swiglu_grouped_pallas, expert_swiglu_tiled
from pallas_kernels.tensor_parallel import TP, on_axis, per_device, tp_size


def expert_swiglu_reference(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array,
                            weights: jax.Array) -> jax.Array:
    """Routed experts by gathering the chosen experts' weights.

    Args:
      x: [N, H] tokens. gate_up: [E, 2I, H] (gate rows first). down: [E, H, I].
      ids: [N, k] int32 chosen experts. weights: [N, k] their routing weights.
    Returns:
      [N, H] in x's dtype: the weighted sum of each token's k expert outputs.
    """
    gu = jnp.einsum("nh,nkoh->nko", x, gate_up[ids])
    half = gu.shape[-1] // 2
    inner = jax.nn.silu(gu[..., :half]) * gu[..., half:]
    out = jnp.einsum("nki,nkhi->nkh", inner, down[ids])
    return jnp.einsum("nkh,nk->nh", out, weights.astype(out.dtype))


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Output channels per program (block_n) and the K tile each loop step streams (block_k)."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4

    def fits(self, n: int, k: int) -> bool:
        """Blocks must divide the weight (Triton loads power-of-two blocks only)."""
        return n % self.block_n == 0 and k % min(self.block_k, k) == 0


def _expert_block(w_ref, e, j, load_input, *, bn: int, bk: int, k_steps: int) -> jax.Array:
    """Output block j [bn] float32 of input @ w[e]^T, the input's K tile i read by load_input(i) [bk]."""

    def body(i, acc):
        w = w_ref[e, pl.ds(j * bn, bn), pl.ds(i * bk, bk)].astype(jnp.float32)
        return acc + jnp.sum(w * load_input(i)[None, :], axis=1)

    return jax.lax.fori_loop(0, k_steps, body, jnp.zeros((bn,), jnp.float32))


def _gate_up_kernel(ids_ref, x_ref, w_ref, o_ref, *, k: int, bn: int, bk: int, k_steps: int):
    """Pair p, output block j: o[p, j*bn:(j+1)*bn] = x[p // k] @ w[ids[p], block]^T."""
    p, j = pl.program_id(0), pl.program_id(1)
    row = p // k
    load_x = lambda i: x_ref[row, pl.ds(i * bk, bk)].astype(jnp.float32)  # noqa: E731
    o_ref[p, pl.ds(j * bn, bn)] = _expert_block(w_ref, ids_ref[p], j, load_x, bn=bn, bk=bk, k_steps=k_steps)


def _down_kernel(ids_ref, r_ref, gu_ref, w_ref, o_ref, *, half: int, bn: int, bk: int, k_steps: int):
    """Pair p, output block j: o[p, block] = r[p] * (silu(gate[p]) * up[p]) @ w[ids[p], block]^T."""
    p, j = pl.program_id(0), pl.program_id(1)

    def load_h(i):  # the SwiGLU of the gate_up kernel's output, as the K tile is read
        gate = gu_ref[p, pl.ds(i * bk, bk)]
        return gate * jax.nn.sigmoid(gate) * gu_ref[p, pl.ds(half + i * bk, bk)]

    acc = _expert_block(w_ref, ids_ref[p], j, load_h, bn=bn, bk=bk, k_steps=k_steps)
    o_ref[p, pl.ds(j * bn, bn)] = (acc * r_ref[p]).astype(o_ref.dtype)


def _whole(shape) -> pl.BlockSpec:
    """The whole array as one block: in the Triton backend a pointer the kernel indexes itself."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("tiling", "interpret"))
def expert_swiglu_pallas(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array, weights: jax.Array,
                         *, tiling: Tiling = Tiling(), interpret: bool = False) -> jax.Array:
    """The kernels; same arguments and result as `expert_swiglu_reference`."""
    N, k = ids.shape
    out = _pair_outputs_pallas(x, gate_up, down, ids.reshape(N * k), weights.reshape(N * k), k=k, tiling=tiling,
                               interpret=interpret)
    return out.reshape(N, k, -1).sum(axis=1).astype(x.dtype)


def _pair_outputs_pallas(x, gate_up, down, ids, weights, *, k: int, tiling: Tiling, interpret: bool) -> jax.Array:
    """Each pair's weighted expert output: x [N, H], pair p of token p // k with expert ids [P] and
    routing weight weights [P] -> [P, H] float32."""
    two_i, H = gate_up.shape[1:]
    inner = down.shape[2]
    P = ids.shape[0]
    flat_ids = ids.astype(jnp.int32)
    params = plt.CompilerParams(num_warps=tiling.num_warps, num_stages=1)
    bk_h, bk_i = min(tiling.block_k, H), min(tiling.block_k, inner)
    gu = pl.pallas_call(
        functools.partial(_gate_up_kernel, k=k, bn=tiling.block_n, bk=bk_h, k_steps=H // bk_h),
        out_shape=jax.ShapeDtypeStruct((P, two_i), jnp.float32),
        grid=(P, two_i // tiling.block_n),
        in_specs=[_whole((P,)), _whole(x.shape), _whole(gate_up.shape)],
        out_specs=_whole((P, two_i)),
        compiler_params=params, interpret=interpret, name="expert_gate_up",
    )(flat_ids, x, gate_up)
    out = pl.pallas_call(
        functools.partial(_down_kernel, half=inner, bn=tiling.block_n, bk=bk_i, k_steps=inner // bk_i),
        out_shape=jax.ShapeDtypeStruct((P, H), jnp.float32),
        grid=(P, H // tiling.block_n),
        in_specs=[_whole((P,)), _whole((P,)), _whole(gu.shape), _whole(down.shape)],
        out_specs=_whole((P, H)),
        compiler_params=params, interpret=interpret, name="expert_down",
    )(flat_ids, weights.astype(jnp.float32), gu, down)
    return out


# Pairs up to which one GEMV per pair beats the grouped tiles, whose sorting and gathers cost tens
# of microseconds a layer (bench.experts): batch-8 decode of 35B-A3B is 72 pairs (8 routed + shared).
GEMV_MAX_PAIRS = 128


def kernel_fits(gate_up: jax.Array, down: jax.Array, tiling: Tiling = Tiling()) -> bool:
    """Shapes the Triton kernels take: power-of-two sizes their blocks divide."""
    two_i, H = gate_up.shape[1:]
    inner = down.shape[2]
    powers = all(n & (n - 1) == 0 for n in (two_i, H, inner))
    return powers and tiling.fits(two_i, H) and tiling.fits(H, inner)


def expert_swiglu(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array,
                  weights: jax.Array) -> jax.Array:
    """Dispatcher for routed experts (see `expert_swiglu_reference` for the shapes). Under a
    tensor-parallel mesh every device holds a slice of every expert's inner dimension (gate_up's
    rows grouped by device: [gate_d | up_d] per device d): it runs its slice on every token and
    the partial outputs are summed across devices."""
    if tp_size() == 1:
        return _expert_swiglu_local(x, gate_up, down, ids, weights)

    def partial_sum(x, gate_up, down, ids, weights):
        return jax.lax.psum(_expert_swiglu_local(x, gate_up, down, ids, weights), TP)

    whole = P()
    return per_device(partial_sum, (whole, on_axis(3, 1), on_axis(3, 2), whole, whole), whole)(
        x, gate_up, down, ids, weights)


def group_tiling(pairs: int) -> GroupTiling:
    """Grouped tiles for `pairs` pairs: short tiles where an expert gets few pairs (batch decode,
    verify), taller ones where it gets many (prefill: a 1,024-token prompt gives 32 a expert)."""
    block_m = 16 if pairs <= 512 else 32 if pairs <= 4096 else 64
    return GroupTiling(block_m=block_m)


def _expert_swiglu_local(x, gate_up, down, ids, weights):
    if invariant_rows() is not None:
        return expert_swiglu_invariant(x, gate_up, down, ids, weights)
    on_gpu = jax.default_backend() == "gpu"
    if ids.size <= GEMV_MAX_PAIRS:
        if on_gpu and kernel_fits(gate_up, down):
            return expert_swiglu_pallas(x, gate_up, down, ids, weights)
        return expert_swiglu_reference(x, gate_up, down, ids, weights)
    tiling = group_tiling(ids.size)
    if on_gpu and tiling.fits(x.shape[1], down.shape[2]):
        return expert_swiglu_grouped_pallas(x, gate_up, down, ids, weights, tiling=tiling)
    return expert_swiglu_tiled(x, gate_up, down, ids, weights, block_m=tiling.block_m)


def pair_swiglu_reference(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array,
                          weights: jax.Array) -> jax.Array:
    """Each pair alone, in float32: x [P, H] (each pair's token), ids / weights [P] ->
    weights[p] * swiglu of x[p] through expert ids[p], [P, H] float32. Every product is a dot of
    one pair's vectors (a batch of GEMVs over the pairs), so no sum mixes two pairs."""
    gu = jnp.einsum("ph,poh->po", x.astype(jnp.float32), gate_up[ids].astype(jnp.float32))
    half = gu.shape[-1] // 2
    inner = jax.nn.silu(gu[:, :half]) * gu[:, half:]
    return jnp.einsum("pi,phi->ph", inner, down[ids].astype(jnp.float32)) * weights.astype(jnp.float32)[:, None]


def expert_swiglu_invariant(x: jax.Array, gate_up: jax.Array, down: jax.Array, ids: jax.Array, weights: jax.Array,
                            *, interpret: bool = False) -> jax.Array:
    """Routed experts in batch-invariant mode (shapes as `expert_swiglu_reference`): a pair's output
    is the same bits whatever else shares the pass. On a GPU the per-pair kernels (`interpret`:
    in Pallas' interpreter), elsewhere `pair_swiglu_reference` on fixed tiles of pairs; a token's
    k outputs added in pair order."""
    N, k = ids.shape
    P = N * k
    flat_ids, flat_weights = ids.reshape(P).astype(jnp.int32), weights.reshape(P)
    token = jnp.arange(P, dtype=jnp.int32) // k
    if jax.default_backend() == "gpu" or interpret:
        if not kernel_fits(gate_up, down):
            raise ValueError(f"batch_invariant=True on a GPU runs routed experts in the per-pair kernel, which takes "
                             f"power-of-two sizes that its {Tiling()} blocks divide; this model's experts are "
                             f"hidden {gate_up.shape[2]}, inner {down.shape[2]}")

        def kernels(sel):  # the pairs sel, in that order: [len(sel), H]
            return _pair_outputs_pallas(x[token[sel]], gate_up, down, flat_ids[sel], flat_weights[sel], k=1,
                                        tiling=Tiling(), interpret=interpret)

        if P <= GEMV_MAX_PAIRS:
            out = kernels(jnp.arange(P))
        else:  # in expert order, so that programs running together share an expert's weights in cache
            order = jnp.argsort(flat_ids, stable=True)
            out = jnp.zeros((P, x.shape[1]), jnp.float32).at[order].set(kernels(order), unique_indices=True)
    else:
        def tile(xt, it, wt):
            return pair_swiglu_reference(xt, gate_up, down, it, wt)

        out = row_tiled(tile, x[token], flat_ids, flat_weights, fixed_rows=True)
    return ordered_sum(out.reshape(N, k, -1), axis=1).astype(x.dtype)
