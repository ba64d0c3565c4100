"""DFlash2 drafting: the DFlash block pass (with the drafter's convolutions), then its candidate
selector walks the block left to right: position j re-ranks the top-k of its logits by the token
chosen at j - 1 and picks one, in a `lax.scan` inside the jitted step. `choose` sees the
candidates' scores at their token ids (-inf elsewhere), so a greedy row takes the best path's
next step and a sampled row draws from the scores, its q the distribution over the candidates
(z-lab's `CandidateSelector.select` and its rejection sampling over the candidate ids).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.layers import KVCache
from proposers.dflash import DFlashProposer


@dataclasses.dataclass(frozen=True)
class DFlash2Proposer(DFlashProposer):
    def propose(self, model, draft, cache: tuple[KVCache, ...], tokens, lengths, choose):
        B = tokens.shape[0]
        newest = tokens[jnp.arange(B), lengths - 1]
        block = jnp.concatenate([newest[:, None], jnp.full((B, self.k), self.mask_token_id, jnp.int32)], axis=1)
        positions = lengths[:, None] - 1 + jnp.arange(self.k + 1)[None, :]
        n = self.n_drafts
        h = draft.block(model.embed(block) * self.input_embedding_scale, positions, cache, lengths - 1)[:, 1 : 1 + n]
        selector = draft.candidate_selector
        unary, cand = selector.candidates(self.draft_logits(model, draft, h))  # [B, k, top_k]
        projected = selector.hidden_projection(h)
        rows = jnp.arange(B)[:, None]

        def position(prev, xs):
            j, hp, u, c = xs
            scores = selector.scores(prev, hp, u, c)
            full = jnp.full((B, model.cfg.vocab_size), -jnp.inf, jnp.float32).at[rows, c].set(scores)
            token, q = choose(full, lengths + j)
            return token, (token, q)

        xs = (jnp.arange(n), *(jnp.moveaxis(a, 1, 0) for a in (projected, unary, cand)))
        _, (drafts, q) = jax.lax.scan(position, newest, xs)
        q = None if q is None else jnp.moveaxis(q, 0, 1)
        return jnp.moveaxis(drafts, 0, 1), jnp.full_like(lengths, n), q, cache
