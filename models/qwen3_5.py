"""Qwen3.5 / Qwen3.6 (and Qwen3-Next) GDN-hybrid language model in Flax NNX, dense and MoE.

Layers alternate Gated DeltaNet (linear attention) and gated full attention in a repeating
pattern (three GDN layers, then one attention layer, for every released size). As loaded, the
pattern's layers are stacked over its repeats and run under one `lax.scan` (`scan_layers`), so
compile time does not grow with depth. The engine's GPU layout (`Qwen3_5Model.use_decode_layout`)
gives every layer's weights arrays of their own, runs the layers unrolled and joins projections
that read the same input: a decode step then reads each weight in place, in few long passes.

The model is pure over explicit caches: `Qwen3_5Model.__call__` takes the caches and returns
new ones (see `ModelCache`). Checkpoint name mapping lives in `spec_jax/loading/source.py`; module
attribute names mirror the HF tensor names so that mapping stays thin. Linear weights keep the
checkpoint's [out, in] layout.

Shapes: B batch rows, T new tokens, L cache length, H hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.gated_deltanet import GatedDeltaNet, GDNCache, commit_gdn
from models.moe import SparseMoE
from models.layers import (MLP, Attention, Batch, KVCache, Linear, check_head_groups, dot_transposed, expect_json,
                           fuse_linears, scan_layers, tiled_projection, unstack_layers,
                           zeros_param)
from pallas_kernels.rms_norm import add_rms_norm, rms_norm
from pallas_kernels.tensor_parallel import constrain, on_axis

LINEAR, FULL = "linear_attention", "full_attention"
# What the GDN recurrent state may be stored in: each pass computes in float32 and rounds the
# state it carries to this dtype after every token, as storing it would.
STATE_DTYPES = ("float32", "bfloat16", "float16")


def check_state_dtype(name: str, value, also: tuple[str, ...] = ()) -> None:
    """ValueError naming `name` unless value is one of `also` or `STATE_DTYPES`."""
    if value not in (*also, *STATE_DTYPES):
        raise ValueError(f"{name}={value!r}; expected one of {', '.join((*also, *STATE_DTYPES))}")
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Qwen3_5Config:
    """The text model's config; field names are the checkpoint's `config.json` keys."""

    model_type: str = "qwen3_5_text"
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    mtp_num_hidden_layers: int = 0
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    mamba_ssm_dtype: str = "float32"  # the GDN recurrent state's dtype in the cache (math stays float32)

    def __post_init__(self):
        self._check_fields()
        check_state_dtype("mamba_ssm_dtype", self.mamba_ssm_dtype)
        if not self.layer_types:
            n = self.full_attention_interval
            kinds = tuple(FULL if (i + 1) % n == 0 else LINEAR for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", kinds)
        bad = [t for t in self.layer_types if t not in (LINEAR, FULL)]
        if bad:
            raise ValueError(f"layer_types has unknown kind {bad[0]!r}; expected {LINEAR!r} or {FULL!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types lists {len(self.layer_types)} layers but num_hidden_layers is {self.num_hidden_layers}"
            )
        if self.num_hidden_layers % len(self.pattern):
            raise ValueError(f"layer_types {self.layer_types} is not a whole number of repeats of one pattern")
        check_head_groups(self, "linear_num_value_heads", "linear_num_key_heads")
        check_head_groups(self, "num_attention_heads", "num_key_value_heads")

    # Sizes that must be positive integers, and those that may be 0 (no MoE, no MTP head).
    POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "full_attention_interval",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")
    NON_NEGATIVE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
                    "mtp_num_hidden_layers")

    def _check_fields(self) -> None:
        """ValueError naming the key for a wrong type or an impossible value: sizes are integers
        (positive, or >= 0 where 0 means absent) that fit int32, rms_norm_eps and rope_theta are
        finite and positive, partial_rotary_factor is in (0, 1], token ids fit int32."""
        for name in (*self.POSITIVE, *self.NON_NEGATIVE):
            value, low = getattr(self, name), 1 if name in self.POSITIVE else 0
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**31:
                raise ValueError(f"{name}={value!r} must be an integer >= {low} (and below 2**31)")
        for name, ok, rule in (("rms_norm_eps", lambda x: 0 < x < 1, "in (0, 1)"),
                               ("rope_theta", lambda x: x > 0, "> 0"),
                               ("partial_rotary_factor", lambda x: 0 < x <= 1, "in (0, 1]")):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not ok(value)):
                raise ValueError(f"{name}={value!r} must be a number {rule}")
        ids = [*self.eos_token_id, *([] if self.bos_token_id is None else [self.bos_token_id])]
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31 for t in ids):
            raise ValueError(f"eos_token_id / bos_token_id {ids} must be token ids (integers in [0, 2**31))")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:  # RoPE turns the rotated dims in pairs
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} rotates int(head_dim "
                             f"{self.head_dim} x {self.partial_rotary_factor}) = {self.rotary_dim} dims of each head; "
                             f"that must be an even number >= 2")

    @property
    def pattern(self) -> tuple[str, ...]:
        """The shortest layer-kind pattern whose repeats make up `layer_types`."""
        n = len(self.layer_types)
        for p in range(1, n + 1):
            if n % p == 0 and self.layer_types == self.layer_types[:p] * (n // p):
                return self.layer_types[:p]
        return self.layer_types

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // len(self.pattern)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "Qwen3_5Config":
        """Build from a checkpoint's `config.json` dict: VL-wrapped (`text_config`) or flat.

        Raises ValueError naming the `model_type` when it is not a Qwen3.5/3.6/Next model.
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; spec_jax runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text = dict(expect_json("text_config", config.get("text_config"), dict) or config)
        text.setdefault("model_type", model_type)
        if "text_config" in config and "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]  # VL wrappers tie by the top-level flag
        for key, kind in (("rope_parameters", dict), ("rope_scaling", dict), ("layer_types", list),
                          ("mlp_only_layers", list), ("tie_word_embeddings", bool), ("norm_topk_prob", bool)):
            expect_json(key, text.get(key), kind)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in rope:
                text[key] = rope[key]
        if rope.get("rope_type", "default") not in ("default", "mrope"):
            raise ValueError(f"unsupported rope_type {rope['rope_type']!r}; only 'default' RoPE is implemented")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {text['hidden_act']!r}; only 'silu' (SwiGLU) is implemented")
        if text.get("output_gate_type", "silu") not in ("silu", "swish"):
            # The Gated DeltaNet output norm's gate: Qwen3.5/3.6 configs leave it out (silu), Qwen3.8's say
            # "swish", the same function (vLLM reads the key; transformers hard-codes silu).
            raise ValueError(f"output_gate_type {text['output_gate_type']!r} is not supported: the Gated DeltaNet "
                             f"norm's gate runs silu ('silu' or 'swish')")
        if text.get("attn_output_gate", True) is not True:
            raise ValueError(f"attn_output_gate={text['attn_output_gate']!r} is not supported: Qwen3.5's full "
                             f"attention is gated")
        if text.get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers {text['mlp_only_layers']} is not supported (every layer must be MoE)")
        eos = text.get("eos_token_id", config.get("eos_token_id"))
        text["eos_token_id"] = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        if text.get("layer_types") is not None:
            text["layer_types"] = tuple(text["layer_types"])
        if text.get("head_dim") is None:
            hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
            ok = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (hidden, heads))
            text["head_dim"] = hidden // heads if ok else None  # else the field check names what is wrong
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in text.items() if k in names and v is not None})


