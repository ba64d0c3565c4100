"""draft_model: a separate, smaller model drafts k tokens autoregressively (vLLM's "draft_model").

The draft's caches hold the committed prefix up to `fed` [B] (positions 0..fed-1). A step's
first draft pass feeds what the draft has not read of the committed tokens, fed..lengths-1, and
drafts the first token; k - 1 passes after it feed the draft's own drafts.

The cache a step keeps must end inside the accepted prefix:
* an attention-only draft (`rolls_back_by_length`, a plain Qwen3) keeps the cache it drafted
  with: its KV is right at every accepted position and attention reads a row only up to its
  length. It then has at most newest-but-one unread: its first pass reads 2 tokens.
* a draft with GDN layers cannot drop state that way: it keeps the cache after its first pass,
  which read only committed tokens, and its next first pass reads the accepted drafts and the
  target's token (up to k + 1 tokens; the same masking that makes ragged prefill exact).
Either way the draft runs k passes a step and no pass of its own after verification.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.layers import Batch


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftState:
    """cache: the draft's caches, right at positions < fed [B] (the rest is masked or rewritten)."""

    cache: tuple
    fed: jax.Array


def rolls_back_by_length(draft) -> bool:
    return getattr(draft, "rolls_back_by_length", False)


@dataclasses.dataclass(frozen=True)
class DraftModelProposer:
    """k drafts per step; cache_len: the draft's cache slots (the engine's cache length)."""

    k: int
    cache_len: int
    must_propose = True  # the first draft pass reads the committed tokens into the draft's caches

    def init_state(self, model, draft, tokens, lengths, target, choose) -> DraftState:
        T = target.hidden.shape[1]  # the prompt bucket
        cache = draft.init_cache(tokens.shape[0], self.cache_len)
        cache = draft(tokens[:, :T], Batch(jnp.zeros_like(lengths), lengths - 1), cache, kv_len=T).cache
        return DraftState(cache, lengths - 1)

    def propose(self, model, draft, state: DraftState, tokens, lengths, choose):
        """tokens [B, L], lengths [B] -> drafts [B, k], n_draft [B], q [B, k, V] or None, state."""
        L, B = self.cache_len, tokens.shape[0]
        width = 2 if rolls_back_by_length(draft) else self.k + 1  # the most unread tokens a row can have
        fed = jnp.clip(state.fed, lengths - width, lengths - 1)  # a stopped row may have kept fewer tokens
        unread = jnp.take_along_axis(tokens, jnp.minimum(fed[:, None] + jnp.arange(width)[None, :], L - 1), axis=1)
        out = draft(unread, Batch(fed, lengths - fed), state.cache, kv_len=L)
        token, q = choose(draft.logits(out.hidden[jnp.arange(B), lengths - fed - 1]), lengths)
        committed, cache, drafts, qs = out.cache, out.cache, [token], [q]
        ones = jnp.ones_like(lengths)
        for j in range(1, self.k):
            out = draft(token[:, None], Batch(lengths - 1 + j, ones), cache, kv_len=L)
            token, q = choose(draft.logits(out.hidden[:, 0]), lengths + j)
            cache = out.cache
            drafts.append(token)
            qs.append(q)
        q = None if qs[0] is None else jnp.stack(qs, axis=1)
        kept = DraftState(cache, fed) if rolls_back_by_length(draft) else DraftState(committed, lengths)
        return jnp.stack(drafts, axis=1), jnp.full_like(lengths, self.k), q, kept

    def update(self, model, draft, state: DraftState, target, emitted, n_acc, lengths, choose) -> DraftState:
        """n_acc [B] drafts accepted; lengths [B] before the step. An attention-only draft read
        newest and d1..d_{k-1} while drafting: every accepted one of them stays."""
        if rolls_back_by_length(draft):
            return DraftState(state.cache, lengths + jnp.minimum(n_acc, self.k - 1))
        return state
