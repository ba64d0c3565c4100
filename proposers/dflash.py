"""DFlash drafting: one non-autoregressive pass of the block [newest, MASK x k] over the
context of every committed position's target-layer features (z-lab's block diffusion drafter).

The context K/V lives in the drafter's own cache, one slot per position (position mod the window
for a sliding layer, whose cache is the window long). After each verify pass the accepted
positions' features (the target's taps) are written to their slots; a row's length decides
which slots are read, so rollback is the length, as for attention.

A drafter with a reduced vocabulary scores its own ids; `choose` always sees target-vocabulary
logits (`DFlashDraft.to_target_vocab`), so drafts are target ids and a sampled draft's q covers
the target vocabulary, as the rejection sampler needs.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.layers import KVCache
from models.qwen3_5 import ForwardOut


@dataclasses.dataclass(frozen=True)
class DFlashProposer:
    """k = block_size - 1 drafts; taps: the target layers the drafter reads; mask_token_id;
    scales from the drafter's config; scored: how many of the block's drafts (the first) are
    scored and chosen (None: all k)."""

    k: int
    taps: tuple[int, ...]
    mask_token_id: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    scored: int | None = None

    @property
    def n_drafts(self) -> int:
        return self.k if self.scored is None else self.scored

    def with_drafts(self, n: int) -> DFlashProposer:
        """The block stays k + 1 long (its queries attend to each other), so the first n drafts
        are the full block's; only their logits are computed (the vocabulary projection is most
        of a wide batch's drafting)."""
        return dataclasses.replace(self, scored=n)

    def scaled_logits(self, logits):
        """The drafter's output multiplier and soft cap on its draft-vocabulary logits (before the
        scatter to the target vocabulary: the cap would turn its -inf into a finite -cap)."""
        logits = logits * self.output_multiplier
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        return logits

    def draft_logits(self, model, draft, hidden):
        """Post-norm block outputs [B, T, H] -> scaled float32 logits over the draft vocabulary [B, T, Vd]."""
        return self.scaled_logits(draft.draft_vocab_logits(hidden, model.logits))

    def init_state(self, model, draft, tokens, lengths, target: ForwardOut, choose) -> tuple[KVCache, ...]:
        cache = draft.init_cache(tokens.shape[0], tokens.shape[1])
        return draft.write_context(cache, target.taps, jnp.zeros_like(lengths), lengths)

    def propose(self, model, draft, cache: tuple[KVCache, ...], tokens, lengths, choose):
        B = tokens.shape[0]
        newest = tokens[jnp.arange(B), lengths - 1]
        block = jnp.concatenate([newest[:, None], jnp.full((B, self.k), self.mask_token_id, jnp.int32)], axis=1)
        positions = lengths[:, None] - 1 + jnp.arange(self.k + 1)[None, :]
        x = model.embed(block) * self.input_embedding_scale
        h = draft.block(x, positions, cache, lengths - 1)  # the context is every committed position
        n = self.n_drafts
        logits = draft.to_target_vocab(self.draft_logits(model, draft, h[:, 1 : 1 + n]))
        picks = [choose(logits[:, j], lengths + j) for j in range(n)]
        q = None if picks[0][1] is None else jnp.stack([p[1] for p in picks], axis=1)
        return jnp.stack([p[0] for p in picks], axis=1), jnp.full_like(lengths, n), q, cache

    def update(self, model, draft, cache: tuple[KVCache, ...], target: ForwardOut, emitted, n_acc, lengths,
               choose) -> tuple[KVCache, ...]:
        # the verify pass read the newest token and the drafts; the newest and the accepted ones are committed
        return draft.write_context(cache, target.taps, lengths - 1, n_acc + 1)
