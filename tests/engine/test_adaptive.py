"""Adaptive verification: the choice of verify lengths as a pure function of (estimates, step
times, batch), the running estimates, and in the engine: every width timed on a bucket's first
steps, greedy output unchanged under a given cost model, the chosen lengths in the metrics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spec_jax import LLM, SamplingParams
from spec_jax.engine.adaptive import (CALIBRATION_ROUNDS, CALIBRATION_STEPS, LEARNING_RATE, PRIOR, RELAXATION,
                                      StepTimes, choose_verify_lengths, compiled_widths, monotone, update_estimates)
from spec_jax.engine.step import run_one

WIDTHS = (0, 1, 3, 7, 15)


def choose(acceptance, times, widths=WIDTHS, live=None, limit=None):
    """choose_verify_lengths on rows whose every position has the given acceptance ([B] values)."""
    acceptance = np.asarray(acceptance, np.float32)
    B, k = len(acceptance), widths[-1]
    live = np.ones(B, bool) if live is None else np.asarray(live)
    limit = np.full(B, k, np.int32) if limit is None else np.asarray(limit, np.int32)
    index, counts = choose_verify_lengths(jnp.asarray(np.repeat(acceptance[:, None], k, 1)),
                                          jnp.asarray(times, jnp.float32), widths, jnp.asarray(live),
                                          jnp.asarray(limit))
    return widths[int(index)], np.asarray(counts).tolist()


def test_compiled_widths_double_up_to_k():
    assert compiled_widths(1) == (0, 1)
    assert compiled_widths(3) == (0, 1, 3)
    assert compiled_widths(5) == (0, 1, 3, 5)
    assert compiled_widths(15) == WIDTHS
    with pytest.raises(ValueError, match="k >= 1"):
        compiled_widths(0)


def test_high_acceptance_and_cheap_verify_verify_every_draft():
    assert choose([0.9] * 4, [1.0, 1.05, 1.1, 1.2, 1.4]) == (15, [15] * 4)


def test_low_acceptance_verifies_nothing():
    assert choose([0.02] * 4, [1.0, 1.05, 1.1, 1.2, 1.4]) == (0, [0] * 4)


def test_expensive_verify_verifies_nothing_even_at_high_acceptance():
    assert choose([0.9] * 4, [1.0, 2.5, 5.0, 9.0, 17.0]) == (0, [0] * 4)


def test_acceptance_in_between_takes_a_middle_width():
    # 0.7 per position: 1 + 0.7 + 0.49 + 0.34 = 2.53 tokens at width 3 for 1.5 x the time
    assert choose([0.7] * 4, [1.0, 1.3, 1.5, 2.6, 5.0]) == (3, [3] * 4)


def test_a_bigger_batch_bucket_verifies_fewer():
    """The same rows under batch-1 step times (flat: weights dominate) and batch-32 ones (steep:
    verified tokens dominate)."""
    flat, steep = [20.1, 20.6, 21.0, 22.5, 25.6], [32.5, 39.0, 47.0, 60.0, 86.6]
    assert choose([0.85], flat)[0] == 15
    assert choose([0.85] * 32, steep)[0] == 7


def test_rows_that_do_not_speculate_weigh_on_the_choice():
    """Width 1 at 1.3 x the time pays when every row gains half a token, not when one row of four does."""
    widths, times = (0, 1), [1.0, 1.3]
    assert choose([0.5] * 4, times, widths) == (1, [1] * 4)
    assert choose([0.5] * 4, times, widths, limit=[1, 0, 0, 0]) == (0, [0] * 4)


def test_counts_follow_each_rows_limit_and_finished_rows_verify_nothing():
    width, counts = choose([0.9] * 4, [1.0, 1.05, 1.1, 1.2, 1.4], live=[True, True, False, True],
                           limit=[15, 2, 15, 0])
    assert (width, counts) == (15, [15, 2, 0, 0])


def test_confident_rows_carry_a_doubtful_one():
    """A batch of three rows at 0.95 and one at 0.05 verifies long: the width is the batch's."""
    assert choose([0.95, 0.95, 0.95, 0.05], [1.0, 1.05, 1.1, 1.2, 1.4])[0] == 15


@pytest.mark.parametrize("seed", range(5))
def test_the_choice_maximises_expected_tokens_per_second(seed):
    """Against a direct evaluation of every width on random per-position estimates and times."""
    rng = np.random.default_rng(seed)
    B, k = 6, 15
    est = rng.uniform(0, 1, (B, k)).astype(np.float32)
    times = np.sort(rng.uniform(1, 3, len(WIDTHS))).astype(np.float32)
    limit = rng.integers(0, k + 1, B).astype(np.int32)
    live = rng.uniform(size=B) < 0.8
    index, counts = choose_verify_lengths(jnp.asarray(est), jnp.asarray(times), WIDTHS, jnp.asarray(live),
                                          jnp.asarray(limit))
    survival = np.cumprod(est, axis=1)

    def rate(w):
        return sum(1 + survival[r, :min(w, limit[r])].sum() for r in range(B) if live[r]) / times[WIDTHS.index(w)]

    best = max(WIDTHS, key=rate)
    assert rate(WIDTHS[int(index)]) == pytest.approx(rate(best), rel=1e-5)
    assert np.asarray(counts).tolist() == [min(WIDTHS[int(index)], limit[r]) if live[r] else 0 for r in range(B)]


