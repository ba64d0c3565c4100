"""Copies of the key-value heads (and the GDN key heads) for a tensor-parallel degree above their
count, as vLLM replicates KV heads: with n devices and h < n heads, n a multiple of h, each head
is copied n // h times, consecutively, so that every device holds one whole head.

Consecutive copies keep every query head on its own key: query head j reads KV head
j // (heads // kv_heads) in GQA, and GDN value head j reads key head j // (nv // nk); with each
key head repeated r times and the count multiplied by r, both quotients name a copy of the
same head. The model computes what it computed before, at r times the KV cache (each device
keeps the copy it needs, as in vLLM).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import Attention
from models.qwen3_5 import Qwen3_5Config, Qwen3_5Model
from pallas_kernels.quant_formats import BLOCK

COPIED = ("num_key_value_heads", "linear_num_key_heads")  # the head counts a degree past them copies
KV_PROJECTIONS = ("k_proj", "v_proj")
PER_ROW_SCALES = ("int8", "fp8")  # quantized formats with one scale per output channel


def head_copies(cfg: Qwen3_5Config, n: int) -> dict[str, int]:
    """How many copies of each head of the `COPIED` counts n devices need: n // count where n is
    a multiple of the count above it, else 1 (a degree that divides the count, or one that
    `check_divisible` refuses)."""
    return {name: n // getattr(cfg, name) if n > getattr(cfg, name) and n % getattr(cfg, name) == 0 else 1
            for name in COPIED}


def widened_config(cfg: Qwen3_5Config, n: int) -> Qwen3_5Config:
    """cfg with the head counts `head_copies` multiplies."""
    copies = head_copies(cfg, n)
    return dataclasses.replace(cfg, **{name: getattr(cfg, name) * r for name, r in copies.items()})


def channel_axis(name: str, fmt: str | None) -> tuple[int, int]:
    """(axis, channels per entry) of a projection's parameter `name` along its output channels:
    the weight's rows (a conv's channels), a bias' or a per-row scale's entries, or an FP8 block
    scale's rows of BLOCK channels."""
    if name == "conv1d":
        return -3, 1
    if name in ("weight", "gate_up_proj"):  # rows are channels (an expert's [gate | up] too)
        return -2, 1
    if name == "bias" or fmt in PER_ROW_SCALES:
        return -1, 1
    return -2, BLOCK if fmt == "fp8_block" else 1


def repeat_heads(value, axis: int, heads: int, r: int):
    """value with the `heads` equal parts of its `axis` each repeated r times in place:
    [h0 h1] -> [h0 h0 h1 h1] for r = 2. numpy stays numpy."""
    xp = np if isinstance(value, np.ndarray) else jnp
    moved = xp.moveaxis(value, axis, 0)
    if moved.shape[0] % heads:
        raise ValueError(f"a dimension of {moved.shape[0]} cannot be cut into {heads} heads to copy")
    parts = moved.reshape(heads, moved.shape[0] // heads, *moved.shape[1:])
    return xp.moveaxis(xp.repeat(parts, r, axis=0).reshape(-1, *moved.shape[1:]), 0, axis)


def widen_param(value, path: tuple, fmt: str | None, cfg: Qwen3_5Config, copies: dict[str, int]):
    """One parameter (pure-dict `path`, checkpoint layout) with the heads `copies` says copied:
    attention k/v projections by KV head; GDN in_proj_qkv and conv1d in their q and k parts by
    key head (the v part is per value head and stays)."""
    name, owner = path[-1], path[-2] if len(path) > 1 else None
    if name == "weight_scale_2":  # one scale for the whole projection
        return value
    axis, per_entry = channel_axis(name, fmt)
    r_kv, r_k = copies["num_key_value_heads"], copies["linear_num_key_heads"]
    if owner in KV_PROJECTIONS and r_kv > 1:
        return repeat_heads(value, axis, cfg.num_key_value_heads, r_kv)
    if (name == "conv1d" or owner == "in_proj_qkv") and r_k > 1:
        xp = np if isinstance(value, np.ndarray) else jnp
        key = cfg.linear_num_key_heads * cfg.linear_key_head_dim // per_entry
        q, k, v = xp.split(value, [key, 2 * key], axis=axis)
        nk = cfg.linear_num_key_heads
        return xp.concatenate([repeat_heads(q, axis, nk, r_k), repeat_heads(k, axis, nk, r_k), v], axis=axis)
    return value


def widen_heads(model: Qwen3_5Model, n: int, formats: dict[tuple, str | None]) -> None:
    """Copy `model`'s heads for n devices, in place (parameters in the checkpoint's channel layout,
    before `shard_model` regroups them): its parameters, its config and the attention modules'
    KV head counts. formats: module path -> quantized format (None when float)."""
    cfg = model.cfg
    copies = head_copies(cfg, n)
    if all(r == 1 for r in copies.values()):
        return
    wide = widened_config(cfg, n)
    state = nnx.state(model)
    flat, tree = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    paths = [tuple(k.key for k in keypath) for keypath, _ in flat]
    leaves = [widen_param(value, path, formats.get(path[:-1]), cfg, copies) for path, (_, value) in zip(paths, flat)]
    nnx.replace_by_pure_dict(state, jax.tree.unflatten(tree, leaves))
    nnx.update(model, state)
    for _, module in nnx.iter_modules(model):
        if getattr(module, "cfg", None) == cfg:
            module.cfg = wide
        if isinstance(module, Attention) and module.num_kv_heads == cfg.num_key_value_heads:
            module.num_kv_heads = wide.num_key_value_heads
