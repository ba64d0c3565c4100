"""The data a step reads and writes: `DecodeState` (with its `SpecStats`), the static `SpecPlan` of
the speculative step, and the pure operations on a state outside a step (writing tokens,
inserting a row, changing which logit processors it carries)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from proposers import Proposer, Shared
from spec_jax.engine.sampling import EmittedLogprobs, RowSampling, TokenHistory

# How a step accepts drafts: "standard" compares them with the target (exact); "synthetic" accepts
# them at dialled rates (vLLM's benchmarking mode: `sampling.accept_synthetic`).
ACCEPTANCE_RULES = ("standard", "synthetic")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecStats:
    """Per-row speculation counters. drafted, accepted: [B] draft tokens verified / accepted;
    num_drafts: [B] steps that verified at least one draft; per_position: [B, k] how often the
    draft at each position was accepted; verify_lengths: [B, k+1] how many of the row's steps
    verified 0..k drafts (the adaptive choice, or k less what a row had no room or draft for)."""

    drafted: jax.Array
    accepted: jax.Array
    num_drafts: jax.Array
    per_position: jax.Array
    verify_lengths: jax.Array

    @classmethod
    def zeros(cls, batch: int, k: int) -> "SpecStats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(z, z, z, jnp.zeros((batch, k), jnp.int32), jnp.zeros((batch, k + 1), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The decode state of B rows.

    tokens: [B, L] int32 prompt then generated tokens. lengths: [B] tokens in `tokens`; the
    caches hold the first lengths - 1 of them (the newest token is fed by the next step).
    prompt_lengths, max_lengths: [B] (a row stops when lengths reaches max_lengths).
    done: [B] bool. stop_ids: [B, S] int32 (-1 pads). sampling: per-row `RowSampling`.
    cache: the model's `ModelCache`. steps: [] int32 decode steps run so far.
    speculate: [B] bool rows that draft (a per-request opt-out); proposer: the draft method's
    own state; stats: `SpecStats` (both empty when speculation is off); history: the
    `TokenHistory` penalties read (None when no row has a penalty); logprobs: the written tokens'
    `EmittedLogprobs` (None unless asked for); acceptance_rates: [B, k] float32, per draft
    position the probability that a draft is accepted given the ones before it were (the
    synthetic acceptance rule's data, so one program serves every rate; None under the standard rule);
    acceptance_estimates: [B, k] float32 each row's running estimate of those probabilities (what
    adaptive verification chooses from: `adaptive.update_estimates`; None with a fixed k).
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    max_lengths: jax.Array
    done: jax.Array
    stop_ids: jax.Array
    sampling: RowSampling
    cache: tuple
    steps: jax.Array
    speculate: jax.Array
    proposer: Any = ()
    stats: SpecStats | None = None
    history: TokenHistory | None = None
    logprobs: EmittedLogprobs | None = None
    acceptance_rates: jax.Array | None = None
    acceptance_estimates: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """Static description of the speculative step: the proposer (a frozen dataclass from
    `proposers/`), k drafts per step at most, the GDN rollback ("checkpoint" or "replay"), whether
    drafts are sampled with their probabilities kept (vLLM's draft_sample_method), the acceptance
    rule (`ACCEPTANCE_RULES`) and the verify widths the step compiles: (k,) verifies k drafts every
    step; more widths (`adaptive.compiled_widths`) choose one a step (adaptive verification).
    Hashable: every compiled program is keyed by it."""

    proposer: Proposer
    k: int
    rollback: str = "replay"
    probabilistic: bool = False
    acceptance: str = "standard"
    widths: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.widths:
            object.__setattr__(self, "widths", (self.k,))
        if self.widths[-1] != self.k or list(self.widths) != sorted(set(self.widths)) or self.widths[0] < 0:
            raise ValueError(f"verify widths {self.widths} must ascend from 0 or more to k = {self.k}")

    @property
    def adaptive(self) -> bool:
        """Whether the step chooses its verify width (else it verifies k drafts)."""
        return len(self.widths) > 1


def plan_taps(plan: SpecPlan | None) -> tuple[int, ...]:
    """Target layers whose outputs the plan's proposer reads (DFlash), else none."""
    return getattr(plan.proposer, "taps", ()) if plan is not None else ()


def append_tokens(state: DecodeState, new: jax.Array, count: jax.Array, cache, logits=None) -> DecodeState:
    """Write up to `count` [B] of the tokens new [B, m] per live row, stopping after the first
    stop token and at max_lengths; then update done. logits [B, m, V]: the raw target logits each
    token was drawn from (for `state.logprobs`; None when it is None)."""
    B, m = new.shape
    j = jnp.arange(m)[None, :]
    is_stop = jnp.any(new[:, :, None] == state.stop_ids[:, None, :], axis=-1) & (j < count[:, None])
    first_stop = jnp.min(jnp.where(is_stop, j, m), axis=1)
    room = state.max_lengths - state.lengths
    n = jnp.where(state.done, 0, jnp.minimum(jnp.minimum(count, first_stop + 1), room))
    history = None if state.history is None else state.history.add(new, n)
    idx = state.lengths[:, None] + j
    idx = jnp.where(j < n[:, None], idx, state.tokens.shape[1])  # out of range: dropped
    tokens = state.tokens.at[jnp.arange(B)[:, None], idx].set(new, mode="drop")
    logprobs = None if state.logprobs is None else state.logprobs.write(idx, logits, new)
    lengths = state.lengths + n
    stopped = (first_stop < n) | (lengths >= state.max_lengths)
    return dataclasses.replace(state, tokens=tokens, lengths=lengths, done=state.done | stopped, cache=cache,
                               history=history, logprobs=logprobs)


def insert_row(state: DecodeState, row: jax.Array, new: DecodeState) -> DecodeState:
    """Write the one-row state `new` (a batch-1 prefill) into row `row` [] int32 of the B-row
    `state`: tokens, lengths, sampling, every cache and the proposer's state; `steps` stays the
    batch's. A leaf's batch axis is the one where `new` has 1 and `state` has B (caches are
    [G, B, ...], the rest [B, ...]); with B = 1 the row replaces the whole leaf. A proposer's
    `Shared` state (no batch axis) stays the batch's."""
    B = state.done.shape[0]

    def put(old, one):
        if isinstance(old, Shared):
            return old
        if old.ndim == 0:
            return old
        axes = [i for i, (a, b) in enumerate(zip(old.shape, one.shape)) if a != b]
        if not axes and B == 1:
            return one
        if len(axes) != 1 or one.shape[axes[0]] != 1:
            raise ValueError(f"cannot insert a leaf of shape {one.shape} into one of shape {old.shape}: "
                             f"expected the same shape with 1 in place of the batch size {B}")
        return jax.lax.dynamic_update_slice_in_dim(old, one, row, axes[0])

    return jax.tree.map(put, state, new, is_leaf=is_shared)


def is_shared(x) -> bool:
    return isinstance(x, Shared)


def shared_of(state: DecodeState) -> list[Shared]:
    """The proposer's `Shared` state in `state`, in tree order (empty when it has none)."""
    return [x for x in jax.tree.leaves(state.proposer, is_leaf=is_shared) if is_shared(x)]


def with_shared(state: DecodeState, shared: list[Shared]) -> DecodeState:
    """`state` with its proposer's `Shared` state replaced by `shared` (`shared_of` of an earlier
    batch's state; empty: unchanged)."""
    if not shared:
        return state
    given = iter(shared)
    proposer = jax.tree.map(lambda x: next(given) if is_shared(x) else x, state.proposer, is_leaf=is_shared)
    return dataclasses.replace(state, proposer=proposer)


def with_processors(state: DecodeState, names: frozenset[str], num_logprobs: int | None,
                    vocab_size: int) -> DecodeState:
    """The B-row `state` carrying exactly the logit processors `names` (`RowSampling`'s optional
    fields, with the `TokenHistory` penalties read) and `num_logprobs` top logprobs per written
    token (None: no logprobs). What stays is kept; what is added starts neutral, so the rows
    already running produce the same tokens (logprobs of another width start empty). A continuous
    batch widens to what a new request needs and narrows when no row needs it any more; the step
    compiles once per combination."""
    B, L = state.tokens.shape
    sampling = state.sampling.with_processors(names, vocab_size, state.stop_ids)
    history = None
    if "penalties" in names:
        history = state.history if state.history is not None else TokenHistory.empty(B, vocab_size)
    logprobs = None
    if num_logprobs is not None:
        kept = state.logprobs
        logprobs = kept if kept is not None and kept.top.shape[-1] == num_logprobs else EmittedLogprobs.empty(
            B, L, num_logprobs)
    return dataclasses.replace(state, sampling=sampling, history=history, logprobs=logprobs)
