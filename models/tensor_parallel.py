"""Tensor parallelism for the Qwen3.5 target: which dimension of each parameter a 1-D mesh of N
devices splits, the channel layout that makes each device's slice self-contained, and placing a
model on the mesh.

Megatron's layout, with XLA's SPMD partitioner inserting the collectives:
- column-parallel (output channels split): GDN `in_proj_qkv/z/b/a`, attention `q/k/v_proj`, MLP
  and shared-expert `gate/up_proj`; with them the GDN conv, `A_log`, `dt_bias`, and the caches'
  head axes. Each device then holds whole heads: attention heads with their KV heads (GQA groups
  do not straddle devices when the KV heads divide evenly), GDN value heads with their key heads.
- row-parallel (input channels split, one all-reduce after): `out_proj`, `o_proj`, `down_proj`.
- routed experts: every device holds a 1/N slice of every expert's inner dimension. Decode reads
  a token's top-k experts; sliced this way every device works on every token and the block ends
  in the same single all-reduce as a dense MLP, where expert-parallel placement would leave the
  devices without a chosen expert idle at batch 1.
- vocabulary-parallel embedding and lm_head (rows split); norms, the router, the shared-expert
  gate and the MTP head's `fc` replicated.
- a degree above the KV heads (or the GDN key heads) that is a multiple of their count copies
  each head first (`models/head_copies.py`, as vLLM does), so each device still holds whole heads.

Concatenated outputs are grouped by device: `in_proj_qkv`'s rows [q | k | v] become
[q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (likewise the conv channels and the caches' conv windows, and
an expert's [gate | up] rows), so a contiguous 1/N slice holds one device's heads of each part;
`split_channels` reads that layout back. With N = 1 it is the checkpoint's own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.gated_deltanet import GatedDeltaNet
from models.head_copies import COPIED, PER_ROW_SCALES, channel_axis, head_copies, widen_heads
from models.layers import Linear, group_order
from models.qwen3_5 import Qwen3_5Config, Qwen3_5Model
from pallas_kernels.tensor_parallel import TP, on_axis

COLUMN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("out_proj", "o_proj", "down_proj")
HEAD_VECTORS = ("A_log", "dt_bias")  # one value per GDN value head: [..., nv]


def make_mesh(n: int) -> Mesh:
    """A 1-D mesh over the first n devices; ValueError naming n and the devices there are."""
    devices = jax.devices()
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(devices):
        raise ValueError(f"tensor_parallel_size={n!r} must be an integer from 1 to the {len(devices)} "
                         f"{jax.default_backend()} device(s) here")
    return jax.make_mesh((n,), (TP,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:n])


def check_divisible(cfg: Qwen3_5Config, n: int) -> None:
    """ValueError naming the first config field a tensor-parallel degree n does not divide; the
    `COPIED` head counts may also be below n when n is a multiple of them (their heads are copied)."""
    copies = head_copies(cfg, n)
    fields = ["num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"]
    fields += ["moe_intermediate_size", "shared_expert_intermediate_size"] if cfg.is_moe else ["intermediate_size"]
    for name in fields:
        if getattr(cfg, name) * copies.get(name, 1) % n:
            copies = " or a multiple of it (each device then holds a copy of a head)" if name in COPIED else ""
            raise ValueError(f"tensor_parallel_size={n} does not divide {name}={getattr(cfg, name)}: each device "
                             f"must hold a whole share; use a tensor_parallel_size that divides it{copies}")


def needs_copies(cfg: Qwen3_5Config, n: int) -> bool:
    """Whether n devices copy some heads of `cfg` (`models/head_copies.py`): the model is then
    read whole, copied and split, rather than split as it streams in."""
    return any(r > 1 for r in head_copies(cfg, n).values())


def grouped_sizes(path: tuple, cfg: Qwen3_5Config) -> tuple[int, ...] | None:
    """The parts of a parameter's concatenated channels (in_proj_qkv and its scales, conv1d,
    experts' gate_up), None for one whose channels are a single part."""
    if path[-1] == "conv1d" or (len(path) > 1 and path[-2] == "in_proj_qkv"):
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        return (key_dim, key_dim, cfg.value_dim)
    if path[-2:] == ("experts", "gate_up_proj"):
        return (cfg.moe_intermediate_size,) * 2
    return None


def param_spec(path: tuple, ndim: int, fmt: str | None, cfg: Qwen3_5Config, shards: int) -> P:
    """The PartitionSpec of the parameter at `path` (pure-dict keys) of `ndim` dimensions; fmt is
    the quantized format of the Linear it belongs to (None for a float one or a bare parameter).
    A vocabulary the devices do not divide evenly stays whole on each."""
    name, owner = path[-1], path[-2] if len(path) > 1 else None
    if path in (("embed_tokens",), ("lm_head", "weight")):
        return on_axis(ndim, 0) if cfg.vocab_size % shards == 0 else P()
    if owner == "experts":
        return on_axis(ndim, -2 if name == "gate_up_proj" else -1)
    if name == "conv1d":
        return on_axis(ndim, -3)
    if name in HEAD_VECTORS:
        return on_axis(ndim, -1)
    if owner in COLUMN:
        if name == "bias" or (name != "weight" and fmt in PER_ROW_SCALES):
            return on_axis(ndim, -1)  # one value per output channel
        return P() if name == "weight_scale_2" else on_axis(ndim, -2)
    if owner in ROW:
        if name == "bias" or name == "weight_scale_2" or (name != "weight" and fmt in PER_ROW_SCALES):
            return P()
        return on_axis(ndim, -1)
    return P()


