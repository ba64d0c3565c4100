"""Export trained weights in the released layouts, each loadable by the repo's loaders unchanged:

* the target: HF Qwen3.5 safetensors with VL-wrapped names (`model.language_model.*`) and the
  `mtp.*` head, config.json, generation_config.json, tokenizer.json, tokenizer_config.json;
* `dflash/`: z-lab's DFlash layout (`fc`, `hidden_norm`, `layers.{i}.self_attn.*`, `norm`);
* `eagle3/`: the Speculators EAGLE-3 layout (`fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`) that
  vLLM's `Eagle3LlamaForCausalLM` reads;
* `draft/`: a plain Qwen3 (`Qwen3ForCausalLM`) for `draft_model`.

Weights are written in bfloat16, in shards of at most `MAX_SHARD_BYTES` (files come back from
the GPU machine at most 16 MB each) with a `model.safetensors.index.json` when there are several.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from models.dflash import DFlashConfig
from models.eagle3 import Eagle3Config
from models.qwen3 import Qwen3Config
from models.qwen3_5 import Qwen3_5Config
from spec_jax.loading.drafters import dflash_sources, drafter_sources
from spec_jax.loading.qwen3 import qwen3_sources
from spec_jax.loading.source import is_stacked, param_sources
from spec_jax.training.corpus import tokenizer_config
from spec_jax.writing.random_checkpoint import drafter_config_json, hf_config, named_leaves

MAX_SHARD_BYTES = 15 * 10**6


def named_tensors(params: nnx.State, sources) -> dict[str, np.ndarray]:
    """Our parameters -> {checkpoint name: bfloat16 array}. sources(path) -> (names, stacked) as
    the model's loader maps it; a stacked parameter is split along its leading axis."""
    out = {}
    for names, stacked, leaf in named_leaves(params, sources):
        value = np.asarray(jax.device_get(leaf), np.float32).astype(ml_dtypes.bfloat16)
        out.update(zip(names, value if stacked else [value]))
    return out


def save_sharded(tensors: dict[str, np.ndarray], out_dir: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """model.safetensors, or model-0000i-of-0000n.safetensors shards of at most max_bytes each plus
    model.safetensors.index.json. Returns the files written."""
    shards, size = [[]], 0
    for name, value in tensors.items():
        if value.nbytes > max_bytes:
            raise ValueError(f"tensor {name!r} has {value.nbytes} bytes, more than one shard's {max_bytes}")
        if shards[-1] and size + value.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += value.nbytes
    out_dir.mkdir(parents=True, exist_ok=True)
    if len(shards) == 1:
        files = {"model.safetensors": shards[0]}
    else:
        files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": s for i, s in enumerate(shards)}
        index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
                 "weight_map": {n: f for f, names in files.items() for n in names}}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for fname, names in files.items():
        save_file({n: tensors[n] for n in names}, str(out_dir / fname), metadata={"format": "pt"})
    return [out_dir / f for f in files]


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def export_target(out_dir: str | Path, cfg: Qwen3_5Config, params: nnx.State, tokenizer_json: str) -> Path:
    """The target (with its MTP head) in the released VL-wrapped layout, with its tokenizer."""
    out_dir = Path(out_dir)
    tensors = named_tensors(params, lambda path: (param_sources(path, cfg), is_stacked(path)))
    tensors = {("model.language_model." + n[len("model."):]) if n.startswith("model.") else n: v
               for n, v in tensors.items()}
    save_sharded(tensors, out_dir)
    write_json(out_dir / "config.json", hf_config(cfg, vl_wrapped=True))
    write_json(out_dir / "generation_config.json", {"eos_token_id": list(cfg.eos_token_id), "do_sample": False})
    (out_dir / "tokenizer.json").write_text(tokenizer_json)
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(cfg.max_position_embeddings))
    return out_dir


def export_dflash(out_dir: str | Path, cfg: DFlashConfig, params: nnx.State) -> Path:
    """The DFlash drafter in z-lab's layout (it reads the target's embedding and lm_head)."""
    out_dir = Path(out_dir)
    save_sharded(named_tensors(params, lambda path: dflash_sources(path, cfg)), out_dir)
    write_json(out_dir / "config.json", drafter_config_json(cfg, "dflash"))
    return out_dir


def eagle3_config_json(cfg: Eagle3Config) -> dict:
    """config.json of a Speculators EAGLE-3 head: the midlayer's geometry under
    `transformer_layer_config`, the taps as aux ids (the hidden state entering layer id, so our
    layer index + 1)."""
    layer = {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_hidden_layers": 1, "num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
             "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
             "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
            "norm_before_residual": cfg.norm_before_residual, "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "..",
                                                "architectures": ["Qwen3_5ForConditionalGeneration"]}}}


def export_eagle3(out_dir: str | Path, cfg: Eagle3Config, params: nnx.State, d2t: np.ndarray) -> Path:
    """The EAGLE-3 head in the Speculators layout (it reads the target's embedding); `d2t` [Vd]
    int64 offsets: draft id d stands for target id d + d2t[d]."""
    out_dir = Path(out_dir)
    tensors = named_tensors(params, drafter_sources)
    tensors["d2t"] = np.asarray(d2t, np.int64)
    save_sharded(tensors, out_dir)
    write_json(out_dir / "config.json", eagle3_config_json(cfg))
    return out_dir


def qwen3_config_json(cfg: Qwen3Config) -> dict:
    """config.json of a `Qwen3ForCausalLM` of this geometry."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "eos_token_id": list(cfg.eos_token_id), "torch_dtype": "bfloat16"}


def export_draft(out_dir: str | Path, cfg: Qwen3Config, params: nnx.State) -> Path:
    """The draft model as a plain Qwen3 checkpoint (the target's vocabulary; no tokenizer copy)."""
    out_dir = Path(out_dir)
    save_sharded(named_tensors(params, lambda path: qwen3_sources(path, cfg)), out_dir)
    write_json(out_dir / "config.json", qwen3_config_json(cfg))
    return out_dir
