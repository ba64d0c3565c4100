"""Checkpoints in, NNX models out. `source` is the bottom (configs, errors, `TensorSource`,
`fill_params`); `safetensors`, `quantized`, `gguf`, `orbax` (directories `spec-jax convert`
wrote), `drafters` and `qwen3` read their formats on top of it; `load_model` here picks one."""

from __future__ import annotations

import os

from jax.sharding import Mesh

from models.tensor_parallel import check_divisible, needs_copies, placement, shard_model
from spec_jax.loading.gguf import find_gguf, load_gguf
from spec_jax.loading.orbax import is_converted, restore
from spec_jax.loading.safetensors import load_params
from pallas_kernels.tensor_parallel import TP
from spec_jax.loading.source import CheckpointError, load_config, resolve_dtype

__all__ = ["CheckpointError", "load_config", "load_model"]


def load_model(model_dir: str | os.PathLike, dtype="float32", *, progress: bool | None = None,
               mesh: Mesh | None = None):
    """Config + weights: returns (Qwen3_5Model, Qwen3_5Config). A directory written by
    `spec-jax convert` is restored with Orbax instead of converted again; a `.gguf` file (or a
    directory holding one and no safetensors) is read by `loading.gguf`.

    mesh: a tensor-parallel mesh (`models.tensor_parallel.make_mesh`) to split the model over as
    it loads: each device receives only its slices (Orbax restores them directly). A mesh wider
    than the KV heads (or GDN key heads) copies them: the weights are then read into host memory
    whole, copied and split (`models/head_copies.py`)."""
    place = placement(mesh) if mesh is not None else None
    gguf_file = find_gguf(model_dir)
    if gguf_file is not None:
        model, cfg = load_gguf(gguf_file, resolve_dtype(dtype), progress=progress, placement=place)
    elif is_converted(model_dir):
        copies = mesh is not None and needs_copies(load_config(model_dir), mesh.shape[TP])
        model, cfg = restore(model_dir, dtype if isinstance(dtype, str) else None, mesh=None if copies else mesh)
    else:
        cfg = load_config(model_dir)
        if mesh is not None:
            check_divisible(cfg, mesh.shape[TP])  # before reading any weight
        model, cfg = load_params(model_dir, cfg, resolve_dtype(dtype), progress=progress, placement=place)
    if mesh is not None:
        shard_model(model, mesh)  # copies heads, regroups what was read whole; streamed formats are in place
    return model, model.cfg