def linear_formats(model: nnx.Module) -> dict[tuple, str | None]:
    """Module path -> the quantized format of each Linear (None when float)."""
    return {path: m.format for path, m in nnx.iter_modules(model) if isinstance(m, Linear)}


def mark_parallel(model: Qwen3_5Model, shards: int) -> None:
    """Tell the modules how the mesh splits them: each column- or row-parallel Linear its `split`
    ("out" or "in") and device count, the GDN blocks and the model the device count."""
    for path, m in nnx.iter_modules(model):
        if isinstance(m, Linear) and path and path[-1] in COLUMN + ROW:
            m.split, m.shards = ("out" if path[-1] in COLUMN else "in"), shards
        elif isinstance(m, (GatedDeltaNet, Qwen3_5Model)):
            m.shards = shards


def regroup(value, path: tuple, fmt: str | None, cfg: Qwen3_5Config, shards: int):
    """value (a parameter in the checkpoint's layout; numpy stays on the host) in the
    grouped-by-device layout."""
    sizes = grouped_sizes(path, cfg)
    if sizes is None or shards == 1:
        return value
    axis, per_entry = channel_axis(path[-1], fmt)
    sizes = tuple(s // per_entry for s in sizes)
    if any(size % shards for size in sizes):  # fp8 scale blocks of 128 channels
        raise ValueError(f"tensor_parallel_size={shards} does not divide the parts {sizes} of "
                         f"{'.'.join(map(str, path))}; use a size that divides each")
    xp = np if isinstance(value, np.ndarray) else jnp
    return xp.take(value, group_order(sizes, shards), axis=axis)


def place_param(value, path: tuple, fmt: str | None, cfg: Qwen3_5Config, mesh: Mesh, *, regrouped: bool):
    """One parameter on the mesh, split as `param_spec` says, regrouped first unless it already is;
    a host (numpy) value is sent to each device as its slice only."""
    shards = mesh.shape[TP]
    if not regrouped:
        value = regroup(value, path, fmt, cfg, shards)
    spec = param_spec(path, value.ndim, fmt, cfg, shards)
    split = [size for size, axis in zip(value.shape, spec) if axis == TP]
    if split and split[0] % shards:  # a quantized format's blocks that do not divide evenly
        raise ValueError(f"tensor_parallel_size={shards} does not divide {'.'.join(map(str, path))} (shape "
                         f"{tuple(value.shape)}, split along a dimension of {split[0]}); use a size that divides it")
    return jax.device_put(value, NamedSharding(mesh, spec))


def placement(mesh: Mesh):
    """For `fill_params`: given the (abstract) model being filled, marks it (`mark_parallel`) and
    returns the function that puts each parameter read from the checkpoint on the mesh
    (`place_param`); one whose heads `shard_model` must copy first stays in host memory."""

    def for_model(model: Qwen3_5Model):
        check_divisible(model.cfg, mesh.shape[TP])
        if needs_copies(model.cfg, mesh.shape[TP]):  # read whole into host memory; shard_model copies and splits
            return lambda path, value: value
        formats = linear_formats(model)
        mark_parallel(model, mesh.shape[TP])  # the model filled is in the grouped layout
        return lambda path, value: place_param(value, path, formats.get(path[:-1]), model.cfg, mesh, regrouped=False)

    return for_model


def shard_model(model: Qwen3_5Model, mesh: Mesh) -> Qwen3_5Model:
    """Put `model` on the tensor-parallel `mesh`, in place, and mark its modules (`mark_parallel`):
    heads copied where the degree exceeds their count (`widen_heads`), every parameter regrouped
    (unless the model already is: one a loader placed, or sharded before) and split. Returns the
    model."""
    shards = mesh.shape[TP]
    check_divisible(model.cfg, shards)
    formats, regrouped = linear_formats(model), model.shards == shards
    widen_heads(model, shards, formats)
    state = nnx.state(model)
    placed = {}
    for keypath, value in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        path = tuple(k.key for k in keypath)
        node = placed
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = place_param(value, path, formats.get(path[:-1]), model.cfg, mesh, regrouped=regrouped)
    nnx.replace_by_pure_dict(state, placed)
    nnx.update(model, state)
    mark_parallel(model, shards)
    return model


def replicate(tree, mesh: Mesh):
    """Every array of `tree` that is not already on `mesh` copied whole to each of its devices
    (the drafters, and anything else the step reads)."""
    whole = NamedSharding(mesh, P())

    def place(x):
        on_mesh = isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
        return x if on_mesh or not isinstance(x, jax.Array) else jax.device_put(x, whole)

    return jax.tree.map(place, tree)
