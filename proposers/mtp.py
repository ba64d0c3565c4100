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
        ones = jnp.ones_like(lengths)

        def chain(carry, j):  # draft j from draft j - 1 and the head's own hidden state
            previous, h, cache = carry
            x, cache = model.mtp(model.embed(previous[:, None]), h[:, None], Batch(lengths - 2 + j, ones), cache,
                                 kv_len=L)
            d, q = choose(model.logits(x[:, 0]), lengths + j)
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
        draft, q = choose(model.logits(last), lengths + n_acc + 1)
        return MTPState(cache, draft, last, q)
