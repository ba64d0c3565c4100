"""Loading drafter checkpoints in their published layouts (z-lab DFlash; DSpark native and
Speculators; EAGLE-3 Speculators; a draft model), checked against the target they will draft for.
`load_draft` picks the loader a speculative config's method needs."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from models.dflash import DFlashConfig, DFlashDraft
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.qwen3_5 import Qwen3_5Config
from spec_jax.loading import load_model
from spec_jax.loading.qwen3 import load_qwen3
from spec_jax.loading.source import CheckpointError, TensorSource, fill_params, read_config, read_json, resolve_dtype

# Bare arrays (not Linears) that the published layouts store as `<name>.weight`.
EMBEDDINGS = {("markov_head", "markov_w1"), ("embed_tokens",)}


def drafter_sources(path: tuple, stacked_layers: int = 0) -> tuple[list[str], bool]:
    """Our drafter parameter path -> the published tensor names, and whether they stack over layers.
    ('layers', 0, 'self_attn', 'q_proj', 'weight') -> 'layers.{i}.self_attn.q_proj.weight' for each of
    `stacked_layers` layers stacked in our one entry (DFlash, DSpark), or 'layers.0.self_attn.q_proj.weight'
    when the one layer is not stacked (EAGLE-3); ('embed_tokens',) -> 'embed_tokens.weight'."""
    if path in EMBEDDINGS:
        return [".".join(path) + ".weight"], False
    if path[0] != "layers":
        return [".".join(map(str, path))], False
    rest = [str(p) for p in path[2:]]
    if not stacked_layers:
        return [".".join(["layers", "0", *rest])], False
    return [".".join(["layers", str(i), *rest]) for i in range(stacked_layers)], True


def dflash_sources(path: tuple, cfg: DFlashConfig) -> tuple[list[str], bool]:
    """`drafter_sources` for a DFlash or DSpark drafter of `cfg`'s depth."""
    return drafter_sources(path, cfg.num_hidden_layers)


def check_dflash_fits(cfg: DFlashConfig, target: Qwen3_5Config, where: str) -> None:
    """A drafter must read the target's hidden size, existing layers and vocabulary."""
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(f"{cfg.method} drafter {where} has hidden_size {cfg.hidden_size} but the target has "
                         f"{target.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ValueError(f"{cfg.method} drafter {where} taps target layer {bad[0]}, but the target has layers "
                         f"0..{target.num_hidden_layers - 1}")
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(f"{cfg.method} drafter {where} has mask_token_id {cfg.mask_token_id} outside the target's "
                         f"vocabulary of {target.vocab_size}")
    # The Markov head's W1, a d2t table and DFlash2's codebooks index the target's token ids: its vocabulary.
    if (cfg.markov_rank or cfg.reduced_vocab or cfg.selector_rank) and cfg.vocab_size != target.vocab_size:
        raise ValueError(f"{cfg.method} drafter {where} has vocab_size {cfg.vocab_size} but the target has "
                         f"{target.vocab_size}")


def check_draft_vocab(src: TensorSource, cfg: DFlashConfig, target_vocab_size: int, where: str) -> None:
    """A reduced-vocabulary drafter must carry its own `lm_head.weight` and a `d2t` of draft_vocab_size
    entries that sends every draft id d to a distinct target id d + d2t[d] inside the target's
    vocabulary: an id outside it cannot be verified, and two draft ids on one target id would
    leave the scattered logits ambiguous."""
    if not cfg.reduced_vocab:
        return
    Vd = cfg.draft_vocab_size
    missing = [name for name in ("lm_head.weight", "d2t") if name not in src]
    if missing:
        raise CheckpointError(f"{cfg.method} drafter {where} has draft_vocab_size {Vd} < vocab_size {cfg.vocab_size} "
                              f"but no {' or '.join(map(repr, missing))}; a reduced-vocabulary drafter needs its own "
                              f"lm_head over the draft vocabulary and the d2t table mapping it to target ids")
    d2t = np.asarray(src.get("d2t"))
    if d2t.shape != (Vd,):
        raise CheckpointError(f"{cfg.method} drafter {where}: 'd2t' has shape {d2t.shape}, but draft_vocab_size "
                              f"{Vd} needs one entry per draft id, shape ({Vd},)")
    target_ids = np.arange(Vd) + d2t.astype(np.int64)
    outside = np.flatnonzero((target_ids < 0) | (target_ids >= target_vocab_size))
    if outside.size:
        d = int(outside[0])
        raise CheckpointError(f"{cfg.method} drafter {where}: 'd2t' maps draft id {d} to target id "
                              f"{int(target_ids[d])}, outside the target's vocabulary 0..{target_vocab_size - 1}")
    ids, counts = np.unique(target_ids, return_counts=True)
    if (counts > 1).any():
        t = int(ids[counts > 1][0])
        a, b = np.flatnonzero(target_ids == t)[:2].tolist()
        raise CheckpointError(f"{cfg.method} drafter {where}: 'd2t' maps draft ids {a} and {b} both to target "
                              f"id {t}; each draft id needs a target id of its own")


