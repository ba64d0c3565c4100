"""DFlash (z-lab) and DSpark (DeepSeek): block drafters that draft a whole block in one pass.

A few Qwen3-style layers read the block [anchor, MASK x (block_size - 1)] (embedded with the
target's embedding) bidirectionally, plus a context: the outputs of several target layers at
every committed position, concatenated, projected by `fc` and normed (`hidden_norm`). Every
layer attends over its own K/V of that context (k_proj / v_proj applied to the context feature)
followed by the block's K/V, under the layer's mask: bidirectional, or causal and/or a sliding
window as the config says (`models.drafter_attention`, vLLM's rules; a sliding layer's context
cache holds only the window). The block's outputs at positions 1.. go through the final `norm`
and the target's lm_head: block_size - 1 drafts. Checkpoint names are z-lab's: `fc.weight`,
`hidden_norm.weight`, `norm.weight`, `layers.{i}.*` as in Qwen3 (plain RMSNorm, q/k norms).

DSpark is the same backbone plus a low-rank Markov head (`markov_head.markov_w1` [V, r],
`markov_head.markov_w2` [Vd, r]) whose bias W2 W1[previous token] is added to each position's
logits while sampling left to right; with `sample_from_anchor` every query, the anchor
included, predicts the token after it. Its configs come natively (`Qwen3DSparkModel`, flat
keys) or in the Speculators layout (`speculators_model_type: dspark`, the layer geometry under
`transformer_layer_config`, `aux_hidden_state_layer_ids` counted as the hidden state entering
a layer, so one more than our layer index).

DFlash2 (`DFlash2DraftModel`) adds a convolution around each layer's attention and MLP and a
candidate selector (`models.dflash2`; its sizes in `dflash_config`); it drafts like DFlash.

A reduced draft vocabulary (`draft_vocab_size` Vd < `vocab_size` V) works as EAGLE-3's: the
drafter carries its own `lm_head.weight` [Vd, H] and `d2t` [Vd], draft id d standing for target
id d + d2t[d]. Logits and the Markov bias live in draft space; `to_target_vocab` scatters them
to the target's ids with -inf elsewhere, so every draft is a draft-vocabulary token and a
sampled draft's q is a distribution over the target vocabulary. The previous token that W1
reads is always a target id (the anchor is one), so W1 keeps all V rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.dflash2 import CandidateSelector, GroupedDynamicConv
from models.drafter_attention import (SLIDING, LayerAttention, check_window, declared_layer_types, hf_sliding_window,
                                     ring_positions, ring_write)
from models.layers import MLP, Attention, KVCache, Linear, PlainRMSNorm, attend_masked, scan_layers, unstack_layers


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """z-lab's config keys: the Qwen3 layer geometry at the top level, the drafter's own keys
    in `dflash_config` (which wins where both give one)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    vocab_size: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    markov_rank: int = 0  # DSpark's Markov head (0: none, plain DFlash)
    markov_head_type: str = "vanilla"
    sample_from_anchor: bool = False  # DSpark: every query predicts the next token
    draft_vocab_size: int | None = None
    # Sliding-window and causal layers (`models.drafter_attention`): the declared kinds (() all
    # full), dflash_config.use_swa, the window, and the causality override (None: by kind).
    layer_types: tuple[str, ...] = ()
    use_swa: bool = False
    sliding_window: int | None = None
    causal: bool | None = None
    window_from_anchor: bool = False  # Speculators' layout: the window counts from the block's anchor
    # DFlash2 (`models.dflash2`): convolutions of conv_kernel_size taps (0: none) and a candidate
    # selector of rank selector_rank (0: none) over the top selector_top_k logits.
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 16

    def layer_attention(self, i: int) -> LayerAttention:
        """Layer i's mask by vLLM's rules: sliding by its declared kind (every layer with use_swa
        when none is declared sliding), causal by the override, else iff declared sliding."""
        declared = self.layer_types[i] == SLIDING if self.layer_types else False
        slides = declared if SLIDING in self.layer_types else self.use_swa
        return LayerAttention(self.sliding_window if slides else None,
                              declared if self.causal is None else self.causal, slides and self.window_from_anchor)

    def attention_runs(self) -> tuple[tuple[int, int, LayerAttention], ...]:
        """(first, stop, mask) of each run of consecutive layers with one mask: each run keeps one
        cache, of the window's length for a sliding run."""
        runs = []
        for i in range(self.num_hidden_layers):
            att = self.layer_attention(i)
            if runs and runs[-1][2] == att:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1, att])
        return tuple(map(tuple, runs))

    @property
    def method(self) -> str:
        return "dspark" if self.markov_rank else "dflash"

    @property
    def reduced_vocab(self) -> bool:
        """Whether the drafter predicts over its own smaller vocabulary (an lm_head and d2t of its own)."""
        sizes = (self.draft_vocab_size, self.vocab_size)
        return None not in sizes and self.draft_vocab_size < self.vocab_size

    @property
    def output_vocab_size(self) -> int | None:
        """Vd, the size of the vocabulary the drafter's logits cover (the target's V unless reduced)."""
        return self.draft_vocab_size if self.reduced_vocab else self.vocab_size

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "DFlashConfig":
        """Build from a DFlash or DSpark checkpoint's `config.json` (z-lab, native DeepSeek or
        Speculators layout) or a DFlash2 one; refuses what we do not run (gated/RNN Markov heads)."""
        if config.get("speculators_model_type") == "dspark":
            config = speculators_to_native(config)
        arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
        if arch not in ("DFlashDraftModel", "DFlash2DraftModel", "Qwen3DSparkModel"):
            raise ValueError(f"unsupported drafter architecture {arch!r}; spec_jax runs DFlashDraftModel, "
                             f"DFlash2DraftModel and Qwen3DSparkModel")
        merged = {**config, **(config.get("dflash_config") or {}), **(config.get("dspark_config") or {})}
        if arch == "DFlash2DraftModel":
            check_dflash2_keys(merged)
        check_layer_keys(merged)
        if arch == "Qwen3DSparkModel":
            merged.setdefault("sample_from_anchor", True)
            if not merged.get("markov_rank"):
                raise ValueError("DSpark config is missing 'markov_rank'")
        if merged.get("markov_rank") and merged.get("markov_head_type", "vanilla") != "vanilla":
            raise ValueError(f"markov_head_type {merged['markov_head_type']!r} is not supported; spec_jax runs the "
                             f"vanilla Markov head (as vLLM does at inference)")
        if merged.get("draft_vocab_size") is not None and merged.get("vocab_size") is None:
            raise ValueError(f"draft_vocab_size {merged['draft_vocab_size']} needs vocab_size, the target "
                             f"vocabulary its d2t table maps into")
        merged.update(layer_masks(config, merged))
        rope = config.get("rope_parameters") or {}
        merged.setdefault("rope_theta", rope.get("rope_theta", 1e6))
        if merged.get("head_dim") is None:
            merged["head_dim"] = merged["hidden_size"] // merged["num_attention_heads"]
        for key in ("target_layer_ids", "mask_token_id"):
            if merged.get(key) is None:
                raise ValueError(f"DFlash config is missing {key!r} (in dflash_config)")
        merged["target_layer_ids"] = tuple(merged["target_layer_ids"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in merged.items() if k in names and v is not None})


