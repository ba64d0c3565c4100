"""The bottom of loading: configs, checkpoint errors, `TensorSource` (HF safetensors, read by
name) and `fill_params`, which every format's loader uses to build a model one parameter at a time.

The safetensors name mapping handles every released layout: one file or shards with `model.safetensors.index.json`;
VL-wrapped (`model.language_model.*`, vision tensors ignored), text-only (`model.*`) and MLX
(`language_model.model.*`) prefixes; Qwen3-Next's fused, key-head-grouped `in_proj_qkvz` /
`in_proj_ba`; routed experts fused (`experts.gate_up_proj`) or one tensor per expert; `mtp.*`
kept. All name mapping lives here, so the model's math never sees a checkpoint quirk.

Files are opened memory-mapped; tensors are read one parameter at a time, cast, stacked over
the layer pattern's repeats and put on the device.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from models.qwen3_5 import Qwen3_5Config, Qwen3_5Model

PROGRESS_BAR_BYTES = 256 << 20  # show a progress bar for checkpoints larger than this
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
IGNORED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file, tensor or key."""


def resolve_dtype(dtype: str | Any) -> Any:
    """'float32' | 'bfloat16' (or the jnp dtype itself) -> jnp dtype; anything else is refused."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if dtype in DTYPES.values():
        return dtype
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")


def read_json(path: Path) -> dict:
    """A JSON file that must hold an object; CheckpointError naming the file otherwise."""
    try:
        with open(path) as f:
            value = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except NotADirectoryError:
        raise CheckpointError(f"{path.parent} is a file; a model is a directory (or a .gguf file)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, where an object ({{...}}) belongs")
    return value


def read_config(model_dir: str | os.PathLike, parse):
    """`parse(config.json dict)` -> a config dataclass with `eos_token_id`, merged with
    `generation_config.json`'s EOS ids when present. Errors name the directory or file."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} " + (
            "is a file: pass the folder holding config.json and the *.safetensors" if model_dir.exists() else
            "does not exist"))
    cfg = parse_config(read_json(model_dir / "config.json"), model_dir / "config.json", parse)
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists() and hasattr(cfg, "eos_token_id"):
        eos = read_json(gen_path).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        try:
            cfg = dataclasses.replace(cfg, eos_token_id=tuple(dict.fromkeys([*cfg.eos_token_id, *extra])))
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{gen_path}: {e}") from None
    return cfg