def load_dflash(model_dir: str | os.PathLike, target: Qwen3_5Config, dtype="float32"):
    """A DFlash or DSpark checkpoint -> (DFlashDraft, DFlashConfig), refused by name if it does not
    fit `target`."""
    cfg = read_config(model_dir, DFlashConfig.from_hf)
    where = repr(str(model_dir))
    check_dflash_fits(cfg, target, where)
    src = TensorSource(model_dir)
    check_draft_vocab(src, cfg, target.vocab_size, where)
    dtype = resolve_dtype(dtype)
    model = fill_params(lambda: DFlashDraft(cfg, dtype=dtype), src, lambda path: dflash_sources(path, cfg))
    return model, cfg


def load_eagle3(model_dir: str | os.PathLike, target: Qwen3_5Config, dtype="float32"):
    """A Speculators EAGLE-3 checkpoint -> (Eagle3Draft, Eagle3Config), refused by name if it
    does not fit `target`. Original EAGLE-3 names (`midlayer.*`) are read as `layers.0.*`."""
    src = TensorSource(model_dir)
    cfg = read_config(model_dir, Eagle3Config.from_hf).with_target(target.num_hidden_layers, target.hidden_size)
    cfg = dataclasses.replace(cfg, has_embedding="embed_tokens.weight" in src)
    where = repr(str(model_dir))
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"EAGLE-3 head {where} has vocab_size {cfg.vocab_size} but the target has {target.vocab_size}")
    if cfg.target_hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE-3 head {where} reads target_hidden_size {cfg.target_hidden_size} but the target has "
                         f"{target.hidden_size}")
    if not cfg.has_embedding and cfg.hidden_size != target.hidden_size:
        raise ValueError(f"EAGLE-3 head {where} has hidden_size {cfg.hidden_size} and no embed_tokens of its own; "
                         f"sharing the target's embedding needs the target's hidden_size {target.hidden_size}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if len(cfg.target_layer_ids) != 3 or bad:
        raise ValueError(f"EAGLE-3 head {where} taps target layers {list(cfg.target_layer_ids)}; it needs three of "
                         f"0..{target.num_hidden_layers - 1}")
    def read(name):
        return src.get(name if name in src or not name.startswith("layers.0.")
                       else "midlayer." + name[len("layers.0."):])
    model = fill_params(lambda: Eagle3Draft(cfg, dtype=resolve_dtype(dtype)), src, drafter_sources, read)
    return model, cfg


def check_drafter_folder(spec) -> None:
    """ValueError naming speculative_config.model unless it is a folder holding a config.json, as
    every drafter layout is."""
    path = Path(spec.model)
    found = ("does not exist" if not path.exists() else "is not a folder" if not path.is_dir()
             else "has no config.json" if not (path / "config.json").is_file() else None)
    if found:
        raise ValueError(f"speculative_config.model={spec.model!r} {found}; method {spec.method!r} needs the "
                         f"drafter's checkpoint folder (its config.json and safetensors)")


def load_draft(spec, target_cfg, dtype):
    """The network a parsed speculative config's `model` names, in the target's dtype: a DFlash /
    DSpark drafter, an EAGLE-3 head, or for draft_model a
    Qwen3.5/3.6 or plain Qwen3 model whose vocabulary must be the target's (drafts are token ids
    the target verifies)."""
    check_drafter_folder(spec)
    if spec.method in ("dflash", "dspark"):
        return load_dflash(spec.model, target_cfg, dtype)[0]
    if spec.method == "eagle3":
        return load_eagle3(spec.model, target_cfg, dtype)[0]
    config = read_json(Path(spec.model) / "config.json")
    architectures = " ".join(config.get("architectures") or [])
    for marker, method in (("DFlash", "dflash"), ("DSpark", "dspark"), ("Eagle3", "eagle3")):
        if marker in architectures or config.get("speculators_model_type") == method:
            raise ValueError(f"{spec.model!r} is a {method} drafter ({architectures or method}), not a model "
                             f"draft_model can run; set method to {method!r}")
    if config.get("model_type") == "qwen3":
        draft, cfg = load_qwen3(spec.model, dtype)
    else:
        draft, cfg = load_model(spec.model, dtype)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"draft model {spec.model!r} has vocab_size {cfg.vocab_size} but the target has "
                         f"{target_cfg.vocab_size}; draft_model needs the target's vocabulary")
    return draft
