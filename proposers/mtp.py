"""MTP drafting: the target's own multi-token-prediction head, chained for k > 1 (as vLLM does).

Draft row p takes (token p+1, target hidden at p) and predicts token p+2. After each verify
pass the head re-runs over the verified positions with the target's hidden states, which
rewrites its KV cache for the accepted prefix and yields the next step's first draft; the
remaining k-1 drafts chain the head on its own post-norm output.

With a reduced draft vocabulary (`DraftVocabHead`, the config's `draft_vocab_size`) the drafts'
logits come from the first n rows of the lm_head, held as an array of their own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen3_5 import Batch, KVCache, Qwen3_5Model, TargetOut, init_mtp_cache, unroll_layers


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MTPState:
    """cache: the head's KV [1, B, L, kv, d]; draft [B]: the next first draft; hidden [B, H]: the
    head's post-norm output that drafted it; q [B, V] its draft probabilities (or None)."""

    cache: KVCache
    draft: jax.Array
    hidden: jax.Array
    q: jax.Array | None


class DraftVocabHead(nnx.Module):
    """The target's lm_head cut to token ids 0..n-1, copied into an array of its own (a slice of
    the full head would be copied out of it every step inside the decode loop)."""

    def __init__(self, model: Qwen3_5Model, n: int):
        V = model.cfg.vocab_size
        if not 1 <= n <= V:
            raise ValueError(f"draft_vocab_size={n} must be between 1 and the model's vocab_size {V}")
        full = model.embed_tokens[...] if model.lm_head is None else model.lm_head.weight[...]
        self.weight = nnx.Param(full[:n])
        self.vocab_size = V

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """Post-norm hidden [..., H] -> float32 logits [..., V], -inf past the first n ids."""
        w = self.weight[...]
        logits = jnp.einsum("...h,vh->...v", hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)
        pad = [(0, 0)] * (logits.ndim - 1) + [(0, self.vocab_size - w.shape[0])]
        return jnp.pad(logits, pad, constant_values=-jnp.inf)


def draft_logits(model: Qwen3_5Model, head: DraftVocabHead | None, hidden: jax.Array) -> jax.Array:
    """The MTP head's draft logits [..., V] from its post-norm hidden [..., H]."""
    return model.logits(hidden) if head is None else head(hidden)


def pick(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...] at per-row index idx [B] -> [B, ...]."""
    return x[jnp.arange(x.shape[0]), idx]


@dataclasses.dataclass(frozen=True)
class MTPProposer:
    k: int

    def init_state(self, model: Qwen3_5Model, draft, tokens, lengths, target: TargetOut, choose,
                   reference=None) -> MTPState:
        hidden = target.hidden
        B, T, _ = hidden.shape
        n = lengths - 1  # prompt lengths; the first sampled token sits at index n
        next_tokens = jnp.pad(tokens, ((0, 0), (0, 1)))[:, 1 : T + 1]
        cache = init_mtp_cache(model.cfg, B, tokens.shape[1], model.dtype)
        h, cache = model.mtp(model.embed(next_tokens), hidden, Batch(jnp.zeros_like(n), n), cache, kv_len=T)
        last = pick(h, n - 1)
        first, q = choose(draft_logits(model, draft, last), lengths)
        return MTPState(cache, first, last, q)

    def propose(self, model: Qwen3_5Model, draft, state: MTPState, tokens, lengths, choose):
        L = state.cache.k.shape[2]
        ones = jnp.ones_like(lengths)

        def chain(carry, j):  # draft j from draft j - 1 and the head's own hidden state
            previous, h, cache = carry
            x, cache = model.mtp(model.embed(previous[:, None]), h[:, None], Batch(lengths - 2 + j, ones), cache,
                                 kv_len=L)
            d, q = choose(draft_logits(model, draft, x[:, 0]), lengths + j)
            return (d, x[:, 0], cache), (d, q)

        # A scan traces the head once for any k; unrolled where the layers are (the GPU).
        (_, _, cache), (ds, qs) = jax.lax.scan(chain, (state.draft, state.hidden, state.cache),
                                               jnp.arange(1, self.k), unroll=unroll_layers())
        drafts = jnp.concatenate([state.draft[:, None], ds.T], axis=1)
        q = None if state.q is None else jnp.concatenate([state.q[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
        n_draft = jnp.full_like(lengths, self.k)
        return drafts, n_draft, q, dataclasses.replace(state, cache=cache)

    def update(self, model: Qwen3_5Model, draft, state: MTPState, target: TargetOut, emitted, n_acc, lengths,
               choose) -> MTPState:
        L = state.cache.k.shape[2]
        batch = Batch(lengths - 1, n_acc + 1)
        x, cache = model.mtp(model.embed(emitted), target.hidden, batch, state.cache, kv_len=L)
        last = pick(x, n_acc)
        first, q = choose(draft_logits(model, draft, last), lengths + n_acc + 1)
        return MTPState(cache, first, last, q)