def parse_config(config: dict, path: Path, parse):
    """parse(config) with any refusal as a CheckpointError naming the file `path` and the key."""
    try:
        return parse(config)
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{path} is missing the key {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_config(model_dir: str | os.PathLike) -> Qwen3_5Config:
    """Read a Qwen3.5/3.6/Next `config.json` (and `generation_config.json`'s EOS ids)."""
    return read_config(model_dir, Qwen3_5Config.from_hf)


# ----------------------------------------------------------------------------- tensor source


def canonical_name(name: str) -> str | None:
    """Checkpoint tensor name -> text-only HF name (`model.*`, `lm_head.*`, `mtp.*`), or None
    for tensors the text model does not use (the vision tower)."""
    if name.startswith(IGNORED_PREFIXES):
        return None
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return name


class TensorSource:
    """Every tensor of a safetensors checkpoint, by canonical name, read lazily (memory-mapped)."""

    def __init__(self, model_dir: str | os.PathLike):
        model_dir = Path(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map'")
            for name, shard in weight_map.items():
                # by name, not by resolving: a hub snapshot's shards are symlinks into its blobs folder
                inside = isinstance(shard, str) and not Path(shard).is_absolute() and ".." not in Path(shard).parts
                if not inside:
                    raise CheckpointError(f"{index} maps {name!r} to {shard!r}; a shard is a file name inside "
                                          f"{model_dir}")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {model_dir}")
        self.files = {}
        self.location: dict[str, tuple[str, str]] = {}  # canonical -> (file, stored name)
        self.read: set[str] = set()  # canonical names handed out, for `unread`
        for fname in files:
            path = model_dir / fname
            if not path.exists():
                raise CheckpointError(f"shard {fname} listed in {index.name} is missing from {model_dir}")
            try:
                handle = safe_open(str(path), framework="numpy")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"cannot read {path}: {e} (truncated or not a safetensors file?)") from None
            self.files[fname] = handle
            for stored in handle.keys():
                canon = canonical_name(stored)
                if canon is not None:
                    self.location[canon] = (fname, stored)

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def shape(self, name: str) -> tuple[int, ...]:
        fname, stored = self.location[name]
        return tuple(self.files[fname].get_slice(stored).get_shape())

    def get(self, name: str) -> np.ndarray:
        if name not in self.location:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        fname, stored = self.location[name]
        self.read.add(name)
        try:
            return self.files[fname].get_tensor(stored)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read tensor {stored!r} from {fname}: {e}") from None

    def names(self) -> list[str]:
        return list(self.location)

    def unread(self) -> list[str]:
        """Tensors not read so far that a model would use: after loading, a sign that config.json
        describes less than the checkpoint holds (fewer layers, a misspelt name). Activation and
        KV-cache scales of quantized exports and stored rotary tables are not weights and not listed."""
        return sorted(n for n in self.location if n not in self.read and not n.endswith(NOT_WEIGHTS))


# Tensor names exports carry besides weights: activation / KV-cache scales, rotary tables.
NOT_WEIGHTS = ("input_scale", "k_scale", "v_scale", "rotary_emb.inv_freq")


# ----------------------------------------------------------------------------- name mapping

# Module attributes that are bare parameters in the NNX model but `<name>.weight` in HF.
WEIGHT_SUFFIXED = {"embed_tokens", "conv1d"}


def hf_name(path: tuple, layer: int | None) -> str:
    """Our parameter path (pure-dict keys) -> the HF text-only tensor name.

    ('layers', p, 'linear_attn', 'A_log') with layer i -> 'model.layers.{i}.linear_attn.A_log';
    ('mtp', 'layers', 0, 'mlp', 'gate_proj', 'weight') -> 'mtp.layers.0.mlp.gate_proj.weight'.
    """
    parts = [str(p) for p in path]
    if parts[-1] in WEIGHT_SUFFIXED:
        parts.append("weight")
    if parts[0] == "mtp":
        return ".".join(parts)
    if parts[0] == "layers":
        parts[1] = str(layer)
    if parts[0] == "lm_head":
        return ".".join(parts)
    return "model." + ".".join(parts)


def experts_from_per_expert(src: TensorSource, name: str, num_experts: int) -> np.ndarray:
    """Rebuild a fused expert tensor from one-tensor-per-expert names.

    `...experts.gate_up_proj` -> [E, 2I, H] from `experts.{e}.gate_proj/up_proj.weight`;
    `...experts.down_proj` -> [E, H, I] from `experts.{e}.down_proj.weight`.
    """
    base, kind = name.rsplit(".", 1)
    if kind == "gate_up_proj":
        parts = [np.concatenate([src.get(f"{base}.{e}.gate_proj.weight"), src.get(f"{base}.{e}.up_proj.weight")])
                 for e in range(num_experts)]
    else:
        parts = [src.get(f"{base}.{e}.down_proj.weight") for e in range(num_experts)]
    return np.stack(parts)


def unfuse_qwen3_next(src: TensorSource, name: str, cfg: Qwen3_5Config) -> np.ndarray:
    """Qwen3-Next's key-head-grouped `in_proj_qkvz` / `in_proj_ba` -> Qwen3.5's split tensors.

    Per key head g, qkvz rows are [q_g | k_g | v_g (r heads) | z_g (r heads)] and ba rows are
    [b_g (r) | a_g (r)]; value head g*r + j belongs to key head g.
    """
    nk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // nk
    base, proj, _ = name.rsplit(".", 2)
    if proj in ("in_proj_qkv", "in_proj_z"):
        w = src.get(f"{base}.in_proj_qkvz.weight")
        w = w.reshape(nk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = np.split(w, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        if proj == "in_proj_z":
            return z.reshape(nk * r * dv, -1)
        return np.concatenate([q.reshape(nk * dk, -1), k.reshape(nk * dk, -1), v.reshape(nk * r * dv, -1)])
    w = src.get(f"{base}.in_proj_ba.weight").reshape(nk, 2 * r, -1)
    b, a = w[:, :r], w[:, r:]
    return (b if proj == "in_proj_b" else a).reshape(nk * r, -1)


def read_tensor(src: TensorSource, name: str, cfg: Qwen3_5Config) -> np.ndarray:
    """One HF tensor by text-only name, rebuilt from the alternative layouts when needed."""
    if name in src:
        return src.get(name)
    per_expert = f"{name.rsplit('.', 1)[0]}.0.down_proj.weight"
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and per_expert in src:
        return experts_from_per_expert(src, name, cfg.num_experts)
    proj = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    if proj in ("in_proj_qkv", "in_proj_z") and name.replace(proj, "in_proj_qkvz") in src:
        return unfuse_qwen3_next(src, name, cfg)
    if proj in ("in_proj_b", "in_proj_a") and name.replace(proj, "in_proj_ba") in src:
        return unfuse_qwen3_next(src, name, cfg)
    raise CheckpointError(f"checkpoint is missing tensor {name!r}")


# ----------------------------------------------------------------------------- loading


def abstract_model(cfg: Qwen3_5Config, dtype) -> Qwen3_5Model:
    return nnx.eval_shape(lambda: Qwen3_5Model(cfg, dtype=dtype))


def is_stacked(path: tuple) -> bool:
    """Stacked parameters carry a leading repeat axis: the decoder pattern's and the MTP layer's."""
    return path[0] == "layers" or path[:2] == ("mtp", "layers")


def param_sources(path: tuple, cfg: Qwen3_5Config) -> list[str]:
    """HF names that make up one parameter of ours, in stacking order."""
    if path[0] == "layers":
        P = len(cfg.pattern)
        return [hf_name(path, g * P + path[1]) for g in range(cfg.num_groups)]
    return [hf_name(path, None)]


def fill_params(make_model, src: TensorSource, sources, read=None, *, progress: bool | None = None, placement=None):
    """Build `make_model()` abstractly and fill every parameter from `src`.

    sources(path) -> (HF names, stacked): the tensors making up the parameter at `path` (pure-dict
    keys) and whether they stack along a new leading axis. read(name) reads one tensor (default
    `src.get`). placement(abstract model) -> place(path, host array) puts each parameter on the
    devices (default: the default device; `models.tensor_parallel.placement` splits it over a
    mesh). Shows a progress bar past 256 MiB unless `progress` says otherwise. Raises
    CheckpointError naming the first missing tensor or wrong shape.
    """
    read = read or src.get
    abstract = nnx.eval_shape(make_model)
    place = placement(abstract) if placement is not None else lambda path, value: jax.device_put(value)
    graphdef, state = nnx.split(abstract)
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    total = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for _, x in leaves)
    show = progress if progress is not None else total > PROGRESS_BAR_BYTES
    loaded = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not show) as bar:
        for keypath, want in leaves:
            path = tuple(k.key for k in keypath)
            names, stacked = sources(path)
            expected = tuple(want.shape[1:] if stacked else want.shape)
            parts = []
            for name in names:
                arr = read(name)
                if tuple(arr.shape) != expected:
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(arr.shape)}, expected {expected} from config.json"
                    )
                parts.append(checked_values(name, np.asarray(arr), want.dtype).astype(want.dtype))
            value = np.stack(parts) if stacked else parts[0]
            set_path(loaded, path, place(path, value))
            bar.update(value.nbytes)
    nnx.replace_by_pure_dict(state, loaded)
    return nnx.merge(graphdef, state)


def checked_values(name: str, arr: np.ndarray, want) -> np.ndarray:
    """arr, refused (CheckpointError naming the tensor) if a float parameter comes as integers,
    booleans or float64 (a mislabelled or foreign tensor, not a weight), or holds NaN or inf
    (a model that would emit token 0 forever)."""
    if not jnp.issubdtype(want, jnp.floating):
        return arr
    if arr.dtype.kind in "biu" or arr.dtype == np.float64:
        raise CheckpointError(f"tensor {name!r} is {arr.dtype}; a weight is stored as a float of 32 bits or fewer")
    if not np.isfinite(arr.astype(np.float32) if arr.dtype.itemsize == 1 else arr).all():
        raise CheckpointError(f"tensor {name!r} holds NaN or inf values")
    return arr


def set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value
