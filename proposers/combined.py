"""Suffix decoding combined with a model drafter (MTP, EAGLE-3, DFlash, DSpark, a draft model),
chosen per row per step, as ArcticInference's hybrid does: a row takes the suffix draft where its
score (the sum of its tokens' estimated probabilities: the tokens it expects accepted) is at
least the model drafter's k, the most the model can give; else the model's draft. Both run every
step (the model drafter's state follows every accepted token, whoever drafted it), so the suffix
side costs its lookup only.

    {"method": "mtp", "num_speculative_tokens": 3, "enable_suffix_decoding": true}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from proposers.suffix import SuffixProposer, suffix_drafts


@dataclasses.dataclass(frozen=True)
class CombinedProposer:
    """k = max(model.k, suffix.k) drafts a step at most: the model's k, or the suffix's. The state
    is (the model drafter's state, the suffix's `OutputCache` or None)."""

    model: Any
    suffix: SuffixProposer

    @property
    def k(self) -> int:
        return max(self.model.k, self.suffix.k)

    @property
    def taps(self) -> tuple[int, ...]:
        return getattr(self.model, "taps", ())

    @property
    def must_propose(self) -> bool:
        return getattr(self.model, "must_propose", False)

    def init_state(self, model, draft, tokens, lengths, target, choose):
        return (self.model.init_state(model, draft, tokens, lengths, target, choose),
                self.suffix.init_state(model, draft, tokens, lengths, target, choose))

    def propose(self, model, draft, state, tokens, lengths, choose):
        inner, cache = state
        m_drafts, m_n, m_q, inner = self.model.propose(model, draft, inner, tokens, lengths, choose)
        s = self.suffix
        s_drafts, s_n, score = suffix_drafts(tokens, lengths, cache, k=s.k, depth=s.max_tree_depth,
                                             spec_factor=s.max_spec_factor, min_prob=s.min_token_prob,
                                             max_requests=s.max_cached_requests)
        use = (score >= self.model.k) & (s_n > 0)  # [B]
        k = self.k
        m_drafts = jnp.pad(m_drafts, ((0, 0), (0, k - m_drafts.shape[1])))
        s_drafts = jnp.pad(s_drafts, ((0, 0), (0, k - s_drafts.shape[1])))
        drafts = jnp.where(use[:, None], s_drafts, m_drafts)
        q = None
        if m_q is not None:  # a suffix draft is certain: one-hot, as the verifier reads a missing q
            m_q = jnp.pad(m_q, ((0, 0), (0, k - m_q.shape[1]), (0, 0)))
            q = jnp.where(use[:, None, None], jax.nn.one_hot(s_drafts, m_q.shape[-1], dtype=m_q.dtype), m_q)
        return drafts, jnp.where(use, s_n, m_n), q, (inner, cache)

    def update(self, model, draft, state, target, emitted, n_acc, lengths, choose):
        inner, cache = state
        return self.model.update(model, draft, inner, target, emitted, n_acc, lengths, choose), cache

    def retire(self, state, tokens, prompt_lengths, lengths, finished):
        inner, cache = state
        return inner, self.suffix.retire(cache, tokens, prompt_lengths, lengths, finished)
