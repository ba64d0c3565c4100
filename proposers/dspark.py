"""DSpark drafting: the DFlash backbone drafts a block in one pass, then a low-rank Markov head
adds a bias that depends on the previous token while the block is sampled left to right.

The sequential stage is a `lax.scan` inside the jitted step — no host round trip per position
(the seed engine's host loop is what made its DSpark slower than plain decoding). With
`sample_from_anchor` the block is [newest, MASK x (k - 1)] and query j predicts the token after
it; otherwise it is DFlash's [newest, MASK x k] with the anchor's output dropped.

With a reduced vocabulary the bias is added in draft space (W2 covers the draft vocabulary) and
the sum scattered to the target's ids before `choose`; the chosen target id is the next
position's previous token (W1 covers the target vocabulary).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.layers import KVCache
from proposers.dflash import DFlashProposer


@dataclasses.dataclass(frozen=True)
class DSparkProposer(DFlashProposer):
    sample_from_anchor: bool = True

    def propose(self, model, draft, cache: tuple[KVCache, ...], tokens, lengths, choose):
        B = tokens.shape[0]
        newest = tokens[jnp.arange(B), lengths - 1]
        queries = self.k if self.sample_from_anchor else self.k + 1
        block = jnp.concatenate([newest[:, None], jnp.full((B, queries - 1), self.mask_token_id, jnp.int32)], axis=1)
        positions = lengths[:, None] - 1 + jnp.arange(queries)[None, :]
        h = draft.block(model.embed(block) * self.input_embedding_scale, positions, cache, lengths - 1)
        n, first = self.n_drafts, 0 if self.sample_from_anchor else 1
        base = self.draft_logits(model, draft, h[:, first : first + n])  # [B, n, Vd]

        def position(prev, xs):
            j, logits = xs
            token, q = choose(draft.to_target_vocab(logits + draft.markov_head(prev)), lengths + j)
            return token, (token, q)

        _, (drafts, q) = jax.lax.scan(position, newest, (jnp.arange(n), jnp.moveaxis(base, 1, 0)))
        q = None if q is None else jnp.moveaxis(q, 0, 1)
        return jnp.moveaxis(drafts, 0, 1), jnp.full_like(lengths, n), q, cache
