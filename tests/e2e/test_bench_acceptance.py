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


class TimedLLM:
    """Stands in for an LLM whose decode takes the given seconds, run after run (first: compile)."""

    def __init__(self, name, seconds, log):
        self.name, self.seconds, self.log, self.metrics = name, iter(seconds), log, {}

    def generate(self, prompt_token_ids, sampling_params, use_tqdm):
        from types import SimpleNamespace

        s = next(self.seconds)
        self.log.append(self.name)
        self.metrics = {"mean_acceptance_length": s}  # tells which run the row's figures came from
        metrics = {"decode_s": s, "batch_decode_steps": 10, "num_generated_tokens": 21}
        return [SimpleNamespace(metrics=metrics, outputs=[SimpleNamespace(token_ids=[1, 2])])]


def test_a_rows_configurations_are_timed_in_turn_and_each_keeps_its_fastest_run():
    from bench.acceptance import timed_together

    log = []
    llms = {"plain": TimedLLM("plain", [9.0, 2.0, 1.0], log), "method": TimedLLM("method", [9.0, 3.0, 4.0], log)}
    runs = timed_together(llms, prompts=[[0]], params=None, batch=1, repeats=2)
    assert log == ["plain", "method", "plain", "method", "plain", "method"]  # compile both, then rounds
    (plain, _), (method, tokens) = runs["plain"], runs["method"]
    assert plain["step_ms"] == pytest.approx(100.0) and plain["mean_acceptance_length"] == 1.0
    assert method["step_ms"] == pytest.approx(300.0) and method["mean_acceptance_length"] == 3.0
    assert method["decode_tok_s"] == pytest.approx(20 / 3.0) and tokens == [[1, 2]]
