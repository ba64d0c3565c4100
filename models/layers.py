"""Layers and helpers every model in `models/` shares: `Linear` (float or weight-only quantized,
[out, in] as checkpoints store it), RMSNorm without the (1 + w) offset, the SwiGLU MLP, rotary
embeddings, attention over a masked or cached context, the `Batch` of new tokens and the
`KVCache`, and the layer stacking tools (`scan_layers`, `unstack_layers`, `fuse_linears`).

Shapes: B batch rows, T new tokens, L cache length, H hidden.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.batch_invariant import elementwise, invariant_rows, row_tiled
from pallas_kernels.fixed_order_matmul import BLOCK_N, fixed_order_matmul_pallas, use_fixed_order_matmul
from pallas_kernels.flash_attention import flash_attention, use_flash_attention
from pallas_kernels.quant_formats import QuantizedWeight, quantize
from pallas_kernels.quant_matmul import quant_matmul
from pallas_kernels.rms_norm import rms_norm


def expect_json(key: str, value, kind: type):
    """value, unless it is present and not of the JSON kind (object, array, boolean) the key holds:
    then ValueError naming the key."""
    if value is not None and not isinstance(value, kind):
        names = {dict: "an object", list: "a list", bool: "true or false"}
        raise ValueError(f"{key}={value!r} must be {names[kind]}")
    return value


def check_head_groups(cfg, heads: str, groups: str) -> None:
    """ValueError unless the config field `heads` is a multiple of the field `groups` (GQA-style
    sharing: each group serves heads // groups heads)."""
    if getattr(cfg, heads) % getattr(cfg, groups):
        raise ValueError(f"{heads} ({getattr(cfg, heads)}) must be a multiple of {groups} ({getattr(cfg, groups)})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of one pattern position's attention layers: [G, B, L, kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """Where the T new tokens of each row go.

    start: [B] int32 position of the first new token (= tokens already in the caches).
    n_valid: [B] int32 how many of the T tokens are real; the rest are padding, whose cache
      writes land past the row's length (never read) and leave GDN state unchanged.
    """

    start: jax.Array
    n_valid: jax.Array

    def positions_for(self, T: int) -> jax.Array:
        return self.start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

    def valid_for(self, T: int) -> jax.Array:
        return jnp.arange(T, dtype=jnp.int32)[None, :] < self.n_valid[:, None]


def zeros_param(shape, dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def scan_layers(body, init, xs):
    """`lax.scan(body, init, xs)` over stacked layers, rolled: compile time does not grow with
    depth. The engine's decode layout runs the layers unstacked and unrolled instead
    (`unstack_layers`), because inside the decode loop XLA copies every weight it slices out of a
    stack before the matmul that reads it."""
    return jax.lax.scan(body, init, xs)


def unstack_layers(owner: nnx.Module, name: str) -> nnx.List:
    """Take the modules `owner.<name>`, whose parameters are stacked over G repeats [G, ...], out
    of `owner` (the attribute becomes None) and return them as G nnx.Lists of the same modules,
    each repeat's parameters arrays of their own.

    Inside the decode `while_loop` XLA copies a weight sliced out of a stack before the matmul
    that reads it, every step, even when the slice is static; a weight that is a whole array is
    read in place. This function holds the only reference to the stacks and drops each one once
    sliced, so the peak is the model plus one parameter (when nothing else holds the stacks).
    """
    gdef, state = nnx.split(getattr(owner, name))
    setattr(owner, name, None)
    leaves, treedef = jax.tree.flatten(state)
    del state
    G = leaves[0].shape[0]
    groups = [[] for _ in range(G)]
    for i in range(len(leaves)):
        whole, leaves[i] = leaves[i], None
        for g in range(G):
            groups[g].append(whole[g])
        del whole
    return nnx.List([nnx.merge(gdef, jax.tree.unflatten(treedef, leaves_g)) for leaves_g in groups])


# A quantized Linear's scale and global-scale variables, named as the checkpoints carrying each
# format name their tensors (Qwen's FP8: weight_scale_inv; ModelOpt NVFP4: weight_scale, weight_scale_2).
SCALE_NAMES = {"int8": ("weight_scale", None), "fp8": ("weight_scale", None),
               "fp8_block": ("weight_scale_inv", None), "nvfp4": ("weight_scale", "weight_scale_2")}


def dot_transposed(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., K] @ w [N, K]^T -> [..., N] in out_dtype (default w's), x cast to w's dtype: XLA's
    dot, or in batch-invariant mode on a GPU the fixed-order kernel (`use_fixed_order_matmul`)."""
    if use_fixed_order_matmul():
        return fixed_order_matmul_pallas(x, w, out_dtype=out_dtype)
    return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=out_dtype)


def tiled_projection(fn: Callable, x: jax.Array):
    """fn(x) for a projection of x [..., K] (`dot_transposed` inside): in
    batch-invariant mode on tiles of rows (`row_tiled`), except where the fixed-order kernel runs
    it, which tiles the rows itself and needs no padded copy of them."""
    if use_fixed_order_matmul():
        return fn(x)
    return row_tiled(fn, x, fixed_rows=True)


class Linear(nnx.Module):
    """y = x W^T (+ b) with W stored [out, in] as in the checkpoint; a bias only where the
    architecture has one (Qwen3's `attention_bias`).

    After `quantize_linear`, `weight` holds a `QuantizedWeight`'s codes, its scales sit beside it
    under `SCALE_NAMES[format]`, and the product runs through the quantized-matmul dispatcher
    (the Pallas kernel on a GPU).
    """

    def __init__(self, d_in: int, d_out: int, *, bias: bool = False, stack=(), dtype=jnp.float32):
        self.weight = zeros_param((*stack, d_out, d_in), dtype)
        self.bias = zeros_param((*stack, d_out), dtype) if bias else None
        self.format = None  # static: None (float weight) or a quant_matmul format
        self.split = None  # static, under tensor parallelism: "out" (column-) or "in" (row-parallel)
        self.shards = 1  # static: the devices it is split over

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.format is None:
            return tiled_projection(self.apply, x)
        return row_tiled(self.apply, x, fixed_rows=True)

    def apply(self, x: jax.Array) -> jax.Array:
        """x [..., in] -> [..., out], as XLA or the kernel best computes it for x's shape."""
        if self.format is not None:
            y = quant_matmul(x, self.quantized(), split=self.split)
        else:
            y = dot_transposed(x, self.weight[...])
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)

    def quantized(self) -> QuantizedWeight:
        scale, global_scale = SCALE_NAMES[self.format]
        g = getattr(self, global_scale)[...] if global_scale else None
        return QuantizedWeight(self.weight[...], getattr(self, scale)[...], g, self.format)

    @classmethod
    def of(cls, weight: jax.Array, bias: jax.Array | None = None) -> Linear:
        """A float Linear holding `weight` [out, in] and `bias` [out] if any (no zeros allocated first)."""
        linear = nnx.eval_shape(lambda: cls(weight.shape[-1], weight.shape[-2], bias=bias is not None,
                                            dtype=weight.dtype))
        linear.weight = nnx.Param(weight)
        if bias is not None:
            linear.bias = nnx.Param(bias)
        return linear


