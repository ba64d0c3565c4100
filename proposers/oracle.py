"""Oracle drafting, for benchmarks only: it proposes the target's own continuation, each token
replaced by a wrong one with probability `corruption_rate`, so speed can be measured at a
controlled acceptance rate without trained draft weights. Drafting costs nothing, so it also gives
the ceiling a real proposer with that acceptance could reach.

The continuation is data, not computed here: `init_state` makes room for it ([B, L], the token
buffer's shape) and the engine fills it after prefill (`with_continuation`) with a plain run of
the target on the same prompts."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class OracleProposer:
    k: int
    corruption_rate: float
    vocab_size: int
    seed: int = 0

    def init_state(self, model, draft, tokens, lengths, target, choose):
        return jnp.zeros_like(tokens)  # [B, L]: each row's continuation, indexed like the token buffer

    @staticmethod
    def with_continuation(state, continuation):
        return continuation

    def propose(self, model, draft, continuation, tokens, lengths, choose):
        B, L = continuation.shape
        idx = jnp.minimum(lengths[:, None] + jnp.arange(self.k)[None, :], L - 1)
        drafts = jnp.take_along_axis(continuation, idx, axis=1)
        key = jax.random.fold_in(jax.random.key(self.seed), jnp.sum(lengths))
        u_key, shift_key = jax.random.split(key)
        corrupt = jax.random.uniform(u_key, (B, self.k)) < self.corruption_rate
        shift = jax.random.randint(shift_key, (B, self.k), 1, self.vocab_size)
        drafts = jnp.where(corrupt, (drafts + shift) % self.vocab_size, drafts)
        return drafts, jnp.full_like(lengths, self.k), None, continuation

    def update(self, model, draft, continuation, target, emitted, n_acc, lengths, choose):
        return continuation


@dataclasses.dataclass(frozen=True)
class OracleTokens:
    """Benchmarks only: a real proposer (`inner`) runs every step (its whole cost, its own state
    kept in step with what the target emits) but the oracle's tokens are verified in its place, so
    a drafter's speed can be measured at a chosen acceptance before it is trained. The state is
    (the inner proposer's state, the oracle's continuation)."""

    inner: Any
    oracle: OracleProposer

    @property
    def k(self) -> int:
        return self.inner.k

    @property
    def taps(self) -> tuple[int, ...]:
        return getattr(self.inner, "taps", ())

    @property
    def may_not_draft(self) -> bool:
        return getattr(self.inner, "may_not_draft", False)

    @property
    def must_propose(self) -> bool:
        return getattr(self.inner, "must_propose", False)

    def init_state(self, model, draft, tokens, lengths, target, choose):
        return (self.inner.init_state(model, draft, tokens, lengths, target, choose),
                self.oracle.init_state(model, draft, tokens, lengths, target, choose))

    @staticmethod
    def with_continuation(state, continuation):
        return state[0], continuation

    def propose(self, model, draft, state, tokens, lengths, choose):
        inner_state, continuation = state
        own, n_draft, _, inner_state = self.inner.propose(model, draft, inner_state, tokens, lengths, choose)
        drafts, _, _, continuation = self.oracle.propose(model, draft, continuation, tokens, lengths, choose)
        # Token ids are never negative, but XLA cannot prove it, so the drafter's work stays live.
        drafts = jnp.where(own < 0, own, drafts)
        return drafts, n_draft, None, (inner_state, continuation)

    def update(self, model, draft, state, target, emitted, n_acc, lengths, choose):
        inner_state, continuation = state
        return self.inner.update(model, draft, inner_state, target, emitted, n_acc, lengths, choose), continuation
