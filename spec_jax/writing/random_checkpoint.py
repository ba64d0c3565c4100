"""Write a random-weight checkpoint in the released HF layout, for any `Qwen3_5Config`.

Tensor names come from the loader's own mapping (`checkpoint.param_sources`), so what this
writes is exactly what the loader reads. Every parameter is random — norm weights too, so a
missing `1 + w` cannot hide — at scales that keep activations O(1).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from models.dflash import DFlashConfig, DFlashDraft
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.qwen3_5 import Qwen3_5Config
from spec_jax.loading.drafters import dflash_sources, drafter_sources
from spec_jax.loading.source import abstract_model, is_stacked, load_config, param_sources

NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def init_rule(name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """How to draw the parameter `name`: ("normal", mean, std) or ("uniform", low, high), at
    scales that keep activations O(1)."""
    if name.endswith("linear_attn.norm.weight"):
        return "uniform", 0.5, 1.5  # plain-weight gated norm, centred on 1
    if name.endswith("norm.weight") or "norm_" in name:
        return "normal", 0.0, 0.3  # zero-centred norms: the model multiplies by 1 + w
    if name.endswith("A_log"):
        return "uniform", -1.0, 1.0
    if name.endswith("dt_bias"):
        return "normal", 0.0, 0.5
    if name.endswith("conv1d.weight"):
        return "normal", 0.0, 0.5
    if name.endswith("embed_tokens.weight"):
        return "normal", 0.0, 1.0
    if name.endswith("base_kernel"):  # DFlash2's convolution: O(1) taps
        return "normal", 0.0, 0.5
    return "normal", 0.0, shape[-1] ** -0.5  # [.., out, in]: std 1/sqrt(fan_in)


def random_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random tensor whose distribution suits the parameter `name` (`init_rule`)."""
    kind, a, b = init_rule(name, shape)
    return rng.uniform(a, b, shape) if kind == "uniform" else rng.normal(a, b, shape)


def hf_config(cfg: Qwen3_5Config, *, vl_wrapped: bool) -> dict:
    """The `config.json` a released checkpoint of this geometry carries."""
    text = {
        "model_type": "qwen3_5_moe_text" if cfg.is_moe else "qwen3_5_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "layer_types": list(cfg.layer_types),
        "full_attention_interval": cfg.full_attention_interval,
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim, "hidden_act": "silu", "attn_output_gate": True,
        "mtp_num_hidden_layers": cfg.mtp_num_hidden_layers, "mamba_ssm_dtype": cfg.mamba_ssm_dtype,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "eos_token_id": list(cfg.eos_token_id) if len(cfg.eos_token_id) != 1 else cfg.eos_token_id[0],
    }
    if cfg.is_moe:
        text.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                    moe_intermediate_size=cfg.moe_intermediate_size,
                    shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    if not vl_wrapped:
        arch = "Qwen3_5MoeForCausalLM" if cfg.is_moe else "Qwen3_5ForCausalLM"
        return {"architectures": [arch], **text}
    arch = "Qwen3_5MoeForConditionalGeneration" if cfg.is_moe else "Qwen3_5ForConditionalGeneration"
    return {"architectures": [arch], "model_type": "qwen3_5_moe" if cfg.is_moe else "qwen3_5",
            "text_config": text, "tie_word_embeddings": cfg.tie_word_embeddings,
            "vision_config": {"model_type": "qwen3_5_moe_vision" if cfg.is_moe else "qwen3_5_vision"}}


def named_leaves(state: nnx.State, sources):
    """(checkpoint names, stacked, leaf) for every parameter of `state`, in parameter order.
    sources(path) -> (names, stacked), as the model's loader maps it; a stacked leaf holds one
    named tensor per entry of its leading axis."""
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        names, stacked = sources(tuple(k.key for k in keypath))
        yield names, stacked, leaf


def tensor_slots(make_model, sources):
    """(checkpoint name, shape) of every tensor a model reads, in parameter order."""
    _, state = nnx.split(nnx.eval_shape(make_model))
    for names, stacked, leaf in named_leaves(state, sources):
        shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
        for name in names:
            yield name, shape