def fuse_linears(module: nnx.Module, names: tuple[str, ...]) -> None:
    """Join the float Linears `names` of `module`, which read the same input, into one Linear
    `module.fused` whose weight is theirs stacked by rows, and drop them; `project` then runs one
    matmul where there were len(names). At decode sizes each matmul is a pass over its weight, and
    one long pass runs nearer the HBM ceiling than several short ones (BENCHMARKS.md). Quantized
    Linears stay apart: their scales do not concatenate in every format. On one device the joined
    rows are padded with zero rows to a whole number of the fixed-order kernel's widest block, so
    that it tiles them with that block rather than a narrow one or a padded copy per call (the
    GDN's [qkv | z | b | a] is 16,480 rows at 27B). In place; repeatable."""
    parts = [getattr(module, n) for n in names]
    if any(p is None or p.format is not None for p in parts):
        return
    shards = parts[0].shards  # under tensor parallelism the joined rows are grouped by device
    weights = [p.weight[...] for p in parts]
    biases = None
    if any(p.bias is not None for p in parts):  # a part without one adds zeros
        biases = [p.bias[...] if p.bias is not None else jnp.zeros(p.weight.shape[-2], p.weight.dtype) for p in parts]
    extra = -sum(w.shape[-2] for w in weights) % BLOCK_N[0] if shards == 1 else 0
    if extra:
        weights.append(jnp.zeros((*weights[0].shape[:-2], extra, weights[0].shape[-1]), weights[0].dtype))
        if biases:
            biases.append(jnp.zeros(extra, biases[0].dtype))
    bias = group_by_device(biases, shards, axis=-1) if biases else None
    fused = Linear.of(group_by_device(weights, shards, axis=-2), bias)
    fused.split, fused.shards = parts[0].split, shards
    module.fused = fused
    module.fused_sizes = tuple(p.weight.shape[0] for p in parts)
    for n in names:
        setattr(module, n, None)


