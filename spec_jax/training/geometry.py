"""The four models' geometries (full size for the H200, tiny for CPU tests) and their
initial weights.

Full size, bf16: target 13.4M parameters (26.9 MB, MTP head included), DFlash drafter 3.0M
(6.0 MB; it shares the target's embedding and lm_head), EAGLE-3 head 2.3M (4.6 MB; the target's
embedding, its own lm_head over 2048 draft ids), draft model 1.4M (2.9 MB): 40.7 MB (38.8 MiB)
with the tokenizer, inside the 40 MiB the repo ships. Training time, not bytes, bounds the
target: at about 75M tokens in the minutes the H200 gives it, a larger model would learn less.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.dflash import DFlashConfig
from models.eagle3 import Eagle3Config
from models.layers import Linear, PlainRMSNorm
from models.qwen3 import Qwen3Config
from models.gated_deltanet import GatedDeltaNet, GatedRMSNorm
from models.qwen3_5 import Qwen3_5Config, RMSNorm

INIT_STD = 0.02
OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "down_proj")  # residual-stream writers, scaled down with depth


def target_config(vocab_size: int, eos_id: int, *, tiny: bool = False) -> Qwen3_5Config:
    """8 layers, GDN and attention 3:1, one MTP layer, tied embeddings (as the small Qwen3.5 are)."""
    if tiny:
        dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16)
    else:
        dims = dict(hidden_size=384, intermediate_size=576, num_attention_heads=6, num_key_value_heads=2,
                    head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
                    linear_value_head_dim=64)
    return Qwen3_5Config(vocab_size=vocab_size, num_hidden_layers=8, rope_theta=1e6, max_position_embeddings=2048,
                         tie_word_embeddings=True, mtp_num_hidden_layers=1, eos_token_id=(eos_id,), **dims)


def dflash_config(target: Qwen3_5Config, mask_token_id: int, *, tiny: bool = False) -> DFlashConfig:
    """Two layers of the target's width reading three target layers; blocks of 8 (7 drafts)."""
    L = target.num_hidden_layers
    heads = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32) if tiny else \
        dict(num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    return DFlashConfig(hidden_size=target.hidden_size, intermediate_size=2 * target.hidden_size,
                        num_hidden_layers=2, target_layer_ids=(1, L // 2, L - 2), mask_token_id=mask_token_id,
                        block_size=8, vocab_size=target.vocab_size, **heads)


def eagle3_config(target: Qwen3_5Config, draft_vocab_size: int, *, tiny: bool = False) -> Eagle3Config:
    """One midlayer of the target's width (it shares the target's embedding) reading the same
    three target layers as the DFlash drafter, with an lm_head over `draft_vocab_size` ids."""
    L = target.num_hidden_layers
    dims = dict(intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32) if tiny else \
        dict(intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return Eagle3Config(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                        draft_vocab_size=min(draft_vocab_size, target.vocab_size), target_layer_ids=(1, L // 2, L - 2),
                        target_hidden_size=target.hidden_size, rope_theta=target.rope_theta, **dims)


def draft_config(vocab_size: int, eos_id: int, *, tiny: bool = False) -> Qwen3Config:
    """A two-layer plain Qwen3 with the target's vocabulary, for `draft_model`."""
    dims = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16) \
        if tiny else dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32)
    return Qwen3Config(vocab_size=vocab_size, num_hidden_layers=2, rope_theta=1e6, max_position_embeddings=2048,
                       tie_word_embeddings=True, eos_token_id=(eos_id,), **dims)


def init_weights(model: nnx.Module, seed: int, num_layers: int) -> nnx.Module:
    """Set every parameter of `model` (built with zeros) to its initial value, in place.

    Linear and embedding weights ~ N(0, 0.02), residual writers divided by sqrt(2 * layers);
    zero-centred norms 0, plain norms 1; GDN's A = exp(A_log) ~ U(1, 16), dt = softplus(a + dt_bias)
    log-uniform in [1e-3, 0.1], conv taps ~ U(+-1/sqrt(K)) (the inits of the published models)."""
    rng = np.random.default_rng(seed)
    def normal(v, std):
        return rng.normal(0.0, std, v.shape).astype(np.float32)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear):
            std = INIT_STD / np.sqrt(2 * num_layers) if path[-1] in OUTPUT_PROJECTIONS else INIT_STD
            node.weight.set_value(jnp.asarray(normal(node.weight, std), node.weight.dtype))
        elif isinstance(node, RMSNorm):
            node.weight.set_value(jnp.zeros_like(node.weight[...]))
        elif isinstance(node, (PlainRMSNorm, GatedRMSNorm)):
            node.weight.set_value(jnp.ones_like(node.weight[...]))
        elif isinstance(node, GatedDeltaNet):
            shape, K = node.A_log.shape, node.conv1d.shape[-1]
            node.A_log.set_value(jnp.log(jnp.asarray(rng.uniform(1.0, 16.0, shape), jnp.float32)))
            dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), shape))
            node.dt_bias.set_value(jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32))  # softplus^-1(dt)
            bound = K ** -0.5
            node.conv1d.set_value(jnp.asarray(rng.uniform(-bound, bound, node.conv1d.shape), node.conv1d.dtype))
        elif path and path[-1] == "embed_tokens" and node is not None:  # EAGLE-3 may share the target's
            node.set_value(jnp.asarray(normal(node, INIT_STD), node.dtype))
    return model


def count_params(model: nnx.Module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
