"""Loading HF safetensors checkpoints of plain Qwen3 (`Qwen3ForCausalLM`) into `models.qwen3`.

The Qwen3.5 loader's pieces are reused (`TensorSource` for single files, shards and the `model.*` /
`lm_head.weight` names; `hf_name` for our-path -> HF-name; its errors), only the model and config
differ. Tensors are read one parameter at a time, cast, stacked over the layers and put on the
device.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from models.qwen3 import Qwen3Config, Qwen3Model
from spec_jax.checkpoint import (
    PROGRESS_BAR_BYTES,
    CheckpointError,
    TensorSource,
    hf_name,
    read_json,
    resolve_dtype,
    set_path,
)


def load_qwen3_config(model_dir: str | os.PathLike) -> Qwen3Config:
    """Read `config.json` (and `generation_config.json`'s EOS ids, if present).

    Raises CheckpointError for a missing directory or file, or a malformed key; ValueError (from
    `Qwen3Config.from_hf`) for an unsupported model_type, rope_type or layer kind.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} does not exist")
    try:
        cfg = Qwen3Config.from_hf(read_json(model_dir / "config.json"))
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{model_dir / 'config.json'} is missing or has a malformed key: {e}") from None
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = read_json(gen_path).get("eos_token_id")
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        cfg = Qwen3Config(**{**cfg.__dict__, "eos_token_id": tuple(dict.fromkeys([*cfg.eos_token_id, *extra]))})
    return cfg


def qwen3_sources(path: tuple, cfg: Qwen3Config) -> list[str]:
    """HF names that make up one parameter of ours, in stacking order.

    ('layers', 0, 'self_attn', 'q_proj', 'weight') -> 'model.layers.{i}.self_attn.q_proj.weight'
    for i = 0..N-1; ('lm_head', 'weight') -> ['lm_head.weight']; ('norm', 'weight') ->
    ['model.norm.weight'].
    """
    if path[0] == "layers":
        return [hf_name(path, i) for i in range(cfg.num_hidden_layers)]
    return [hf_name(path, None)]


def load_qwen3_params(model_dir: str | os.PathLike, cfg: Qwen3Config, dtype, *,
                      progress: bool | None = None) -> Qwen3Model:
    """Load a checkpoint's tensors into a `Qwen3Model`.

    dtype: compute dtype of the weights (norm weights stay float32). progress: show a progress bar
    (default: when the checkpoint exceeds 256 MiB). Raises CheckpointError naming the first
    missing tensor or wrong shape. Tensors the model does not use are ignored.
    """
    src = TensorSource(model_dir)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3Model(cfg, dtype=dtype)))
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    total = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for _, x in leaves)
    show = progress if progress is not None else total > PROGRESS_BAR_BYTES
    loaded = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=not show) as bar:
        for keypath, want in leaves:
            path = tuple(k.key for k in keypath)
            stacked = path[0] == "layers"  # every layer parameter carries the leading layer axis
            expected = tuple(want.shape[1:] if stacked else want.shape)
            parts = []
            for name in qwen3_sources(path, cfg):
                arr = src.get(name)  # raises "checkpoint is missing tensor '<name>'"
                if tuple(arr.shape) != expected:
                    raise CheckpointError(
                        f"tensor {name!r} has shape {tuple(arr.shape)}, expected {expected} from config.json"
                    )
                parts.append(np.asarray(arr).astype(want.dtype))
            value = np.stack(parts) if stacked else parts[0]
            set_path(loaded, path, jax.device_put(value))
            bar.update(value.nbytes)
    nnx.replace_by_pure_dict(state, loaded)
    return nnx.merge(graphdef, state)


def load_qwen3(model_dir: str | os.PathLike, dtype="float32", *,
               progress: bool | None = None) -> tuple[Qwen3Model, Qwen3Config]:
    """Config + weights of a Qwen3 checkpoint: returns (Qwen3Model, Qwen3Config).

    dtype: 'float32' | 'bfloat16' (or the jnp dtype). Raises CheckpointError naming a missing
    tensor, wrong shape or unreadable file; ValueError for an unsupported config.
    """
    cfg = load_qwen3_config(model_dir)
    return load_qwen3_params(model_dir, cfg, resolve_dtype(dtype), progress=progress), cfg
