"""Loading HF safetensors checkpoints of plain Qwen3 (`Qwen3ForCausalLM`) into `models.qwen3`.

The Qwen3.5 loader's pieces are reused (`TensorSource` for single files, shards and the `model.*` /
`lm_head.weight` names; `hf_name` for our-path -> HF-name; its errors), only the model and config
differ. Tensors are read one parameter at a time, cast, stacked over the layers and put on the
device.
"""

from __future__ import annotations

import os

from models.qwen3 import Qwen3Config, Qwen3Model
from spec_jax.loading.source import TensorSource, fill_params, hf_name, read_config, resolve_dtype


def load_qwen3_config(model_dir: str | os.PathLike) -> Qwen3Config:
    """Read a Qwen3 `config.json` (and `generation_config.json`'s EOS ids, if present)."""
    return read_config(model_dir, Qwen3Config.from_hf)


def qwen3_sources(path: tuple, cfg: Qwen3Config) -> tuple[list[str], bool]:
    """HF names that make up one parameter of ours, in stacking order, and whether they stack.

    ('layers', 0, 'self_attn', 'q_proj', 'weight') -> 'model.layers.{i}.self_attn.q_proj.weight'
    for i = 0..N-1; ('lm_head', 'weight') -> ['lm_head.weight']; ('norm', 'weight') ->
    ['model.norm.weight'].
    """
    if path[0] == "layers":
        return [hf_name(path, i) for i in range(cfg.num_hidden_layers)], True
    return [hf_name(path, None)], False


def load_qwen3(model_dir: str | os.PathLike, dtype="float32", *,
               progress: bool | None = None) -> tuple[Qwen3Model, Qwen3Config]:
    """Config + weights of a Qwen3 checkpoint: returns (Qwen3Model, Qwen3Config).

    dtype: 'float32' | 'bfloat16' (or the jnp dtype). Raises CheckpointError naming a missing
    tensor, wrong shape or unreadable file; ValueError for an unsupported config.
    """
    cfg = load_qwen3_config(model_dir)
    dtype = resolve_dtype(dtype)
    model = fill_params(lambda: Qwen3Model(cfg, dtype=dtype), TensorSource(model_dir),
                        lambda path: qwen3_sources(path, cfg), progress=progress)
    return model, cfg
