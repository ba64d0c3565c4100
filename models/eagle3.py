"""EAGLE-3 draft head in the Speculators layout (vLLM's `Eagle3LlamaForCausalLM`).

Three target layers' outputs are concatenated and projected by `fc` (3 x target hidden -> H).
One Llama decoder layer ("midlayer") reads concat(input_layernorm(embed(token)),
hidden_norm(hidden)) — 2H wide into q/k/v — attends causally over its own KV cache, and adds
the residual (the hidden state itself, or its normed value with `norm_before_residual`). Its
pre-norm output feeds the next chained step; `norm` then `lm_head` over a possibly reduced
draft vocabulary, whose ids map to the target's by `d2t` (target id = d + d2t[d]).
Names: `fc.weight`, `layers.0.*` (or `midlayer.*`), `norm.weight`, `lm_head.weight`, `d2t`,
and `embed_tokens.weight` when the head has its own embedding (else the target's is shared).

A midlayer whose kind is `sliding_attention` (vLLM's LlamaAttention reads `layer_types[0]` and
`sliding_window` of `transformer_layer_config`) attends causally to the last `sliding_window`
positions, itself included; its KV cache is a ring of the window plus the k positions a step
drafts past the committed length (`models.drafter_attention`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx

from models.drafter_attention import (SLIDING, LayerAttention, check_window, declared_layer_types, hf_sliding_window,
                                     ring_positions, ring_write)
from models.layers import MLP, Attention, Batch, KVCache, Linear, PlainRMSNorm, attend_masked, zeros_param


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """Speculators' EAGLE-3 keys; the layer geometry comes from `transformer_layer_config`."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_layer_ids: tuple[int, ...] = ()  # our layer indices (Speculators' aux ids - 1)
    target_hidden_size: int | None = None
    norm_before_residual: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    has_embedding: bool = False  # set by the loader from the checkpoint's tensors
    sliding_window: int | None = None  # the midlayer's window (None: full causal attention)

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Eagle3Config":
        if config.get("speculators_model_type") != "eagle3":
            raise ValueError(f"not an EAGLE-3 Speculators config (speculators_model_type "
                             f"{config.get('speculators_model_type')!r}); expected 'eagle3'")
        layer = dict(config.get("transformer_layer_config") or {})
        if not layer:
            raise ValueError("EAGLE-3 config is missing 'transformer_layer_config'")
        if layer.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"EAGLE-3 heads with {layer['num_hidden_layers']} layers are not supported (one midlayer)")
        rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported rope_type {rope.get('rope_type', rope.get('type'))!r} in the EAGLE-3 head")
        if layer.get("is_causal", config.get("is_causal", True)) is not True:
            raise ValueError("EAGLE-3 head with is_causal false is not supported; its midlayer drafts left to "
                             "right, attending causally")
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
            num_attention_heads=layer["num_attention_heads"],
            num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
            head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
            vocab_size=layer["vocab_size"], draft_vocab_size=config.get("draft_vocab_size") or layer["vocab_size"],
            target_layer_ids=tuple(i - 1 for i in aux) if aux else (),
            target_hidden_size=config.get("target_hidden_size"),
            # absent: false, as vLLM's Eagle3LlamaForCausalLM and Speculators' config default it
            norm_before_residual=config.get("norm_before_residual", False),
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", layer.get("rope_theta", 10000.0)),
            sliding_window=midlayer_window(layer),
        )

    def with_target(self, num_layers: int, hidden: int) -> "Eagle3Config":
        """Fill what the target decides: vLLM's default taps (2, L/2, L-3) in its entering-layer
        convention, i.e. our layers (1, L/2 - 1, L - 4), and the target hidden size."""
        taps = self.target_layer_ids or (1, num_layers // 2 - 1, num_layers - 4)
        return dataclasses.replace(self, target_layer_ids=taps, target_hidden_size=self.target_hidden_size or hidden)


def midlayer_window(layer: dict[str, Any]) -> int | None:
    """The midlayer's sliding window when its kind (`layer_types[0]`, or transformers' rule) is
    sliding, else None. Qwen configs keep `sliding_window` only with `use_sliding_window`."""
    if declared_layer_types(layer, 1)[0] != SLIDING:
        return None
    qwen = str(layer.get("model_type", "llama")).startswith("qwen")
    return check_window(hf_sliding_window(layer) if qwen else layer.get("sliding_window"), "EAGLE-3 config")


class Eagle3Layer(nnx.Module):
    """The midlayer: q/k/v read [embedding | hidden] (2H), Llama attention (no q/k norms)."""

    def __init__(self, cfg: Eagle3Config, *, dtype=jnp.float32):
        H = cfg.hidden_size
        self.cfg = cfg
        self.input_layernorm = PlainRMSNorm(H, cfg.rms_norm_eps)
        self.hidden_norm = PlainRMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = PlainRMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(2 * H, H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   rope_theta=cfg.rope_theta, dtype=dtype)
        self.mlp = MLP(H, cfg.intermediate_size, dtype=dtype)

    def __call__(self, embedded, hidden, batch: Batch, cache: KVCache, kv_len: int):
        """embedded, hidden: [B, T, H]. Returns the pre-norm output [B, T, H] and the cache."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.cfg.norm_before_residual else hidden
        x = jnp.concatenate([self.input_layernorm(embedded), normed], axis=-1)
        if self.cfg.sliding_window is None:
            h, cache = self.self_attn(x, batch, cache, 0, kv_len)
        else:
            h, cache = self.windowed_attention(x, batch, cache)
        residual = residual + h
        return residual + self.mlp(self.post_attention_layernorm(residual)), cache

    def windowed_attention(self, x, batch: Batch, cache: KVCache):
        """Causal sliding-window attention of x [B, T, 2H] over the ring cache [1, B, kv, R, d]
        (positions below batch.start) and the new tokens, whose real ones are then written to
        the ring. Returns ([B, T, H], cache)."""
        positions = batch.positions_for(x.shape[1])
        q, _, k, v = self.self_attn.project_heads(x, positions)
        att = LayerAttention(self.cfg.sliding_window, causal=True)
        held = ring_positions(batch.start, cache.k.shape[3])
        visible = jnp.concatenate([att.visible(positions, held), att.visible(positions, positions)], axis=2)
        k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        o = attend_masked(q, k, v, visible, context=(cache.k[0], cache.v[0]))
        cache = KVCache(ring_write(cache.k, jnp.swapaxes(k, 1, 2)[None], batch.start, batch.n_valid),
                        ring_write(cache.v, jnp.swapaxes(v, 1, 2)[None], batch.start, batch.n_valid))
        return self.self_attn.output(o, None), cache


class Eagle3Draft(nnx.Module):
    def __init__(self, cfg: Eagle3Config, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        target_hidden = cfg.target_hidden_size or cfg.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * target_hidden, cfg.hidden_size, dtype=dtype)
        self.embed_tokens = zeros_param((cfg.vocab_size, cfg.hidden_size), dtype) if cfg.has_embedding else None
        self.layers = nnx.List([Eagle3Layer(cfg, dtype=dtype)])
        self.norm = PlainRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, dtype=dtype)
        self.d2t = nnx.Param(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))

    def init_cache(self, batch: int, max_len: int, k: int = 0) -> KVCache:
        """Full attention: the target's layout, [1, B, max_len, kv, d]. A sliding window: a
        head-major ring [1, B, kv, slots, d] of the window plus the k positions a step drafts past
        the committed length (their stale keys must fall outside every later query's window)."""
        c = self.cfg
        if c.sliding_window is None:
            shape = (1, batch, max_len, c.num_key_value_heads, c.head_dim)
        else:
            slots = LayerAttention(c.sliding_window).ring_size(max_len, extra=k)
            shape = (1, batch, c.num_key_value_heads, slots, c.head_dim)
        return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

    def embed(self, tokens, target_embed):
        """tokens [B, T] with the head's own embedding, or the target's `embed` method."""
        return self.embed_tokens[...][tokens] if self.embed_tokens is not None else target_embed(tokens)

    def run(self, embedded, hidden, batch: Batch, cache: KVCache, kv_len: int):
        """embedded, hidden: [B, T, H] (hidden: fc of the taps, or the head's own output).
        Returns the pre-norm output [B, T, H] (what chains) and the cache."""
        return self.layers[0](embedded, hidden.astype(self.dtype), batch, cache, kv_len)

    def logits(self, pre):
        """Pre-norm output [..., H] -> float32 logits over the TARGET vocabulary [..., V] (-inf
        off the draft vocabulary, whose ids map through d2t)."""
        draft_logits = self.lm_head(self.norm(pre)).astype(jnp.float32)
        target_ids = jnp.arange(self.cfg.draft_vocab_size) + self.d2t[...]
        full = jnp.full((*draft_logits.shape[:-1], self.cfg.vocab_size), -jnp.inf, jnp.float32)
        return full.at[..., target_ids].set(draft_logits)

    def __call__(self, embedded, hidden, batch: Batch, cache: KVCache, kv_len: int):
        """Returns (logits over the TARGET vocabulary [B, T, V] float32, pre-norm hidden, cache)."""
        pre, cache = self.run(embedded, hidden, batch, cache, kv_len)
        return self.logits(pre), pre, cache
