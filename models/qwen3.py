"""Plain Qwen3 dense language model (HF `Qwen3ForCausalLM`, model_type "qwen3") in Flax NNX.

Meant as a separate draft model for speculation, so it keeps `Qwen3_5Model`'s calling convention:
`model(tokens, batch, cache, kv_len=...)` -> `ForwardOut`, `.init_cache`, `.embed`,
`.logits`, `.commit`, `.cfg`, `.dtype`; the engine can drive either. Building blocks (Linear, MLP,
`Attention`, KVCache, Batch) are `models/layers.py`'s; what differs from Qwen3.5:

* RMSNorm is the standard `x * rsqrt(mean(x^2) + eps) * w` (weight init 1), not `(1 + w)`;
* every layer is full attention with q/k RMSNorm over head_dim and RoPE on the whole head,
  no output gate (q_proj is [nq*d, H]), optional q/k/v/o biases (`attention_bias`);
* no GDN layers, hence nothing to roll back after a verify pass.

All layers are stacked on a leading axis and run under one `scan_layers`; the model is pure over
an explicit `KVCache` [num_layers, B, L, kv_heads, head_dim]. Checkpoint name mapping lives in
`spec_jax/loading/qwen3.py`; attribute names mirror the HF tensor names.

Shapes: B batch rows, T new tokens, L cache length, H hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.drafter_attention import declared_layer_types
from models.layers import (MLP, Attention, Batch, KVCache, Linear, PlainRMSNorm, check_head_groups, scan_layers,
                           unstack_layers, zeros_param)
from models.qwen3_5 import FULL, ForwardOut, Qwen3_5Model

SUPPORTED_MODEL_TYPES = ("qwen3",)


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """The model's config; field names are the checkpoint's `config.json` keys and defaults are
    HF's `Qwen3Config` defaults (a key missing from config.json means what it means to HF)."""

    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128  # HF's default, not hidden_size // num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; only 'silu' (SwiGLU) is implemented")
        check_head_groups(self, "num_attention_heads", "num_key_value_heads")

    # Qwen3_5Config's layout vocabulary, so code written for it (checkpoint naming, cache
    # sizing) reads this config too: one full-attention layer repeated num_hidden_layers times.
    @property
    def layer_types(self) -> tuple[str, ...]:
        return (FULL,) * self.num_hidden_layers

    @property
    def pattern(self) -> tuple[str, ...]:
        return (FULL,)

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers

    @property
    def rotary_dim(self) -> int:
        return self.head_dim  # full rotary: HF's Qwen3 ignores partial_rotary_factor

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen3Config":
        """Build from a checkpoint's `config.json` dict (transformers 4 or 5 layout).

        Raises ValueError naming the `model_type` when it is not "qwen3", the `rope_type` when it
        is not default RoPE, and the layer kind when any layer uses sliding-window attention.
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; Qwen3Model runs "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        raw = dict(config)
        # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` and `rope_scaling`.
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}; only 'default' RoPE is implemented")
        if "rope_theta" in rope:
            raw["rope_theta"] = rope["rope_theta"]
        check_full_attention(raw)
        if raw.get("num_key_value_heads") is None and "num_attention_heads" in raw:
            raw["num_key_value_heads"] = raw["num_attention_heads"]  # HF: no key means plain MHA
        eos = raw.get("eos_token_id")
        raw["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names and v is not None})


def check_full_attention(config: dict[str, Any]) -> None:
    """Refuse configs in which HF would run any layer with sliding-window attention."""
    kinds = config.get("layer_types")
    if kinds is None:  # HF's rule: with use_sliding_window, layers from max_window_layers on slide
        kinds = declared_layer_types(config, config.get("num_hidden_layers", 32))
    bad = [k for k in kinds if k != FULL]
    if bad:
        raise ValueError(f"layer kind {bad[0]!r} is not supported; Qwen3Model runs only {FULL!r} layers")


# ----------------------------------------------------------------------------- layers


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: Qwen3Config, *, stack=(), dtype=jnp.float32):
        self.input_layernorm = PlainRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack)
        self.post_attention_layernorm = PlainRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack)
        # Full causal attention: q/k norms over head_dim, full-head RoPE, no gate, optional biases.
        H = cfg.hidden_size
        self.self_attn = Attention(H, H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   rope_theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim, qk_norm=PlainRMSNorm,
                                   eps=cfg.rms_norm_eps, bias=cfg.attention_bias, stack=stack, dtype=dtype)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, stack=stack, dtype=dtype)

    def __call__(self, x: jax.Array, batch: Batch, cache: KVCache, g, kv_len: int):
        h, cache = self.self_attn(self.input_layernorm(x), batch, cache, g, kv_len)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


# ----------------------------------------------------------------------------- model


def init_qwen3_cache(cfg: Qwen3Config, batch: int, max_len: int, dtype) -> KVCache:
    """Empty K/V caches for `batch` rows of up to `max_len` tokens:
    k, v [num_hidden_layers, batch, max_len, num_key_value_heads, head_dim]."""
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class Qwen3Model(nnx.Module):
    """Embedding, the stacked decoder layers, final norm and lm_head (None when tied)."""

    rolls_back_by_length = True  # attention only: a row's length decides what is read

    def __init__(self, cfg: Qwen3Config, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = zeros_param((cfg.vocab_size, cfg.hidden_size), dtype)
        # A list of one layer stacked over all N layers: the shape of Qwen3_5Model.layers for a
        # one-kind pattern, so parameter paths (('layers', 0, ...)) map onto HF names alike.
        self.layers = nnx.List([DecoderLayer(cfg, stack=(cfg.num_hidden_layers,), dtype=dtype)])
        self.unstacked = nnx.data(None)  # the layers with arrays of their own, after `use_decode_layout`
        self.norm = PlainRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)

    def use_decode_layout(self) -> None:
        """Every layer's weights as arrays of their own, run unrolled (see
        `Qwen3_5Model.use_decode_layout`). In place; repeatable."""
        if self.unstacked is None:
            self.unstacked = nnx.List([group[0] for group in unstack_layers(self, "layers")])

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        """Empty caches for `batch` rows of up to `max_len` tokens (see `init_qwen3_cache`)."""
        return init_qwen3_cache(self.cfg, batch, max_len, self.dtype)

    # Same attributes (embed_tokens, lm_head) as Qwen3_5Model, so the same code:
    # embed: tokens [B, T] -> [B, T, H]; logits: post-norm hidden [..., H] -> float32 [..., V].
    embed = Qwen3_5Model.embed
    logits = Qwen3_5Model.logits

    def __call__(self, tokens: jax.Array, batch: Batch, cache: KVCache, *, kv_len: int, rollback=None):
        """Run T new tokens per row through the stack, continuing from `cache`.

        tokens: [B, T] int32; batch: where they go (see `Batch`); cache: from `init_qwen3_cache`;
        kv_len: static number of cache slots attention reads (the prompt bucket for prefill, the
        cache length after). rollback: accepted for Qwen3_5Model's verify-pass convention and
        ignored, since attention needs none: a row's length decides which slots are read.
        Returns a `ForwardOut` (hidden [B, T, H], cache; no taps, no pending).
        """
        x = self.embed(tokens)
        if self.unstacked is not None:
            for g, block in enumerate(self.unstacked):
                with jax.named_scope(FULL):
                    x, cache = block(x, batch, cache, g, kv_len)
        else:
            gdef, stacked = nnx.split(self.layers)

            def layer(carry, xs):
                x, cache = carry
                g, params = xs
                (block,) = nnx.merge(gdef, params)
                with jax.named_scope(FULL):
                    x, cache = block(x, batch, cache, g, kv_len)
                return (x, cache), None

            layers = (jnp.arange(self.cfg.num_hidden_layers), stacked)
            (x, cache), _ = scan_layers(layer, (x, cache), layers)
        return ForwardOut(self.norm(x), cache)

    def commit(self, cache: KVCache, pending, n_used: jax.Array) -> KVCache:
        """After a verify pass: the cache already holds all T tokens and rows' lengths decide
        what is read, so there is nothing to commit. Returns `cache` unchanged."""
        del pending, n_used
        return cache
