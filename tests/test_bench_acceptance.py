"""bench.acceptance's bounds: a method's tokens over its steps, each drafting step timed as given
(the oracle's step for free drafting, plus the drafter's own cost for the bound at c)."""

import pytest

from bench.acceptance import bound, drafting_step_ms

ROW = {"steps": 10, "drafted_steps": 6, "generated": 20, "mean_acceptance_length": 3.0}


def test_a_step_without_drafts_counts_as_a_plain_step_at_batch_one():
    # 6 drafted steps at 2 ms and 4 undrafted ones at the plain 1 ms: 20 tokens in 16 ms
    assert bound(ROW, 2.0, plain_step_ms=1.0, batch=1) == pytest.approx(20 / 16)


def test_in_a_batch_every_step_verifies():
    assert bound(ROW, 2.0, plain_step_ms=1.0, batch=4) == pytest.approx(3.0 / 2.0)


def test_a_drafting_step_is_what_is_left_after_the_plain_steps():
    # 16 ms over 10 steps, 4 of them plain at 1 ms: the 6 drafting steps took 2 ms each
    run = {**ROW, "step_ms": 1.6}
    assert drafting_step_ms(run, plain_step_ms=1.0, batch=1) == pytest.approx(2.0)
    assert drafting_step_ms(run, plain_step_ms=1.0, batch=4) == pytest.approx(1.6)
