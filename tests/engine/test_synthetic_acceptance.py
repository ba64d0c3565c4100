"""vLLM's synthetic rejection (`rejection_sample_method: "synthetic"`): acceptance at a dialled
rate, the drafter and the verify pass at their full cost. Config checks as vLLM's; rates 0
reproduce plain greedy decoding (the token after no accepted draft is the target's own); rates
1 accept every draft; a rate in between is met on average."""

import numpy as np
import pytest
from helpers import DRAFT_GREEDY, drafter_prompts

from spec_jax import LLM, SamplingParams
from spec_jax.engine.spec_config import parse_speculative_config

# at a fixed k: every step verifies every draft, so each position's share is its rate
MTP = {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
       "enable_adaptive_verification": False}


def test_length_resolves_to_rates_and_rates_to_conditional():
    spec = parse_speculative_config({**MTP, "synthetic_acceptance_length": 2.6}, target_model="t")
    assert spec.synthetic_acceptance_rates == pytest.approx((1.0, 0.6, 0.0))
    spec = parse_speculative_config({**MTP, "synthetic_acceptance_rates": [0.8, 0.4, 0.2]}, target_model="t")
    assert spec.synthetic_conditional_rates() == pytest.approx((0.8, 0.5, 0.5))


@pytest.mark.parametrize("extra, message", [
    ({}, "exactly one of"),
    ({"synthetic_acceptance_rates": [0.5, 0.5, 0.5], "synthetic_acceptance_length": 2.0}, "exactly one of"),
    ({"synthetic_acceptance_rates": [0.5, 0.6, 0.1]}, "non-increasing"),
    ({"synthetic_acceptance_rates": [0.5, 0.4]}, "3 numbers in"),
    ({"synthetic_acceptance_rates": [1.5, 0.4, 0.1]}, "3 numbers in"),
    ({"synthetic_acceptance_length": 4.5}, r"\[1, num_speculative_tokens \+ 1 = 4\]"),
])
def test_bad_synthetic_configs_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config({**MTP, **extra}, target_model="t")


def test_rates_without_synthetic_are_refused():
    with pytest.raises(ValueError, match="need rejection_sample_method 'synthetic'"):
        parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2, "synthetic_acceptance_length": 2.0},
                                 target_model="t")


def generate(tiny_dir, rates, params=DRAFT_GREEDY):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4,
              speculative_config={**MTP, "synthetic_acceptance_rates": rates})
    return llm.generate(prompt_token_ids=drafter_prompts(), sampling_params=params)


def test_rate_zero_is_plain_greedy_and_rate_one_accepts_all(tiny_dir, plain_greedy):
    none = generate(tiny_dir, [0.0, 0.0, 0.0])
    assert [o.outputs[0].token_ids for o in none] == plain_greedy
    assert all(o.metrics["num_accepted_tokens"] == 0 and o.metrics["num_draft_tokens"] > 0 for o in none)
    every = generate(tiny_dir, [1.0, 1.0, 1.0])
    for o in every:
        m = o.metrics
        assert m["num_accepted_tokens"] == m["num_draft_tokens"] > 0
        assert len(o.outputs[0].token_ids) == DRAFT_GREEDY.max_tokens


def test_a_rate_is_met_on_average(tiny_dir):
    a = 0.6
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    outs = generate(tiny_dir, [a, a * a, a ** 3], params)
    steps = sum(o.metrics["num_drafts"] for o in outs)
    per_position = np.sum([np.asarray(o.metrics["acceptance_per_position"]) * o.metrics["num_drafts"]
                           for o in outs], axis=0) / steps
    # About 230 steps: the standard error of each share is under 0.035.
    assert per_position == pytest.approx([a, a * a, a ** 3], abs=0.12)