def test_estimates_learn_from_tried_positions_and_follow_the_deepest_past_it():
    est = jnp.asarray([[0.6, 0.6, 0.6, 0.2]] * 2 + [[0.6] * 4], jnp.float32)
    # row 0 verified 3, accepted 1 (position 0 accepted, 1 rejected, 2 unseen after the rejection,
    # 3 past the verified: toward position 2's 0.6); row 1 verified 2 and accepted both (2 and 3
    # toward position 1's new estimate); row 2 verified none (every position toward the prior)
    out = np.asarray(update_estimates(est, jnp.asarray([3, 2, 0]), jnp.asarray([1, 2, 0])))
    up, down = 0.6 + LEARNING_RATE * 0.4, 0.6 - LEARNING_RATE * 0.6
    relaxed = 0.6 + RELAXATION * (PRIOR - 0.6)
    np.testing.assert_allclose(out, [[up, down, 0.6, 0.2 + LEARNING_RATE * 0.4],
                                     [up, up, 0.6 + LEARNING_RATE * (up - 0.6), 0.2 + LEARNING_RATE * (up - 0.2)],
                                     [relaxed] * 4], rtol=1e-6)


@dataclasses.dataclass
class Steps:
    """What calibration reads of a decode state: steps run, rows done."""

    steps: jnp.ndarray
    done: jnp.ndarray


def test_calibration_times_every_width_in_pieces_that_fit_any_budget():
    forced = []

    def run(state, n, times):
        forced.append((int(np.argmin(times)), n))
        return Steps(state.steps + n, state.done)

    times, state = StepTimes(3, steps=2, rounds=2), Steps(jnp.asarray(0), jnp.asarray([False]))
    while not times.done:
        state, left = times.calibrate(run, state, 3)
        assert left == 0
    assert forced[:3] == [(2, 1), (1, 1), (0, 1)]  # one untimed step each, widest first, then the timed rounds
    assert [sum(n for w, n in forced if w == i) for i in range(3)] == [5, 5, 5]
    assert times.times().shape == (3,) and np.all(np.diff(times.times()) >= 0) and np.all(times.times() > 0)
    assert StepTimes(2).calibrate(run, Steps(jnp.asarray(0), jnp.asarray([True])), 5)[1] == 5  # nothing to run


def test_a_narrower_width_never_costs_more_than_a_wider_one():
    np.testing.assert_allclose(monotone([32.0, 9.0, 22.0, 21.0, 40.0]), [9.0, 9.0, 21.0, 21.0, 40.0])


def test_run_one_runs_the_indexed_branch_only():
    branches = tuple(lambda c, i=i: c * 10 + i for i in range(3))
    run = jax.jit(run_one, static_argnums=1)
    for index in range(3):
        assert int(run(jnp.asarray(index), branches, jnp.asarray(1))) == 10 + index


def test_given_step_times_are_checked():
    assert StepTimes.measured([1.0, 2.0]).times().tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="must be positive seconds"):
        StepTimes.measured([1.0, 0.0])


GREEDY = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 60, n).tolist() for n in (5, 17, 40)]


def generate(model_dir, spec, params, step_times=None):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=[4],
              speculative_config=spec)
    if step_times is not None:
        llm.engine.step_times[4] = StepTimes.measured(step_times)
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], outs, llm


@pytest.fixture(scope="module")
def plain(echo_dir):
    return generate(echo_dir, None, GREEDY)[0]


def test_a_bucket_times_every_width_on_its_first_steps(echo_dir, plain):
    tokens, outs, llm = generate(echo_dir, MTP, GREEDY)
    assert tokens == plain
    times = llm.engine.step_times[4]
    assert times.done and all(t > 0 for t in times.times())
    lengths = llm.metrics["num_steps_per_verify_length"]
    # each width ran its untimed and timed steps (rows verify min(width, their room) in them)
    assert len(lengths) == 4 and all(lengths[w] > 0 for w in (0, 1, 3))
    assert sum(lengths) >= (1 + CALIBRATION_ROUNDS * CALIBRATION_STEPS) * 3


def test_a_given_cost_model_sets_the_width_and_output_stays_plain(echo_dir, plain):
    """Width 1 is cheap and width 3 dear: the rows verify one draft (or none when out of room),
    a request that opts out verifies none, and every row's tokens are the plain ones."""
    params = [GREEDY, dataclasses.replace(GREEDY, speculative=False), GREEDY]
    tokens, outs, llm = generate(echo_dir, MTP, params, step_times=[1.0, 1.01, 100.0])
    assert tokens == plain
    per_row = [o.metrics["num_steps_per_verify_length"] for o in outs]
    assert per_row[0][1] > 0 and per_row[2][1] > 0 and all(r[2] == r[3] == 0 for r in per_row)
    assert per_row[1][0] == sum(per_row[1]) and 0 < llm.metrics["mean_verify_length"] < 1


def test_fixed_k_verifies_every_draft(echo_dir, plain):
    tokens, outs, llm = generate(echo_dir, {**MTP, "enable_adaptive_verification": False}, GREEDY)
    assert tokens == plain and not llm.engine.step_times
    for o in outs:
        lengths = o.metrics["num_steps_per_verify_length"]
        assert lengths[3] > 0 and sum(lengths[:3]) <= 3  # shorter only in the last steps, out of room
