"""draft_model: a separate, smaller model drafts k tokens autoregressively (vLLM's "draft_model").

The draft keeps its own caches, committed to the same prefix as the target's. Drafting runs on
a scratch copy of them; after verification the draft re-reads [newest, d1..d_n_acc] in one pass
from its committed caches, so its GDN state (if it is a Qwen3.5 model) and KV end exactly at the
accepted prefix — the same masking that makes ragged prefill exact, no checkpoints needed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.layers import Batch


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
    """cache: the draft's caches holding the committed prefix minus the newest token;
    newest [B]: the token each row fed first in the last proposal."""

    cache: tuple
    newest: jax.Array


@dataclasses.dataclass(frozen=True)
class DraftModelProposer:
    """k drafts per step; cache_len: the draft's cache slots (the engine's cache length)."""

    k: int
    cache_len: int

    def init_state(self, model, draft, tokens, lengths, target, choose, reference=None) -> DraftState:
        B, T = tokens.shape[0], target.hidden.shape[1]  # the prompt bucket
        cache = draft.init_cache(B, self.cache_len)
        cache = draft(tokens[:, :T], Batch(jnp.zeros_like(lengths), lengths - 1), cache, kv_len=T).cache
        return DraftState(cache, tokens[jnp.arange(B), lengths - 1])

    def propose(self, model, draft, state: DraftState, tokens, lengths, choose):
        L = self.cache_len
        newest = tokens[jnp.arange(tokens.shape[0]), lengths - 1]
        cache, token, drafts, qs = state.cache, newest, [], []
        ones = jnp.ones_like(lengths)
        for j in range(self.k):
            out = draft(token[:, None], Batch(lengths - 1 + j, ones), cache, kv_len=L)
            token, q = choose(draft.logits(out.hidden[:, 0]), lengths + j)
            cache = out.cache
            drafts.append(token)
            qs.append(q)
        q = None if qs[0] is None else jnp.stack(qs, axis=1)
        return jnp.stack(drafts, axis=1), jnp.full_like(lengths, self.k), q, DraftState(state.cache, newest)

    def update(self, model, draft, state: DraftState, target, emitted, n_acc, lengths, choose) -> DraftState:
        inputs = jnp.concatenate([state.newest[:, None], emitted[:, :-1]], axis=1)  # newest, accepted drafts
        cache = draft(inputs, Batch(lengths - 1, n_acc + 1), state.cache, kv_len=self.cache_len).cache
        return DraftState(cache, state.newest)