def random_tensors(cfg: Qwen3_5Config, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the text model and its MTP head, by text-only HF name, float32."""
    rng = np.random.default_rng(seed)
    slots = tensor_slots(lambda: abstract_model(cfg, np.float32), lambda p: (param_sources(p, cfg), is_stacked(p)))
    return {name: random_value(name, shape, rng).astype(np.float32) for name, shape in slots}


def write_checkpoint(out_dir: str | Path, cfg: Qwen3_5Config, *, seed: int = 0, dtype: str = "float32",
                     vl_wrapped: bool = True) -> Path:
    """Write config.json and model.safetensors for a random model of geometry `cfg`.

    vl_wrapped: name the language model `model.language_model.*` as released Qwen3.5/3.6 do
    (else text-only `model.*`). `mtp.*` is written when cfg.mtp_num_hidden_layers > 0.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = random_tensors(cfg, seed)
    if vl_wrapped:
        tensors = {("model.language_model." + n[len("model."):]) if n.startswith("model.") else n: v
                   for n, v in tensors.items()}
    np_dtype = NUMPY_DTYPES[dtype]
    save_file({n: v.astype(np_dtype) for n, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, vl_wrapped=vl_wrapped), indent=2))
    return out_dir



def random_d2t(vocab: int, draft_vocab: int, rng: np.random.Generator) -> np.ndarray:
    """A `d2t` table for a draft vocabulary of `draft_vocab` ids: a random sorted subset of the
    target's `vocab` ids, stored as offsets (target id = d + d2t[d]) in int64 as Speculators save it."""
    ids = np.sort(rng.choice(vocab, draft_vocab, replace=False))
    return (ids - np.arange(draft_vocab)).astype(np.int64)


def t2d_from_d2t(vocab: int, d2t: np.ndarray) -> np.ndarray:
    """Speculators' `t2d` [V] bool: which target ids the draft vocabulary holds (training-only;
    inference reads d2t)."""
    t2d = np.zeros((vocab,), bool)
    t2d[np.arange(d2t.shape[0]) + d2t] = True
    return t2d


def layer_mask_keys(cfg) -> tuple[dict, dict]:
    """The sliding-window keys of a block drafter's layers (what transformers' Qwen3Config reads)
    and its dflash_config keys, from a DFlashConfig's `layer_types`, `use_swa` and window."""
    if cfg.use_swa:
        return ({"layer_types": list(cfg.layer_types)} if cfg.layer_types else {},
                {"use_swa": True, "swa_window_size": cfg.sliding_window})
    if not cfg.layer_types:
        return {}, {}
    window = {"sliding_window": cfg.sliding_window, "use_sliding_window": True} if cfg.sliding_window else {}
    return {"layer_types": list(cfg.layer_types), **window}, {}


def drafter_config_json(cfg, layout: str) -> dict:
    """The config.json of a block drafter in a published layout: "dflash" (z-lab), "dspark"
    (native DeepSeek `Qwen3DSparkModel`) or "speculators" (vLLM Speculators' DSpark). Causality
    (cfg.causal, None: by layer kind) is `is_causal` in the first two; Speculators' one flag,
    `sliding_window_non_causal`, is true when cfg.causal is false (its full layers are never causal)."""
    masks, swa = layer_mask_keys(cfg)
    layers = {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        **masks,
    }
    causal = {} if cfg.causal is None else {"is_causal": cfg.causal}
    markov = {"markov_rank": cfg.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": True,
              "confidence_head_with_markov": True}
    if layout == "dflash":
        dflash2 = {"conv_kernel_size": cfg.conv_kernel_size, "conv_group_size": cfg.conv_group_size,
                   "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k}
        scales = {k: getattr(cfg, k) for k in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
                  if getattr(cfg, k) not in (None, 1.0)}
        return {"architectures": ["DFlash2DraftModel" if cfg.selector_rank else "DFlashDraftModel"], **layers,
                **causal, "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                                            "target_layer_ids": list(cfg.target_layer_ids), **swa, **scales,
                                            **(dflash2 if cfg.selector_rank else {})}}
    if layout == "dspark":
        draft_vocab = {"draft_vocab_size": cfg.draft_vocab_size} if cfg.reduced_vocab else {}
        return {"architectures": ["Qwen3DSparkModel"], **layers, **markov, **draft_vocab, **causal, **swa,
                "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                "target_layer_ids": list(cfg.target_layer_ids)}
    if swa:
        raise ValueError("the Speculators layout has no use_swa; give the layers' kinds (layer_types)")
    return {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
            "transformer_layer_config": layers, **markov, "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id, "draft_vocab_size": cfg.output_vocab_size,
            "sliding_window_non_causal": cfg.causal is False,
            "aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids],  # the hidden entering layer i + 1
            "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": cfg.block_size}],
                                   "verifier": {"name_or_path": "random-target", "architectures": []}}}


