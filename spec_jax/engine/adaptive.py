"""Adaptive verification: how many drafts each row verifies in a speculative step.

A row keeps a running estimate, per draft position i, of the probability that draft i is
accepted given that drafts 1..i-1 were (`update_estimates`). The step compiles its target pass at
a few widths (`compiled_widths`); the cost model is the measured time of a step at each width for
the batch's row count (`StepTimes`, filled by timing the first steps of each batch bucket). Before
drafting, `choose_verify_lengths` picks the width that maximises the whole batch's expected tokens
per second and gives each row its count of drafts to verify (the rest are masked, as for rows that
opt out). Verifying fewer drafts never changes what is emitted: greedy rows still emit the target's
argmax sequence, and rejection sampling over the verified prefix is exact at any length.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# A new row's estimate at every position: a coin flip, until its own steps say otherwise.
PRIOR = 0.7
# Weight of one observation in the running estimate (about the last 8 steps count).
LEARNING_RATE = 0.125
# Per step that verifies no draft of a row, its estimates drift this share of the way back to
# PRIOR, so that a row whose drafts stopped being verified is tried again once they have recovered.
RELAXATION = 1 / 256
# A width the calibration is not timing costs this much: the choice never takes it.
FORBIDDEN = 1e30
# Timed steps per width and rounds of them when a batch bucket is calibrated (`StepTimes`).
CALIBRATION_STEPS = 6
CALIBRATION_ROUNDS = 2


def compiled_widths(k: int) -> tuple[int, ...]:
    """The verify widths a step of at most k drafts compiles: 0 (a plain step), 1, 3, 7, ... below
    k, and k itself."""
    if k < 1:
        raise ValueError(f"compiled_widths needs k >= 1 drafts, got {k}")
    widths = [0]
    while 2 * widths[-1] + 1 < k:
        widths.append(2 * widths[-1] + 1)
    return (*widths, k)


def initial_estimates(rows: int, k: int) -> jax.Array:
    """[rows, k] float32: every position at PRIOR."""
    return jnp.full((rows, k), PRIOR, jnp.float32)


def choose_verify_lengths(estimates: jax.Array, step_times: jax.Array, widths: tuple[int, ...],
                          live: jax.Array, limit: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The width that maximises expected emitted tokens per second, and each row's count.

    estimates: [B, k] per-row conditional acceptance estimates; step_times: [W] seconds of a step
    at each of `widths` (static, ascending, widths[-1] == k) for this batch's row count; live: [B]
    bool rows still generating; limit: [B] int32 the most drafts a row may verify (0 for rows that
    do not speculate, else the room left before its max length).
    A live row emits 1 + the expected number of accepted drafts: the sum over the verified
    positions of the product of its estimates up to each. Masking a row's drafts saves no time at
    a given width, so every row verifies min(width, limit).
    Returns (index [] int32 into widths, counts [B] int32 in 0..width).
    """
    B, k = estimates.shape
    if widths[-1] != k:
        raise ValueError(f"widths {widths} must end at the estimates' k = {k}")
    survival = jnp.cumprod(jnp.clip(estimates, 0.0, 1.0), axis=1)  # [B, k]
    # expected accepted drafts of each row when it verifies j = 0..k of them
    gained = jnp.concatenate([jnp.zeros((B, 1), survival.dtype), jnp.cumsum(survival, axis=1)], axis=1)
    counts = jnp.minimum(jnp.asarray(widths, jnp.int32)[:, None], limit[None, :])  # [W, B]
    per_row = jnp.take_along_axis(gained.T, jnp.clip(counts, 0, k), axis=0)  # [W, B]
    tokens = jnp.sum(jnp.where(live[None, :], 1.0 + per_row, 0.0), axis=1)  # [W]
    index = jnp.argmax(tokens / step_times).astype(jnp.int32)
    return index, jnp.where(live, counts[index], 0)


