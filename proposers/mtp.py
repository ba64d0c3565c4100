"""MTP drafting: the target's own multi-token-prediction head, chained for k > 1 (as vLLM does).

Draft row p takes (token p+1, target hidden at p) and predicts token p+2. After each verify
pass the head re-runs over the verified positions with the target's hidden states, which
rewrites its KV cache for the accepted prefix and yields the next step's first draft; the
remaining k-1 drafts chain the head on its own post-norm output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.qwen3_5 import Batch, KVCache, Qwen3_5Model, TargetOut, init_mtp_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MTPState:
    """cache: the head's KV [1, B, L, kv, d]; draft [B]: the next first draft; hidden [B, H]: the
    head's post-norm output that drafted it; q [B, V] its draft probabilities (or None)."""

    cache: KVCache
    draft: jax.Array
    hidden: jax.Array
    q: jax.Array | None


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
        draft, q = choose(model.logits(last), lengths)
        return MTPState(cache, draft, last, q)

    def propose(self, model: Qwen3_5Model, draft, state: MTPState, tokens, lengths, choose):
        L = state.cache.k.shape[2]
        drafts, qs, h, cache = [state.draft], [state.q], state.hidden, state.cache
        ones = jnp.ones_like(lengths)
        for j in range(1, self.k):
            batch = Batch(lengths - 2 + j, ones)
            x, cache = model.mtp(model.embed(drafts[-1][:, None]), h[:, None], batch, cache, kv_len=L)
            h = x[:, 0]
            d, q = choose(model.logits(h), lengths + j)
            drafts.append(d)
            qs.append(q)
        q = None if state.q is None else jnp.stack(qs, axis=1)
        n_draft = jnp.full_like(lengths, self.k)
        return jnp.stack(drafts, axis=1), n_draft, q, dataclasses.replace(state, cache=cache)

    def update(self, model: Qwen3_5Model, draft, state: MTPState, target: TargetOut, emitted, n_acc, lengths,
               choose) -> MTPState:
        L = state.cache.k.shape[2]
        batch = Batch(lengths - 1, n_acc + 1)
        x, cache = model.mtp(model.embed(emitted), target.hidden, batch, state.cache, kv_len=L)
        last = pick(x, n_acc)
        draft, q = choose(model.logits(last), lengths + n_acc + 1)
        return MTPState(cache, draft, last, q)
