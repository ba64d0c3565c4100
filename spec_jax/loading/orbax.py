"""Directories `spec-jax convert` wrote (`spec_jax.writing.convert`): `params/` saved with
orbax-checkpoint, restored as arrays already mapped, stacked and cast; `spec_jax.json` (the
marker) says how they were made and lists every params/ file with its size.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from models.layers import quantize_linears
from models.qwen3_5 import Qwen3_5Model
from models.tensor_parallel import check_divisible, param_spec
from pallas_kernels.quant_formats import E2M1_BITS, FORMATS, nvfp4_from_modelopt
from pallas_kernels.tensor_parallel import TP
from spec_jax.loading.source import CheckpointError, load_config, read_json, resolve_dtype

MARKER = "spec_jax.json"
NVFP4_BITS = [list(b) for b in E2M1_BITS]  # the NVFP4 byte layout as the marker records it


def is_converted(model_dir: str | os.PathLike) -> bool:
    return (Path(model_dir) / MARKER).exists()


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file under `folder` (relative path) and its size in bytes."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def check_file_sizes(model_dir: Path, marker: dict) -> None:
    """Every file the marker lists under params/ is there at its saved size (a truncated or lost
    file is refused by name; a same-size corruption is not detected). Directories converted
    before the marker listed files are not checked."""
    files = marker.get("files") or {}
    if not isinstance(files, dict) or not all(type(size) is int for size in files.values()):
        raise CheckpointError(f"{model_dir / MARKER}: 'files' must be an object of file name -> size in bytes, got "
                              f"{str(files)[:80]}")
    for name, size in files.items():
        path = model_dir / "params" / name
        if not path.is_file() or path.stat().st_size != size:
            found = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
            raise CheckpointError(f"{path} was saved with {size} bytes and is {found}: the converted directory "
                                  f"is damaged; convert the model again")


def restore(model_dir: str | os.PathLike, dtype: str | None = None, *, mesh: Mesh | None = None):
    """A converted directory -> (Qwen3_5Model, Qwen3_5Config), restored in the dtype it was saved
    in and cast if another is asked for. With a tensor-parallel mesh each device restores only its
    slice of each parameter (split as `models.tensor_parallel.param_spec` says; the checkpoint's
    channel layout, which `shard_model` then regroups)."""
    model_dir = Path(model_dir)
    marker = read_json(model_dir / MARKER)
    if marker.get("format") != "orbax":
        raise CheckpointError(f"{model_dir / MARKER} names format {marker.get('format')!r}; expected 'orbax'")
    cfg = load_config(model_dir)
    if not marker.get("mtp", True):
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    formats = quantized_formats(marker, model_dir / MARKER)

    def abstract(dtype):
        return nnx.split(nnx.eval_shape(lambda: quantize_linears(Qwen3_5Model(cfg, dtype=dtype), formats)))

    try:
        saved = resolve_dtype(marker.get("dtype", "float32"))
        graphdef, state = abstract(saved)
    except ValueError as e:  # a dtype or a module path this model does not have
        raise CheckpointError(f"{model_dir / MARKER}: {e}") from None
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(state))
    if mesh is not None:
        shapes = restore_targets(shapes, formats, cfg, mesh)
    check_file_sizes(model_dir, marker)
    try:
        params = ocp.StandardCheckpointer().restore((model_dir / "params").absolute(), shapes)
    except Exception as e:  # Orbax and TensorStore raise their own types; none should escape raw
        raise CheckpointError(f"cannot restore {model_dir / 'params'}: {type(e).__name__}: {e}") from None
    wanted = resolve_dtype(dtype) if dtype else saved
    if wanted != saved:  # cast to the leaves' dtypes in the wanted model (norms, codes and scales keep theirs)
        graphdef, state = abstract(wanted)
        params = jax.tree.map(lambda x, a: x.astype(a.dtype), params, nnx.to_pure_dict(state))
    nvfp4_bytes_as_saved(params, formats, marker, model_dir)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state), cfg


def quantized_formats(marker: dict, where: Path) -> dict[tuple, str]:
    """The marker's `quantized` ({module path: format}) keyed by path tuples, as `quantize_linears`
    takes it; CheckpointError naming the file and key unless it is an object of known formats."""
    quantized = marker.get("quantized", {})
    if not isinstance(quantized, dict):
        raise CheckpointError(f"{where}: 'quantized' must be an object of module path -> format, got a "
                              f"{type(quantized).__name__}")
    for path, fmt in quantized.items():
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise CheckpointError(f"{where}: 'quantized' maps {path!r} to {fmt!r}; a format is one of "
                                  f"{', '.join(FORMATS)}")
    return {tuple(int(k) if k.isascii() and k.isdigit() else k for k in path.split(".")): fmt
            for path, fmt in quantized.items()}


def restore_targets(shapes: dict, formats: dict[tuple, str], cfg, mesh: Mesh) -> dict:
    """The restore targets `shapes` (pure dict of ShapeDtypeStructs) with each parameter's
    tensor-parallel sharding, so Orbax reads every device's slice straight onto it."""
    check_divisible(cfg, mesh.shape[TP])
    flat = jax.tree_util.tree_flatten_with_path(shapes)
    leaves = []
    for keypath, x in flat[0]:
        path = tuple(k.key for k in keypath)
        spec = param_spec(path, len(x.shape), formats.get(path[:-1]), cfg, mesh.shape[TP])
        leaves.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)))
    return jax.tree.unflatten(flat[1], leaves)


def nvfp4_bytes_as_saved(params: dict, formats: dict[tuple, str], marker: dict, model_dir: Path) -> None:
    """Bring restored NVFP4 codes into today's byte layout (quant_formats.E2M1_BITS), in place.
    Directories converted before the marker named it hold ModelOpt's nibbles (the even column low)."""
    saved = marker.get("nvfp4_bits")
    if saved == NVFP4_BITS or "nvfp4" not in formats.values():
        return
    if saved is not None:
        raise CheckpointError(f"{model_dir / MARKER} names NVFP4 bit positions {saved}; this version reads "
                              f"{NVFP4_BITS} or ModelOpt's nibbles: convert the model again")
    for path, fmt in formats.items():
        if fmt == "nvfp4":
            leaf = functools.reduce(lambda d, k: d[k], path, params)
            leaf["weight"] = nvfp4_from_modelopt(leaf["weight"])