def write_dflash_checkpoint(out_dir: str | Path, cfg, *, seed: int = 0, layout: str = "dflash") -> Path:
    """A random block drafter: DFlash in z-lab's layout, or DSpark (cfg.markov_rank > 0) in the
    native or Speculators layout. Tensors: `fc.weight`, `hidden_norm.weight`, `norm.weight`,
    `layers.{i}.self_attn.*`, ..., and for DSpark `markov_head.markov_w{1,2}.weight` and
    `confidence_head.proj.*` (which inference does not use). With cfg.draft_vocab_size <
    vocab_size the vocabulary is reduced, as Speculators write it: `lm_head.weight` [Vd, H], `d2t`
    (a random sorted subset of target ids, `random_d2t`) and the training-only `t2d`."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in tensor_slots(lambda: DFlashDraft(cfg), lambda p: dflash_sources(p, cfg)):
        if name == "d2t":
            tensors[name] = random_d2t(cfg.vocab_size, cfg.draft_vocab_size, rng)
            tensors["t2d"] = t2d_from_d2t(cfg.vocab_size, tensors[name])
            continue
        value = random_value(name, shape, rng)
        tensors[name] = (value + 1.0 if "norm" in name else value).astype(np.float32)  # plain RMSNorm: ~1
    if cfg.markov_rank:
        width = cfg.hidden_size + cfg.markov_rank
        tensors["confidence_head.proj.weight"] = rng.normal(size=(1, width)).astype(np.float32)
        tensors["confidence_head.proj.bias"] = np.zeros((1,), np.float32)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(drafter_config_json(cfg, layout), indent=2))
    return out_dir


def write_eagle3_checkpoint(out_dir: str | Path, cfg, *, seed: int = 0, midlayer_names: bool = False) -> Path:
    """A random EAGLE-3 head in the Speculators layout. With cfg.draft_vocab_size < vocab_size it
    gets a reduced vocabulary: `d2t` maps draft id d to target id d + d2t[d] (a random sorted
    subset). midlayer_names: name the layer `midlayer.*` as the original EAGLE-3 release does."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in tensor_slots(lambda: Eagle3Draft(cfg), drafter_sources):
        if name == "d2t":
            tensors[name] = random_d2t(cfg.vocab_size, cfg.draft_vocab_size, rng)
            continue
        value = random_value(name, shape, rng)
        value = value + 1.0 if "norm" in name else value  # plain RMSNorm: ~1
        if midlayer_names and name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        tensors[name] = value.astype(np.float32)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    layer = {"model_type": "llama", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
             "num_hidden_layers": 1, "num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
             "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta}
    if cfg.sliding_window:  # a Llama layer config keeps its window as given
        layer.update(layer_types=["sliding_attention"], sliding_window=cfg.sliding_window)
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
              "norm_before_residual": cfg.norm_before_residual, "target_hidden_size": cfg.target_hidden_size,
              "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.target_layer_ids] or None,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                     "verifier": {"name_or_path": "random-target", "architectures": []}}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def random_drafter_config(method: str, target: Qwen3_5Config, *, layers: int = 5, block_size: int | None = None,
                          draft_vocab_size: int | None = None):
    """The config of a random drafter of `method` that fits `target`.

    dflash / dspark: a DFlashConfig of `layers` layers of the target's width (z-lab's drafters
    have 5), block_size (default 16 / 7), five taps spread over the target; dspark with a
    draft_vocab_size below the target's vocabulary gets a reduced vocabulary (lm_head and d2t).
    eagle3: an Eagle3Config with one midlayer, three default taps, a draft vocabulary of up to
    32000 tokens. draft_model: a `layers`-layer Qwen3.5 of the target's geometry, no MTP head.
    """

    H, L, V = target.hidden_size, target.num_hidden_layers, target.vocab_size
    heads = dict(num_attention_heads=max(H // 128, 1), num_key_value_heads=max(H // 512, 1), head_dim=min(H, 128))
    if method in ("dflash", "dspark"):
        taps = tuple(sorted({1, L // 4, L // 2, 3 * L // 4, L - 2}))
        return DFlashConfig(hidden_size=H, intermediate_size=3 * H, num_hidden_layers=layers, target_layer_ids=taps,
                            mask_token_id=V - 1, block_size=block_size or (16 if method == "dflash" else 7),
                            vocab_size=V, markov_rank=min(256, H) if method == "dspark" else 0,
                            sample_from_anchor=method == "dspark",
                            draft_vocab_size=draft_vocab_size if method == "dspark" else None, **heads)
    if method == "eagle3":
        return Eagle3Config(hidden_size=H, intermediate_size=3 * H, vocab_size=V, draft_vocab_size=min(32000, V),
                            target_hidden_size=H, **heads).with_target(L, H)
    if method == "draft_model":
        return dataclasses.replace(target, num_hidden_layers=layers, layer_types=(), mtp_num_hidden_layers=0)
    raise ValueError(f"no random drafter for method {method!r}; accepted: dflash, dspark, eagle3, draft_model")


def write_random_drafter(method: str, target: Qwen3_5Config, out_dir: str | Path, *, layers: int = 5,
                         block_size: int | None = None, layout: str | None = None, seed: int = 0,
                         dtype: str = "bfloat16", draft_vocab_size: int | None = None, **fields) -> Path:
    """A random drafter of `method` that fits `target` (`random_drafter_config`), in its published
    layout; dspark's layout is "dspark" (native) or "speculators". fields: drafter config fields
    to set (layer_types, sliding_window, causal; DFlash2's conv_kernel_size, selector_rank)."""
    cfg = random_drafter_config(method, target, layers=layers, block_size=block_size,
                                draft_vocab_size=draft_vocab_size)
    cfg = dataclasses.replace(cfg, **fields)
    if method in ("dflash", "dspark"):
        return write_dflash_checkpoint(out_dir, cfg, seed=seed, layout=layout or method)
    if method == "eagle3":
        return write_eagle3_checkpoint(out_dir, cfg, seed=seed)
    return write_checkpoint(out_dir, cfg, seed=seed, dtype=dtype)


def main(argv: list[str] | None = None) -> None:
    """Write small random checkpoints in the published layouts, for tests and benchmarks:

        python -m spec_jax.writing.random_checkpoint target DIR [--moe] [--text-only] [--seed N]
        python -m spec_jax.writing.random_checkpoint dflash|dspark|eagle3|draft_model DIR --target TARGET_DIR
            [--layers 2] [--block-size N] [--layout dspark|speculators] [--draft-vocab-size N]
            [--layer-types sliding,sliding,full] [--sliding-window W] [--causal true|false] [--dflash2]
    """
    import argparse


    ap = argparse.ArgumentParser(prog="python -m spec_jax.writing.random_checkpoint",
                                 description=main.__doc__.split("\n")[0])
    ap.add_argument("kind", choices=["target", "dflash", "dspark", "eagle3", "draft_model"])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moe", action="store_true", help="target: a sparse-MoE model")
    ap.add_argument("--text-only", action="store_true", help="target: model.* names instead of VL-wrapped")
    ap.add_argument("--target", help="drafters: the target checkpoint the drafter must fit")
    ap.add_argument("--layers", type=int, default=2, help="drafters: decoder layers")
    ap.add_argument("--block-size", type=int, default=None, help="dflash/dspark: the block (default 16 / 7)")
    ap.add_argument("--layout", choices=["dspark", "speculators"], default=None, help="dspark: the published layout")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="dspark: a reduced draft vocabulary of N target ids (an lm_head of its own and d2t)")
    ap.add_argument("--layer-types", type=lambda v: tuple(f"{k}_attention" for k in v.split(",")), default=None,
                    help="dflash/dspark: each layer's kind, e.g. sliding,sliding,sliding,sliding,full")
    ap.add_argument("--sliding-window", type=int, default=None,
                    help="the sliding layers' window (eagle3: makes its midlayer sliding)")
    ap.add_argument("--causal", choices=["true", "false"], default=None,
                    help="dflash/dspark: every layer causal or not (default: the sliding layers are)")
    ap.add_argument("--dflash2", action="store_true", help="dflash: z-lab's DFlash2 (convolutions, a selector)")
    args = ap.parse_args(argv)
    fields = {k: v for k, v in (("layer_types", args.layer_types), ("sliding_window", args.sliding_window),
                                ("causal", None if args.causal is None else args.causal == "true")) if v is not None}
    block_fields = {"layer_types", "sliding_window", "causal"}
    allowed = {"dflash": block_fields, "dspark": block_fields, "eagle3": {"sliding_window"}}.get(args.kind, set())
    if set(fields) - allowed or (args.dflash2 and args.kind != "dflash"):
        ap.error(f"{args.kind} takes none of --layer-types, --sliding-window, --causal, --dflash2 but "
                 f"{', '.join(sorted(allowed)) or 'none'} (--dflash2: dflash only)")
    if args.dflash2:
        fields.update(conv_kernel_size=2, conv_group_size=16, selector_rank=64, selector_top_k=16)
    if args.kind == "target":
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        cfg = Qwen3_5Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                            mtp_num_hidden_layers=1, eos_token_id=(511,), **(moe if args.moe else {}))
        write_checkpoint(args.out, cfg, seed=args.seed, vl_wrapped=not args.text_only)
    else:
        if not args.target:
            ap.error(f"{args.kind} needs --target TARGET_DIR (the drafter's geometry follows the target's)")
        write_random_drafter(args.kind, load_config(args.target), args.out, layers=args.layers,
                             block_size=args.block_size, layout=args.layout,
                             seed=args.seed, dtype="float32", draft_vocab_size=args.draft_vocab_size, **fields)
    print(f"wrote a random {args.kind} checkpoint to {args.out}")


if __name__ == "__main__":
    main()
