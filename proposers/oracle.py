"""Oracle drafting, for benchmarks only: it proposes the target's own greedy continuation,
each token replaced by a wrong one with probability `corruption_rate`, so speed can be measured
at a controlled acceptance rate without trained draft weights. Drafting costs nothing, so it
also gives the ceiling a real proposer with that acceptance could reach."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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


@dataclasses.dataclass(frozen=True)
class InnerProposer:
    """A benchmark wrapper around a real proposer, which keeps drafting and updating at its full
    cost: the state is (the inner proposer's state, the wrapper's own data)."""

    inner: Any

    @property
    def k(self) -> int:
        return self.inner.k

    @property
    def taps(self) -> tuple[int, ...]:
        return getattr(self.inner, "taps", ())

    @property
    def may_not_draft(self) -> bool:
        return getattr(self.inner, "may_not_draft", False)

    def update(self, model, draft, state, target, emitted, n_acc, lengths, choose):
        inner_state, own = state
        return self.inner.update(model, draft, inner_state, target, emitted, n_acc, lengths, choose), own


@dataclasses.dataclass(frozen=True)
class OracleTokens(InnerProposer):
    """Benchmarks only: a real proposer runs every step (its whole cost, its own state kept in
    step with what the target emits) but the oracle's tokens are verified in its place, so a
    drafter's speed can be measured at a chosen acceptance before it is trained."""

    oracle: OracleProposer | None = None

    def init_state(self, model, draft, tokens, lengths, target, choose, reference=None):
        return (self.inner.init_state(model, draft, tokens, lengths, target, choose),
                self.oracle.init_state(model, draft, tokens, lengths, target, choose, reference))

    def propose(self, model, draft, state, tokens, lengths, choose):
        inner_state, reference = state
        own, n_draft, _, inner_state = self.inner.propose(model, draft, inner_state, tokens, lengths, choose)
        drafts, _, _, reference = self.oracle.propose(model, draft, reference, tokens, lengths, choose)
        # Token ids are never negative, but XLA cannot prove it, so the drafter's work stays live.
        drafts = jnp.where(own < 0, own, drafts)
        return drafts, n_draft, None, (inner_state, reference)


@dataclasses.dataclass(frozen=True)
class SyntheticAcceptance(InnerProposer):
    """vLLM's "synthetic" rejection (benchmarks): the inner proposer drafts at its full cost and
    the target verifies its drafts in the usual pass, but draft i is accepted with a dialled
    probability (given that the drafts before it were) instead of by comparison with the target;
    the token after the accepted drafts is the target's own. Every cache and the inner proposer
    commit what was accepted, as in a real run, so a method's speed at any acceptance can be
    measured before its drafter is trained, and no near-tie can knock the run off its rate.

    The engine accepts by `spec_jax.engine.sampling.accept_synthetic` when its proposer is this. The
    conditional rates reach the device at prefill as data (`reference` [B, k]), not as
    constants, so one executable serves every rate.
    """

    rates: tuple[float, ...] = ()  # conditional acceptance probability per draft position

    def reference(self, batch: int) -> np.ndarray:
        """The prefill input: the rates of every row, [batch, k] float32."""
        return np.tile(np.asarray(self.rates, np.float32), (batch, 1))

    def init_state(self, model, draft, tokens, lengths, target, choose, reference=None):
        if reference is None:
            raise ValueError("synthetic acceptance needs its rates at prefill (SyntheticAcceptance.reference)")
        return self.inner.init_state(model, draft, tokens, lengths, target, choose), reference

    def propose(self, model, draft, state, tokens, lengths, choose):
        inner_state, rates = state
        drafts, n_draft, q, inner_state = self.inner.propose(model, draft, inner_state, tokens, lengths, choose)
        return drafts, n_draft, q, (inner_state, rates)

    @staticmethod
    def rates_of(state) -> jax.Array:
        """The rates [B, k] kept in the state (the engine's `accept_synthetic` reads them)."""
        return state[1]
