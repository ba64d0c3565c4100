"""bench.acceptance's bound: a method's tokens over its steps timed as if drafting were free."""

import pytest

from bench.acceptance import bound


def test_a_step_without_drafts_counts_as_a_plain_step_at_batch_one():
    # 6 drafted steps at the oracle's 2 ms and 4 undrafted ones at the plain 1 ms: 20 tokens in 16 ms
    row = {"steps": 10, "drafted_steps": 6, "generated": 20, "oracle_step_ms": 2.0, "mean_acceptance_length": 3.0}
    assert bound(row, plain_step_ms=1.0, batch=1) == pytest.approx(20 / 16)


def test_in_a_batch_every_step_verifies():
    row = {"steps": 10, "drafted_steps": 6, "generated": 20, "oracle_step_ms": 2.0, "mean_acceptance_length": 3.0}
    assert bound(row, plain_step_ms=1.0, batch=4) == pytest.approx(3.0 / 2.0)
