"""Oracle drafting, for benchmarks only: it proposes the target's own greedy continuation,
each token replaced by a wrong one with probability `corruption_rate`, so speed can be measured
at a controlled acceptance rate without trained draft weights. Drafting costs nothing, so it
also gives the ceiling a real proposer with that acceptance could reach."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class OracleProposer:
    k: int
    corruption_rate: float
    vocab_size: int
    seed: int = 0

    def init_state(self, model, draft, tokens, lengths, target, choose, reference=None):
        if reference is None:
            raise ValueError("the oracle proposer needs the target's greedy continuation (reference tokens)")
        return reference  # [B, L]: each row's greedy continuation, indexed like the token buffer

    def propose(self, model, draft, reference, tokens, lengths, choose):
        B, L = reference.shape
        idx = jnp.minimum(lengths[:, None] + jnp.arange(self.k)[None, :], L - 1)
        drafts = jnp.take_along_axis(reference, idx, axis=1)
        key = jax.random.fold_in(jax.random.key(self.seed), jnp.sum(lengths))
        u_key, shift_key = jax.random.split(key)
        corrupt = jax.random.uniform(u_key, (B, self.k)) < self.corruption_rate
        shift = jax.random.randint(shift_key, (B, self.k), 1, self.vocab_size)
        drafts = jnp.where(corrupt, (drafts + shift) % self.vocab_size, drafts)
        return drafts, jnp.full_like(lengths, self.k), None, reference

    def update(self, model, draft, reference, target, emitted, n_acc, lengths, choose):
        return reference