def split_channels(y: jax.Array, sizes: tuple[int, ...], shards: int) -> tuple[jax.Array, ...]:
    """The parts of y [..., sum(sizes) + padding], each [..., size] in its own order; channels past
    the parts (`fuse_linears`' zero rows) are dropped. Under tensor parallelism over `shards`
    devices the channels come grouped by device, [part_0 of device 0 | part_1 of device 0 | ... |
    part_0 of device 1 | ...] (`models/tensor_parallel.py`), so each device's contiguous slice
    holds its share of every part."""
    ends = list(np.cumsum([s // shards for s in sizes]))
    parts = jnp.split(y.reshape(*y.shape[:-1], shards, -1), ends, axis=-1)[:len(sizes)]
    return tuple(p.reshape(*p.shape[:-2], -1) for p in parts)


def group_order(sizes: tuple[int, ...], shards: int) -> np.ndarray:
    """The permutation that takes channels [part_0 | part_1 | ...] to the grouped-by-device layout."""
    starts = np.cumsum((0, *sizes))
    return np.concatenate([np.arange(start + d * (s // shards), start + (d + 1) * (s // shards))
                           for d in range(shards) for start, s in zip(starts, sizes)])


def group_by_device(parts: list[jax.Array], shards: int, axis: int) -> jax.Array:
    """Concatenate parts along `axis` in the grouped-by-device layout, placed as parts[0] is."""
    joined = jnp.concatenate(parts, axis=axis)
    if shards == 1:
        return joined
    sizes = tuple(p.shape[axis] for p in parts)
    return jax.device_put(jnp.take(joined, group_order(sizes, shards), axis=axis), parts[0].sharding)


def project(module: nnx.Module, names: tuple[str, ...], x: jax.Array) -> tuple[jax.Array, ...]:
    """The outputs of `module`'s Linears `names` on x [..., in]: one matmul split by columns when
    `fuse_linears` joined them, else one matmul each."""
    fused = getattr(module, "fused", None)
    if fused is None:
        return tuple(getattr(module, n)(x) for n in names)
    return split_channels(fused(x), module.fused_sizes, fused.shards)


def quantize_linear(linear: Linear, fmt: str) -> None:
    """Quantize a float Linear in place: its weight [*stack, N, K] becomes `fmt` codes and scales,
    per stacked layer. Under `nnx.eval_shape` this only sets the shapes a loader fills."""
    q = functools.partial(quantize, fmt=fmt)
    for _ in range(linear.weight[...].ndim - 2):
        q = jax.vmap(q)
    qw = jax.jit(q)(linear.weight[...])  # one compiled program per shape, not one per op
    scale, global_scale = SCALE_NAMES[fmt]
    linear.weight = nnx.Param(qw.data)
    setattr(linear, scale, nnx.Param(qw.scale))
    if global_scale:
        setattr(linear, global_scale, nnx.Param(qw.global_scale))
    linear.format = fmt


def quantize_linears(model: nnx.Module, formats: dict[tuple, str]) -> nnx.Module:
    """Quantize the Linears at the given module paths (`nnx.iter_modules` keys) to their formats.
    Returns `model`; raises ValueError for a path that is not a float Linear."""
    linears = {path: m for path, m in nnx.iter_modules(model) if isinstance(m, Linear) and m.format is None}
    for path, fmt in formats.items():
        if path not in linears:
            raise ValueError(f"{'.'.join(map(str, path))} is not a float Linear of this model")
        quantize_linear(linears[path], fmt)
    return model


def apply_rope(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """NeoX rotate-half RoPE on the first `rotary_dim` dims of each head. x: [..., heads, d] at
    positions [...] (e.g. [B, T, heads, d] and [B, T])."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., half]
    cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
    xr = x[..., :rotary_dim].astype(jnp.float32)
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)


# Queries attended at once: the scores of a long prompt ([T, S] per head, float32) would not fit
# (a 16k-token prompt at 27B asks for 24 GiB), so longer ones run in blocks of this many rows.
QUERY_BLOCK = 1024


def attend_masked(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, context=None) -> jax.Array:
    """GQA attention with an explicit mask. q: [B, T, nq, d]; k, v: [B, S, nkv, d]; visible:
    [B, T, S] bool. Returns [B, T, nq, d]. context: a cache (ctx_k, ctx_v) [B, nkv, C, d] of keys
    before k, v, head-major so that the batched dots read it in place (never concatenated with
    k, v: that would copy the whole cache a call); visible is then [B, T, C + S]. Past QUERY_BLOCK
    queries, block by block (each query's softmax is its own, so the result is the same). In
    batch-invariant mode row by row, each row's queries in fixed tiles."""
    B, T = q.shape[:2]
    ctx = () if context is None else tuple(context)
    if invariant_rows() is not None:
        def one_row(args):
            qb, kb, vb, seen, *cb = args
            def tile(qt, st):
                return attend_block(qt[None], kb[None], vb[None], st[None], [c[None] for c in cb] or None)[0]
            return row_tiled(tile, qb, seen, lead=1)

        return jax.lax.map(one_row, (q, k, v, visible, *ctx))
    if T <= QUERY_BLOCK or T % QUERY_BLOCK:
        return attend_block(q, k, v, visible, context)
    n = T // QUERY_BLOCK
    blocks = lambda x: jnp.moveaxis(x.reshape(B, n, QUERY_BLOCK, *x.shape[2:]), 1, 0)  # noqa: E731
    out = jax.lax.map(lambda qv: attend_block(qv[0], k, v, qv[1], context), (blocks(q), blocks(visible)))
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)


def attend_block(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, context=None) -> jax.Array:
    """`attend_masked` over all queries at once: the scores over the context (if any) and over k,
    one softmax across both."""
    B, T, nq, d = q.shape
    nkv = k.shape[2]
    qg = q.reshape(B, T, nkv, nq // nkv, d)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32)
    if context is not None:
        ctx_scores = jnp.einsum("btgrd,bgsd->bgrts", qg, context[0], preferred_element_type=jnp.float32)
        scores = jnp.concatenate([ctx_scores, scores], axis=-1)
    scores = jnp.where(visible[:, None, None], scores * d**-0.5, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    C = scores.shape[-1] - k.shape[1]
    out = jnp.einsum("bgrts,bsgd->btgrd", probs[..., C:], v)
    if context is not None:
        out = out + jnp.einsum("bgrts,bgsd->btgrd", probs[..., :C], context[1])
    return out.reshape(B, T, nq, d)


def attend(q: jax.Array, cache: KVCache, g, kv_len: int, q_pos: jax.Array) -> jax.Array:
    """Causal GQA attention of new queries q [B, T, nq, d] at positions q_pos [B, T] (each row's
    start + t, as `Batch.positions_for` gives them) over slots [0, kv_len) of repeat g of the
    stacked cache [G, B, L, nkv, d]. Slot j is visible to a query
    at position p iff j <= p. Prefill-sized passes on a GPU (and every pass there in
    batch-invariant mode) run the flash kernel, which reads the repeat in place; others this
    masked softmax over the repeat's slice."""
    if use_flash_attention(q, kv_len):
        return flash_attention(q, cache.k, cache.v, q_pos, g, kv_len)
    keys = jax.lax.dynamic_index_in_dim(cache.k, g, keepdims=False)[:, :kv_len]
    values = jax.lax.dynamic_index_in_dim(cache.v, g, keepdims=False)[:, :kv_len]
    return attend_masked(q, keys, values, jnp.arange(kv_len)[None, None, :] <= q_pos[:, :, None])


def cached_attention(q, k, v, positions, cache: KVCache, g, kv_len: int):
    """Write repeat g's new K/V (k, v [B, T, kv, d] at positions [B, T]) into the stacked cache
    [G, B, L, kv, d], then attend q [B, T, nq, d] causally over slots [0, kv_len).
    Returns (o [B, T, nq, d], cache)."""
    rows = jnp.arange(q.shape[0])[:, None]
    # Padding tokens may point past the cache end: drop those writes (the rest land past the
    # row's length, where nothing reads them before real tokens overwrite them).
    cache = KVCache(
        cache.k.at[g, rows, positions].set(k.astype(cache.k.dtype), mode="drop"),
        cache.v.at[g, rows, positions].set(v.astype(cache.v.dtype), mode="drop"),
    )
    return attend(q, cache, g, kv_len, positions), cache


class Attention(nnx.Module):
    """GQA attention from `d_in`-wide inputs to `d_out`, configured by what each architecture adds:
    q/k norms over head_dim (`qk_norm`, a norm class taking (dim, eps); None for none), a per-head
    sigmoid output gate stored after each head's query in q_proj (`output_gate`, Qwen3.5), q/k/v/o
    biases (`bias`, Qwen3) and RoPE on the first `rotary_dim` dims (all of them by default).

    `__call__` is the causal form over a cache. Block drafters, which attend under their own mask,
    compose `project_heads`, `keys_values` and `output` instead. Shapes: x [B, T, d_in]; q [B, T, heads, d];
    k, v [B, T, kv_heads, d]; positions [B, T].
    """

    PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # read the same input: `fuse_linears` may join them

    def __init__(self, d_in: int, d_out: int, heads: int, kv_heads: int, head_dim: int, *, rope_theta: float,
                 rotary_dim: int | None = None, qk_norm=None, eps: float = 1e-6, output_gate: bool = False,
                 bias: bool = False, stack=(), dtype=jnp.float32):
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = heads, kv_heads, head_dim, rope_theta
        self.rotary_dim = rotary_dim or head_dim
        self.output_gate = output_gate
        q_width = heads * head_dim * (2 if output_gate else 1)
        self.q_proj = Linear(d_in, q_width, bias=bias, stack=stack, dtype=dtype)
        self.k_proj = Linear(d_in, kv_heads * head_dim, bias=bias, stack=stack, dtype=dtype)
        self.v_proj = Linear(d_in, kv_heads * head_dim, bias=bias, stack=stack, dtype=dtype)
        self.o_proj = Linear(heads * head_dim, d_out, bias=bias, stack=stack, dtype=dtype)
        self.q_norm = qk_norm(head_dim, eps, stack=stack) if qk_norm else None
        self.k_norm = qk_norm(head_dim, eps, stack=stack) if qk_norm else None

    def _rope(self, x: jax.Array, norm, positions: jax.Array) -> jax.Array:
        x = norm(x) if norm is not None else x
        return elementwise(lambda x, pos: apply_rope(x, pos, self.rotary_dim, self.rope_theta), x, positions, lead=2)

    @staticmethod
    def _split(x: jax.Array, heads: int) -> jax.Array:
        return x.reshape(*x.shape[:-1], heads, -1)

    def project_heads(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array,
                                                                         jax.Array]:
        """Normed, rotated queries, the output gate (None without one), keys and values of x."""
        qg, k, v = project(self, self.PROJECTIONS, x)
        qg = self._split(qg, self.num_heads)  # per head: [query | gate] with a gate
        d = self.head_dim
        q, gate = (qg[..., :d], qg[..., d:]) if self.output_gate else (qg, None)
        q = self._rope(q, self.q_norm, positions)
        k = self._rope(self._split(k, self.num_kv_heads), self.k_norm, positions)
        return q, gate, k, self._split(v, self.num_kv_heads)

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Normed, rotated keys and the values of x alone (a drafter's context)."""
        k = self._rope(self._split(self.k_proj(x), self.num_kv_heads), self.k_norm, positions)
        return k, self._split(self.v_proj(x), self.num_kv_heads)

    def output(self, o: jax.Array, gate: jax.Array | None) -> jax.Array:
        """Attended values o [B, T, heads, d] (gated per element when the block has a gate) -> [B, T, d_out]."""
        o = o.reshape(*o.shape[:-2], -1)
        if gate is not None:
            gated = lambda o, gate: o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)  # noqa: E731
            o = elementwise(gated, o, gate.reshape(o.shape))
        return self.o_proj(o)

    def __call__(self, x: jax.Array, batch: Batch, cache: KVCache, g, kv_len: int) -> tuple[jax.Array, KVCache]:
        """Writes repeat g's K/V of the new tokens into `cache` [G, B, L, kv, d], then attends
        causally over slots [0, kv_len). Returns ([B, T, d_out], cache)."""
        positions = batch.positions_for(x.shape[1])
        q, gate, k, v = self.project_heads(x, positions)
        o, cache = cached_attention(q, k, v, positions, cache, g, kv_len)
        return self.output(o, gate), cache


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    PROJECTIONS = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, inner: int, *, stack=(), dtype=jnp.float32):
        self.gate_proj = Linear(hidden, inner, stack=stack, dtype=dtype)
        self.up_proj = Linear(hidden, inner, stack=stack, dtype=dtype)
        self.down_proj = Linear(inner, hidden, stack=stack, dtype=dtype)

    def __call__(self, x):
        gate, up = project(self, self.PROJECTIONS, x)
        return self.down_proj(elementwise(lambda gate, up: jax.nn.silu(gate) * up, gate, up))


class PlainRMSNorm(nnx.Module):
    """Standard RMSNorm: x * rsqrt(mean(x^2) + eps) * w, weight kept and applied in float32.

    (Qwen3.5's `RMSNorm` is zero-centred, (1 + w); Qwen3's is not.)"""

    def __init__(self, dim: int, eps: float, *, stack=()):
        self.weight = nnx.Param(jnp.ones((*stack, dim), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(self.apply, x, self.weight[...], self.eps)

    def apply(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...]).astype(x.dtype)