# Keys vLLM's DFlash reader (qwen3_dflash.py) acts on, with the value we run; another is refused by name.
LAYER_KEYS = {"attention_bias": False, "attention_sink_bias": False, "add_swa_attention_sink_bias": False,
              "is_neox_style": True, "use_aux_hidden_state": True, "hidden_act": "silu"}


def check_layer_keys(merged: dict[str, Any]) -> None:
    """ValueError naming a layer variant vLLM's reader knows and we do not run (a bias, attention
    sinks, interleaved RoPE, no target taps, another activation), so its tensors are not dropped."""
    for key, ours in LAYER_KEYS.items():
        if merged.get(key, ours) != ours:
            raise ValueError(f"DFlash config: {key}={merged[key]!r} is not supported; spec_jax runs {key}={ours!r}")


def check_dflash2_keys(merged: dict[str, Any]) -> None:
    """A DFlash2 config must give its convolution and selector sizes as positive integers, and
    predicts over the target's whole vocabulary."""
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = merged.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"DFlash2 config: dflash_config.{key}={value!r} must be a positive integer")
    if merged.get("draft_vocab_size") not in (None, merged.get("vocab_size")):
        raise ValueError(f"DFlash2 config: draft_vocab_size {merged['draft_vocab_size']} is not supported; its "
                         f"selector ranks the target's own top-k logits")