# ----------------------------------------------------------------------------- caches


ModelCache = tuple  # one KVCache or GDNCache per pattern position, stacked over the G repeats

ROLLBACKS = ("checkpoint", "replay")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOut:
    """What a target forward pass returns (`Qwen3_5Model`, and `Qwen3Model` as a draft model).

    hidden: [B, T, H] post-norm hidden states (`logits` turns them into the vocabulary).
    cache: the caches after the pass (after a verify pass: attention written, GDN unchanged
      until `commit`).
    taps: [B, T, n*H] the outputs of the requested decoder layers (HF `hidden_states[id + 1]`),
      concatenated in the order asked; None when none were asked for. Drafters read them.
    pending: what a verify pass keeps for `commit` (per layer: `GDNPending`, None for attention);
      None outside a verify pass.
    """

    hidden: jax.Array
    cache: Any
    taps: jax.Array | None = None
    pending: Any = None


def init_cache(cfg: Qwen3_5Config, batch: int, max_len: int, dtype, state_dtype: str | None = None) -> ModelCache:
    """Empty caches for `batch` rows of up to `max_len` tokens, the GDN state in state_dtype (None:
    the config's `mamba_ssm_dtype`); under a tensor-parallel mesh split by head (KV heads, conv
    channels, GDN value heads) as the weights that fill them are."""
    G = cfg.num_groups
    out = []
    for kind in cfg.pattern:
        if kind == FULL:
            out.append(kv_cache((G, batch, max_len, cfg.num_key_value_heads, cfg.head_dim), dtype))
        else:
            conv = jnp.zeros((G, batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype)
            state_shape = (G, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
            state = jnp.zeros(state_shape, state_dtype or cfg.mamba_ssm_dtype)
            out.append(GDNCache(constrain(conv, on_axis(4, 3)), constrain(state, on_axis(5, 2))))
    return tuple(out)


def kv_cache(shape: tuple[int, ...], dtype) -> KVCache:
    """Zero keys and values [G, B, L, kv_heads, head_dim], split by KV head under tensor parallelism."""
    return KVCache(*(constrain(jnp.zeros(shape, dtype), on_axis(5, 3)) for _ in range(2)))


# ----------------------------------------------------------------------------- layers


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in float32.
    residual_stream (static): a norm of the residual stream, which XLA fuses with no neighbour; at
    decode sizes it runs as one kernel (`rms_norm`'s few_rows), and its add can join it."""

    def __init__(self, dim: int, eps: float, *, stack=(), residual_stream: bool = False):
        self.weight = zeros_param((*stack, dim), jnp.float32)
        self.eps = eps
        self.residual_stream = residual_stream

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(self.apply, x, self.scale(), self.eps, few_rows=self.residual_stream)

    def add_and_norm(self, x: jax.Array, added: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The residual stream's add and this norm after it: (x + added, its norm)."""
        return add_rms_norm(self.apply, x, added, self.scale(), self.eps)

    def scale(self) -> jax.Array:
        return 1.0 + self.weight[...].astype(jnp.float32)

    def apply(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + mixer(norm(x)), then + ffn(norm(x))."""

    def __init__(self, cfg: Qwen3_5Config, kind: str, *, stack=(), dtype=jnp.float32):
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack, residual_stream=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, stack=stack, residual_stream=True)
        if kind == FULL:  # full attention with a per-head output gate, (1 + w) q/k norms, partial RoPE
            H = cfg.hidden_size
            self.self_attn = Attention(H, H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                       rope_theta=cfg.rope_theta, rotary_dim=cfg.rotary_dim, qk_norm=RMSNorm,
                                       eps=cfg.rms_norm_eps, output_gate=True, stack=stack, dtype=dtype)
        else:
            self.linear_attn = GatedDeltaNet(cfg, stack=stack, dtype=dtype)
        if cfg.is_moe:
            self.mlp = SparseMoE(cfg, stack=stack, dtype=dtype)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, stack=stack, dtype=dtype)

    def fuse_projections(self) -> None:
        """Join each sub-block's same-input projections into one matmul (`fuse_linears`)."""
        mixer = self.self_attn if self.kind == FULL else self.linear_attn
        fuse_linears(mixer, mixer.PROJECTIONS)
        if isinstance(self.mlp, SparseMoE):
            self.mlp.join_router_and_shared_expert()
        else:
            fuse_linears(self.mlp, self.mlp.PROJECTIONS)

    def __call__(self, x, batch: Batch, cache, g, kv_len: int, rollback=None):
        """Returns (x, cache, pending): pending is the GDN's per-token state a verify pass keeps
        for rollback, None for attention, which needs none (a row's length decides what is read)."""
        normed = self.input_layernorm(x)
        if self.kind == FULL:
            (h, cache), pending = self.self_attn(normed, batch, cache, g, kv_len), None
        else:
            h, cache, pending = self.linear_attn(normed, batch, cache, g, kv_len, rollback)
        x, normed = self.post_attention_layernorm.add_and_norm(x, h)
        return x + self.mlp(normed), cache, pending


# ----------------------------------------------------------------------------- model


class MTPHead(nnx.Module):
    """Multi-token prediction head: predicts token p+2 from the target's hidden state at p and
    the embedding of token p+1, through one full-attention block with its own KV cache."""

    def __init__(self, cfg: Qwen3_5Config, *, dtype=jnp.float32):
        H = cfg.hidden_size
        self.fc = Linear(2 * H, H, dtype=dtype)
        self.pre_fc_norm_embedding = RMSNorm(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nnx.List([DecoderLayer(cfg, FULL, stack=(1,), dtype=dtype)])  # the checkpoint's mtp.layers.0
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layer = nnx.data(None)  # the block with its own arrays, after `use_decode_layout`

    def use_decode_layout(self, fuse: bool = True) -> None:
        """The block's weights as arrays of their own, projections joined unless not `fuse` (see
        `Qwen3_5Model.use_decode_layout`)."""
        if self.layer is None:
            self.layer = unstack_layers(self, "layers")[0][0]
            if fuse:
                self.layer.fuse_projections()

    def __call__(self, embedded_next, hidden, batch: Batch, cache: KVCache, kv_len: int):
        """embedded_next: [B, T, H] embeddings of tokens p+1; hidden: [B, T, H] the target's
        post-norm hidden at p; cache: [1, B, L, kv, d]. Returns the post-norm MTP hidden
        [B, T, H] (feed it to the shared lm_head) and the cache."""
        x = jnp.concatenate([self.pre_fc_norm_embedding(embedded_next), self.pre_fc_norm_hidden(hidden)], axis=-1)
        layer = self.layer
        if layer is None:
            gdef, params = nnx.split(self.layers[0])
            layer = nnx.merge(gdef, jax.tree.map(lambda a: a[0], params))
        x, cache, _ = layer(self.fc(x), batch, cache, 0, kv_len)
        return self.norm(x), cache


def init_mtp_cache(cfg: Qwen3_5Config, batch: int, max_len: int, dtype) -> KVCache:
    return kv_cache((1, batch, max_len, cfg.num_key_value_heads, cfg.head_dim), dtype)


class Qwen3_5Model(nnx.Module):
    """Embedding, the stacked decoder pattern, final norm, lm_head, and the MTP head if any."""

    def __init__(self, cfg: Qwen3_5Config, *, dtype=jnp.float32):
        self.cfg = cfg
        self.dtype = dtype
        G = (cfg.num_groups,)
        self.embed_tokens = zeros_param((cfg.vocab_size, cfg.hidden_size), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, kind, stack=G, dtype=dtype) for kind in cfg.pattern])
        self.groups = nnx.data(None)  # G lists of the pattern's layers, after `use_decode_layout`
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, residual_stream=True)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        self.mtp = MTPHead(cfg, dtype=dtype) if cfg.mtp_num_hidden_layers else None
        self.shards = 1  # static: tensor-parallel devices (`models/tensor_parallel.py`)
        self.state_dtype = cfg.mamba_ssm_dtype  # static: the GDN state's dtype in the caches it makes

    def use_decode_layout(self, fuse: bool = True) -> None:
        """Switch to the decode layout: every layer's weights (and the MTP block's) become arrays
        of their own and the layers run unrolled, so no step copies a weight out of a stack
        (`unstack_layers`); with `fuse`, projections that read the same input are joined into one
        matmul (`fuse_linears`). Loaders and converters read and write the stacked layout; the
        engine calls this on the GPU. In place; a second call does nothing."""
        if self.groups is None:
            self.groups = unstack_layers(self, "layers")
            for layers in self.groups if fuse else ():
                for layer in layers:
                    layer.fuse_projections()
        if self.mtp is not None:
            self.mtp.use_decode_layout(fuse)

    def use_state_dtype(self, dtype: str) -> None:
        """Keep the GDN recurrent state in `dtype` (one of `STATE_DTYPES`) in the caches this model
        makes from now on (the engine's `mamba_ssm_cache_dtype`); the config keeps the checkpoint's."""
        check_state_dtype("state_dtype", dtype)
        self.state_dtype = dtype

    def init_cache(self, batch: int, max_len: int) -> ModelCache:
        """Empty caches for `batch` rows of up to `max_len` tokens (see `init_cache`), the GDN state
        in `state_dtype`."""
        return init_cache(self.cfg, batch, max_len, self.dtype, self.state_dtype)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> [B, T, H]."""
        return self.embed_tokens[...][tokens]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Post-norm hidden [..., H] -> float32 logits [..., V]."""
        w = self.embed_tokens[...] if self.lm_head is None else self.lm_head.weight[...]
        return tiled_projection(lambda h: dot_transposed(h, w, jnp.float32), hidden)

    def __call__(self, tokens: jax.Array, batch: Batch, cache: ModelCache, *, kv_len: int, rollback=None,
                 taps: tuple[int, ...] = ()):
        """Run T new tokens per row through the stack, continuing from `cache`.

        tokens: [B, T] int32; batch: where they go (see `Batch`); kv_len: static number of
        cache slots attention reads (the prompt bucket for prefill, the cache length after).
        rollback: None advances every cache by n_valid tokens. "checkpoint" or "replay" makes
          this a verify pass: attention K/V are written, GDN caches are left as they were, and
          the pending per-layer data is returned for `commit`.
        taps: static decoder-layer indices whose outputs to return as `ForwardOut.taps`.
        Returns a `ForwardOut`.
        """
        P = len(self.cfg.pattern)

        def group(carry, g, layers):
            x, cache, tapped = carry
            cache, pending = list(cache), []
            for p, layer in enumerate(layers):
                with jax.named_scope(f"{layer.kind}_{p}"):
                    x, cache[p], pend = layer(x, batch, cache[p], g, kv_len, rollback)
                pending.append(pend)
                tapped = tuple(jnp.where(g * P + p == i, x, t) for i, t in zip(taps, tapped))
            return (x, tuple(cache), tapped), tuple(pending)

        x = self.embed(tokens)
        carry = (x, cache, tuple(jnp.zeros_like(x) for _ in taps))
        if self.groups is None:
            gdef, stacked = nnx.split(self.layers)
            body = lambda c, xs: group(c, xs[0], nnx.merge(gdef, xs[1]))  # noqa: E731
            carry, pending = scan_layers(body, carry, (jnp.arange(self.cfg.num_groups), stacked))
        else:
            per_group = []
            for g, layers in enumerate(self.groups):
                carry, pend = group(carry, g, layers)
                per_group.append(pend)
            pending = jax.tree.map(lambda *a: jnp.stack(a), *per_group)  # [G, ...] as the scan stacks it
        x, cache, tapped = carry
        return ForwardOut(self.norm(x), cache, jnp.concatenate(tapped, axis=-1) if taps else None,
                          None if rollback is None else pending)

    def commit(self, cache: ModelCache, pending: tuple, n_used: jax.Array) -> ModelCache:
        """After a verify pass, keep its first n_used [B] tokens (1..T) in every cache.

        Attention caches already hold all T tokens; their rows' lengths decide what is read."""
        K = self.cfg.linear_conv_kernel_dim
        return tuple(c if p is None else commit_gdn(c, p, n_used, K) for c, p in zip(cache, pending))
