"""DFlash (z-lab) and DSpark (DeepSeek): block drafters that draft a whole block in one pass.

A few Qwen3-style layers read the block [anchor, MASK x (block_size - 1)] (embedded with the
target's embedding) bidirectionally, plus a context: the outputs of several target layers at
every committed position, concatenated, projected by `fc` and normed (`hidden_norm`). Every
layer attends over its own K/V of that context (k_proj / v_proj applied to the context feature)
followed by the block's K/V. The block's outputs at positions 1.. go through the final `norm`
and the target's lm_head: block_size - 1 drafts. Checkpoint names are z-lab's: `fc.weight`,
`hidden_norm.weight`, `norm.weight`, `layers.{i}.*` as in Qwen3 (plain RMSNorm, q/k norms).

DSpark is the same backbone plus a low-rank Markov head (`markov_head.markov_w1` [V, r],
`markov_head.markov_w2` [Vd, r]) whose bias W2 W1[previous token] is added to each position's
logits while sampling left to right; with `sample_from_anchor` every query, the anchor
included, predicts the token after it. Its configs come natively (`Qwen3DSparkModel`, flat
keys) or in the Speculators layout (`speculators_model_type: dspark`, the layer geometry under
`transformer_layer_config`, `aux_hidden_state_layer_ids` counted as the hidden state entering
a layer, so one more than our layer index).

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
        Speculators layout); refuses what we do not run (DFlash2's convolutions and candidate
        selector, sliding-window or causal layers, gated/RNN Markov heads)."""
        if config.get("speculators_model_type") == "dspark":
            config = speculators_to_native(config)
        arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
        if arch not in ("DFlashDraftModel", "Qwen3DSparkModel"):
            raise ValueError(f"unsupported drafter architecture {arch!r}; spec_jax runs DFlashDraftModel and "
                             f"Qwen3DSparkModel")
        merged = {**config, **(config.get("dflash_config") or {}), **(config.get("dspark_config") or {})}
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
        if "sliding_attention" in (config.get("layer_types") or []) or config.get("is_causal"):
            raise ValueError("DFlash drafters with sliding-window or causal layers are not supported")
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
    return {**layer, **{k: config[k] for k in keys if k in config}, "architectures": ["Qwen3DSparkModel"],
            "target_layer_ids": [i - 1 for i in aux]}


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
    """A Qwen3 decoder layer whose attention also reads the context's K/V, bidirectionally."""

    def __init__(self, cfg: DFlashConfig, *, stack=(), dtype=jnp.float32):
        H = cfg.hidden_size
        self.input_layernorm = PlainRMSNorm(H, cfg.rms_norm_eps, stack=stack)
        self.post_attention_layernorm = PlainRMSNorm(H, cfg.rms_norm_eps, stack=stack)
        self.self_attn = Attention(H, H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   rope_theta=cfg.rope_theta, qk_norm=PlainRMSNorm, eps=cfg.rms_norm_eps, stack=stack,
                                   dtype=dtype)
        self.mlp = MLP(H, cfg.intermediate_size, stack=stack, dtype=dtype)

    def __call__(self, x, positions, ctx_k, ctx_v, ctx_visible):
        """x: [B, T, H] the block; ctx_k/v: [B, S, kv, d]; ctx_visible: [B, S] bool."""
        B, T, _ = x.shape
        q, _, k, v = self.self_attn.project_heads(self.input_layernorm(x), positions)
        keys, values = jnp.concatenate([ctx_k, k], axis=1), jnp.concatenate([ctx_v, v], axis=1)
        visible = jnp.concatenate([ctx_visible, jnp.ones((B, T), bool)], axis=1)[:, None, :]
        o = attend_masked(q, keys, values, jnp.broadcast_to(visible, (B, T, keys.shape[1])))
        x = x + self.self_attn.output(o, None)
        return x + self.mlp(self.post_attention_layernorm(x))


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

    def use_decode_layout(self) -> None:
        """Every layer's weights as arrays of their own, run unrolled: inside the decode loop XLA
        copies a weight sliced out of a stack every step (`unstack_layers`). In place; repeatable."""
        if self.unstacked is None:
            self.unstacked = nnx.List([group[0] for group in unstack_layers(self, "layers")])

    def _scan(self, fn, xs_extra, init):
        """fn(layer, carry, *x[i]) -> (carry, y) over the layers; the ys stacked [layers, ...]."""
        if self.unstacked is None:
            gdef, params = nnx.split(self.layers[0])
            return scan_layers(lambda c, xs: fn(nnx.merge(gdef, xs[0]), c, *xs[1:]), init, (params, *xs_extra))
        carry, ys = init, []
        for i, layer in enumerate(self.unstacked):
            carry, y = fn(layer, carry, *(x[i] for x in xs_extra))
            ys.append(y)
        return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Context K/V of every layer: [layers, B, L, kv, d]."""
        c = self.cfg
        shape = (c.num_hidden_layers, batch, max_len, c.num_key_value_heads, c.head_dim)
        return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

    def context_kv(self, taps, positions):
        """taps [B, T, n*H] (target layer outputs) at positions [B, T] -> K, V [layers, B, T, kv, d]."""
        ctx = self.hidden_norm(self.fc(taps.astype(self.dtype)))
        _, (k, v) = self._scan(lambda layer, c: (c, layer.self_attn.keys_values(ctx, positions)), (), None)
        return k, v

    def block(self, x, positions, cache: KVCache, ctx_len):
        """x [B, T, H] the embedded block at positions [B, T]; context slots < ctx_len [B] are
        visible. Returns the post-norm hidden [B, T, H]."""
        visible = jnp.arange(cache.k.shape[2])[None, :] < ctx_len[:, None]

        def layer_fn(layer, x, k, v):
            return layer(x, positions, k, v, visible), None

        x, _ = self._scan(layer_fn, (cache.k, cache.v), x.astype(self.dtype))
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