def layer_masks(config: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
    """The sliding-window and causal fields of a block drafter's config (top-level keys as
    transformers' Qwen3Config reads them, the drafter's own in `merged`)."""
    if merged.get("num_hidden_layers") is None:
        return {}
    kinds = declared_layer_types(config, merged["num_hidden_layers"])
    use_swa = bool(merged.get("use_swa", False))
    window = merged.get("swa_window_size", hf_sliding_window(config))
    if use_swa or SLIDING in kinds:
        window = check_window(window, "DFlash config")
    causal = config.get("is_causal")
    causal = merged.get("causal") if causal is None else bool(causal)
    if causal is not None and all((kind == SLIDING) == causal for kind in kinds):
        causal = None  # the override says what the layer kinds say: one config, whichever layout wrote it
    return {"layer_types": kinds, "use_swa": use_swa, "sliding_window": window, "causal": causal,
            "window_from_anchor": bool(merged.get("window_from_anchor")) and window is not None}


def speculators_to_native(config: dict[str, Any]) -> dict[str, Any]:
    """A Speculators-layout DSpark config -> the native keys. Speculators count an aux layer id
    as the hidden state entering that layer (vLLM's capture point): our layer index is id - 1."""
    layer = dict(config.get("transformer_layer_config") or {})
    if not layer:
        raise ValueError("Speculators DSpark config is missing 'transformer_layer_config'")
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError("Speculators DSpark config is missing 'aux_hidden_state_layer_ids'")
    keys = ("block_size", "mask_token_id", "markov_rank", "markov_head_type", "draft_vocab_size", "sample_from_anchor")
    # Speculators' training mask: sliding layers causal unless sliding_window_non_causal (default
    # false), full layers never; the window counts from the block's anchor.
    causal = {"causal": False} if config.get("sliding_window_non_causal", False) else {}
    return {**layer, **{k: config[k] for k in keys if k in config}, "architectures": ["Qwen3DSparkModel"],
            "target_layer_ids": [i - 1 for i in aux], "dflash_config": causal, "window_from_anchor": True}


class MarkovHead(nnx.Module):
    """DSpark's vanilla Markov head: bias(prev) = W2 W1[prev], W1 [V, r] (an embedding over the
    target vocabulary, as the previous token is a target id), W2 [Vd, r] (a linear r -> Vd, onto
    the draft vocabulary the logits cover)."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int, *, dtype=jnp.float32):
        self.markov_w1 = nnx.Param(jnp.zeros((vocab, rank), dtype))
        self.markov_w2 = Linear(rank, draft_vocab, dtype=dtype)

    def __call__(self, prev: jax.Array) -> jax.Array:
        """prev [B] target token ids -> float32 bias over the draft vocabulary [B, Vd]."""
        return self.markov_w2(self.markov_w1[...][prev]).astype(jnp.float32)


class DFlashLayer(nnx.Module):
    """A Qwen3 decoder layer whose attention also reads the context's K/V, under its layer's mask
    (bidirectional by default; causal and/or sliding-window as the config says)."""

    def __init__(self, cfg: DFlashConfig, *, stack=(), dtype=jnp.float32):
        H = cfg.hidden_size
        self.input_layernorm = PlainRMSNorm(H, cfg.rms_norm_eps, stack=stack)
        self.post_attention_layernorm = PlainRMSNorm(H, cfg.rms_norm_eps, stack=stack)
        self.self_attn = Attention(H, H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   rope_theta=cfg.rope_theta, qk_norm=PlainRMSNorm, eps=cfg.rms_norm_eps, stack=stack,
                                   dtype=dtype)
        self.mlp = MLP(H, cfg.intermediate_size, stack=stack, dtype=dtype)
        # DFlash2: a convolution around the attention and the MLP
        self.attention_conv, self.mlp_conv = (
            [GroupedDynamicConv(H, cfg.conv_kernel_size, cfg.conv_group_size, stack=stack, dtype=dtype)
             for _ in range(2)] if cfg.conv_kernel_size else (None, None))

    def __call__(self, x, positions, ctx_k, ctx_v, visible):
        """x: [B, T, H] the block; ctx_k/v: [B, kv, S, d] the context slots; visible: [B, T, S + T]
        which context slots, then which block positions, each query sees."""
        h, coef = self._prepare(self.attention_conv, self.input_layernorm(x))
        q, _, k, v = self.self_attn.project_heads(h, positions)
        h = self.self_attn.output(attend_masked(q, k, v, visible, context=(ctx_k, ctx_v)), None)
        x = x + self._finish(self.attention_conv, h, coef)
        h, coef = self._prepare(self.mlp_conv, self.post_attention_layernorm(x))
        return x + self._finish(self.mlp_conv, self.mlp(h), coef)

    @staticmethod
    def _prepare(conv, h):
        return (h, None) if conv is None else conv.prepare(h)

    @staticmethod
    def _finish(conv, h, coef):
        return h if conv is None else conv.finish(h, coef)


class DFlashDraft(nnx.Module):
    """The drafter: `context_kv` turns target taps into per-layer context K/V; `block` runs a
    block against that context."""

    def __init__(self, cfg: DFlashConfig, *, dtype=jnp.float32):
        H = cfg.hidden_size
        self.cfg = cfg
        self.dtype = dtype
        self.fc = Linear(len(cfg.target_layer_ids) * H, H, dtype=dtype)
        self.hidden_norm = PlainRMSNorm(H, cfg.rms_norm_eps)
        self.norm = PlainRMSNorm(H, cfg.rms_norm_eps)
        self.layers = nnx.List([DFlashLayer(cfg, stack=(cfg.num_hidden_layers,), dtype=dtype)])
        self.unstacked = nnx.data(None)  # the layers with arrays of their own, after `use_decode_layout`
        # A reduced vocabulary needs a head of its own: the target's lm_head covers other ids.
        self.lm_head = Linear(H, cfg.draft_vocab_size, dtype=dtype) if cfg.reduced_vocab else None
        self.d2t = nnx.Param(jnp.zeros((cfg.draft_vocab_size,), jnp.int32)) if cfg.reduced_vocab else None
        self.markov_head = (MarkovHead(cfg.vocab_size, cfg.output_vocab_size, cfg.markov_rank, dtype=dtype)
                            if cfg.markov_rank else None)
        self.candidate_selector = (CandidateSelector(H, cfg.vocab_size, cfg.selector_rank, cfg.selector_top_k,
                                                     dtype=dtype) if cfg.selector_rank else None)

    def use_decode_layout(self) -> None:
        """Every layer's weights as arrays of their own, run unrolled: inside the decode loop XLA
        copies a weight sliced out of a stack every step (`unstack_layers`). In place; repeatable."""
        if self.unstacked is None:
            self.unstacked = nnx.List([group[0] for group in unstack_layers(self, "layers")])

    def _scan(self, fn, xs_extra, init, first: int = 0, stop: int | None = None):
        """fn(layer, carry, *x[i]) -> (carry, y) over layers first..stop - 1 (all by default); the
        ys stacked [layers, ...]."""
        stop = self.cfg.num_hidden_layers if stop is None else stop
        if self.unstacked is None:
            gdef, params = nnx.split(self.layers[0])
            if (first, stop) != (0, self.cfg.num_hidden_layers):
                params = jax.tree.map(lambda p: p[first:stop], params)
            return scan_layers(lambda c, xs: fn(nnx.merge(gdef, xs[0]), c, *xs[1:]), init, (params, *xs_extra))
        carry, ys = init, []
        for i, layer in enumerate(self.unstacked[first:stop]):
            carry, y = fn(layer, carry, *(x[i] for x in xs_extra))
            ys.append(y)
        return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)

    def init_cache(self, batch: int, max_len: int) -> tuple[KVCache, ...]:
        """Context K/V, one cache per run of layers with one mask (`attention_runs`), head-major:
        [run layers, B, kv, slots, d], slots = max_len for full attention, the window for sliding."""
        c = self.cfg

        def zeros(first, stop, att):
            shape = (stop - first, batch, c.num_key_value_heads, att.ring_size(max_len), c.head_dim)
            return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

        return tuple(zeros(*run) for run in c.attention_runs())

    def context_kv(self, taps, positions):
        """taps [B, T, n*H] (target layer outputs) at positions [B, T] -> K, V [layers, B, kv, T, d]
        (head-major, as the cache holds them)."""
        ctx = self.hidden_norm(self.fc(taps.astype(self.dtype)))
        _, (k, v) = self._scan(lambda layer, c: (c, layer.self_attn.keys_values(ctx, positions)), (), None)
        return jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)

    def write_context(self, cache: tuple[KVCache, ...], taps, start, n_valid) -> tuple[KVCache, ...]:
        """The context K/V of taps [B, T, n*H] at positions start [B] + t, for t < n_valid [B],
        into each run's cache (slot = position mod its length)."""
        pos = start[:, None] + jnp.arange(taps.shape[1])[None, :]
        k, v = self.context_kv(taps, pos)
        return tuple(KVCache(ring_write(c.k, k[first:stop], start, n_valid),
                             ring_write(c.v, v[first:stop], start, n_valid))
                     for (first, stop, _), c in zip(self.cfg.attention_runs(), cache))

    def block(self, x, positions, cache: tuple[KVCache, ...], ctx_len):
        """x [B, T, H] the embedded block at positions [B, T], over the context of positions below
        ctx_len [B] (what each layer's mask lets it see of them). Returns the post-norm hidden [B, T, H]."""
        x = x.astype(self.dtype)
        for (first, stop, att), c in zip(self.cfg.attention_runs(), cache):
            held = ring_positions(ctx_len, c.k.shape[3])  # the position each context slot holds
            visible = att.block_visible(positions, held, ctx_len)

            def layer_fn(layer, x, k, v, visible=visible):
                return layer(x, positions, k, v, visible), None

            x, _ = self._scan(layer_fn, (c.k, c.v), x, first, stop)
        return self.norm(x)

    def draft_vocab_logits(self, hidden, target_logits):
        """Post-norm hidden [..., H] -> float32 logits over the draft vocabulary [..., Vd]: the
        drafter's own lm_head when its vocabulary is reduced, else `target_logits` (the target's
        lm_head, Vd = V)."""
        if self.lm_head is None:
            return target_logits(hidden)
        return self.lm_head(hidden).astype(jnp.float32)

    def to_target_vocab(self, logits):
        """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V]: draft id d lands
        on target id d + d2t[d], every other id gets -inf (never drafted, probability 0). The
        identity when the vocabulary is not reduced."""
        if self.d2t is None:
            return logits
        target_ids = jnp.arange(self.cfg.draft_vocab_size) + self.d2t[...]
        full = jnp.full((*logits.shape[:-1], self.cfg.vocab_size), -jnp.inf, logits.dtype)
        return full.at[..., target_ids].set(logits)