def update_estimates(estimates: jax.Array, verified: jax.Array, accepted: jax.Array) -> jax.Array:
    """estimates [B, k] after a step where each row verified `verified` [B] drafts and accepted
    the first `accepted` [B] of them. Position i was tried when i < verified and every draft
    before it was accepted (i <= accepted): it moves LEARNING_RATE toward 1 (accepted) or 0; one
    after a rejection stays. Positions past the verified ones move LEARNING_RATE toward the
    deepest verified one's estimate, so that a wider width is tried as soon as the verified
    drafts earn it; a row that verified nothing relaxes toward PRIOR by RELAXATION."""
    i = jnp.arange(estimates.shape[1])[None, :]
    tried = (i < verified[:, None]) & (i <= accepted[:, None])
    outcome = (i < accepted[:, None]).astype(estimates.dtype)
    learned = jnp.where(tried, estimates + LEARNING_RATE * (outcome - estimates), estimates)
    deepest = jnp.take_along_axis(learned, jnp.maximum(verified - 1, 0)[:, None], axis=1)  # [B, 1]
    beyond = jnp.where(verified[:, None] > 0, estimates + LEARNING_RATE * (deepest - estimates),
                       estimates + RELAXATION * (PRIOR - estimates))
    return jnp.where(i >= verified[:, None], beyond, learned)


def forcing(n_widths: int, index: int) -> np.ndarray:
    """Step times [W] under which `choose_verify_lengths` takes widths[index] whatever the estimates."""
    times = np.full((n_widths,), FORBIDDEN, np.float32)
    times[index] = 1.0
    return times


def monotone(seconds: np.ndarray) -> np.ndarray:
    """Step times [W] with none above a wider width's: a narrower step does a part of a wider one's
    work, so a higher figure is noise (another process on the device, a first run)."""
    return np.minimum.accumulate(np.asarray(seconds, np.float32)[::-1])[::-1]


class StepTimes:
    """The cost model of one batch bucket: seconds of a step at each compiled width, measured on
    the batch's own first steps (verifying any prefix emits the same tokens, so those steps are
    real decoding): one untimed step at each width, then CALIBRATION_ROUNDS rounds of
    CALIBRATION_STEPS timed steps at each, the fastest round kept (`monotone`), widest first (a
    short first request still speculates). Until every width is timed, all widths count as
    equally fast."""

    def __init__(self, n_widths: int, steps: int = CALIBRATION_STEPS, rounds: int = CALIBRATION_ROUNDS):
        self.n_widths = n_widths
        # (width index, steps, timed) in the order they run
        widest_first = range(n_widths - 1, -1, -1)
        self.pieces = [(i, 1, False) for i in widest_first] + [(i, steps, True) for _ in range(rounds)
                                                               for i in widest_first]
        self.best = np.full((n_widths,), np.inf)
        self.timed = (0, 0.0)  # steps and seconds of the piece under way

    @classmethod
    def measured(cls, seconds) -> "StepTimes":
        """A cost model given rather than measured here: seconds [W] of a step at each width."""
        if not len(seconds) or not all(s > 0 for s in seconds):
            raise ValueError(f"step times must be positive seconds, one per verify width, got {list(seconds)}")
        times = cls(len(seconds), rounds=0)
        times.pieces, times.best = [], np.asarray(seconds, np.float64)
        return times

    @property
    def done(self) -> bool:
        return not self.pieces

    def times(self) -> np.ndarray:
        """[W] float32 seconds per step (ones until calibrated)."""
        return monotone(self.best) if self.done else np.ones(self.n_widths, np.float32)

    def calibrate(self, run: Callable, state, budget: int):
        """Run the state's next steps at forced widths, timing each width, within `budget` steps.
        run(state, steps, step_times) -> state runs up to that many steps under those step times.
        Returns (state, steps left of the budget). A piece cut by the budget goes on at the next
        call; one cut because every row finished is not counted."""
        while self.pieces and budget > 0 and not bool(jnp.all(state.done)):
            index, steps, timed = self.pieces[0]
            n = min(steps - self.timed[0], budget)
            before = int(state.steps)
            t0 = time.perf_counter()
            state = run(state, n, forcing(self.n_widths, index))
            ran = int(state.steps) - before  # reading steps waits for the program
            elapsed = time.perf_counter() - t0
            budget -= ran
            if ran < n:  # every row finished
                self.timed = (0, 0.0)
                break
            done_steps, seconds = self.timed[0] + ran, self.timed[1] + elapsed
            self.timed = (done_steps, seconds) if done_steps < steps else (0, 0.0)
            if done_steps == steps:
                self.pieces.pop(0)
                if timed:
                    self.best[index] = min(self.best[index], seconds / steps)
        return state, budget
