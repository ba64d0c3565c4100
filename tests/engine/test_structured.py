"""Structured output with speculation on, on the default model (its real 8192-token tokenizer, so
the grammar masks are the ones a deployment computes): greedy output equals speculation off for
every method, alone and beside unconstrained rows; sampled output keeps the constrained
distribution; drafts the grammar forbids are never accepted; forced tokens are drafted; schemas
compile once; bad constraints are refused by name."""

import dataclasses
import json
import queue
import re

import numpy as np
import pytest
from helpers import FIXED_K
from scipy import stats

from spec_jax import LLM, SamplingParams, default_model
from spec_jax.api.scheduler import Scheduler
from spec_jax.engine.structured import StructuredOutputsParams
from spec_jax.writing.random_checkpoint import write_random_drafter

CAR = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 12},
                                        "model": {"type": "string", "maxLength": 12},
                                        "car_type": {"enum": ["sedan", "SUV", "Truck", "Coupe"]}},
       "required": ["brand", "model", "car_type"]}
PROMPTS = ["Generate a JSON with the brand, model and car_type of a car:", "def fibonacci(n):",
           "The email of Alan Turing is", "Classify this sentiment: the engine is wonderful!"]
EMAIL = r"[a-z]{1,10}@[a-z]{1,8}\.com"


def constrained(**fields) -> StructuredOutputsParams:
    return StructuredOutputsParams(**fields)


def mixed_params(max_tokens: int = 60) -> list[SamplingParams]:
    """A JSON schema, an unconstrained row, a regex and a choice, greedy."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [dataclasses.replace(greedy, structured_outputs=constrained(json=CAR, disable_any_whitespace=True)),
            dataclasses.replace(greedy, max_tokens=24),
            dataclasses.replace(greedy, structured_outputs=constrained(regex=EMAIL)),
            dataclasses.replace(greedy, structured_outputs=constrained(choice=["Positive", "Negative", "Neutral"]))]


@pytest.fixture(scope="module")
def plain_llm():
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=[4])


@pytest.fixture(scope="module")
def plain_outputs(plain_llm):
    return [o.outputs[0] for o in plain_llm.generate(PROMPTS, mixed_params(), use_tqdm=False)]


def check_valid(outputs) -> None:
    """Each constrained completion of `mixed_params` obeys its constraint and ended at EOS."""
    car = json.loads(outputs[0].text)
    assert set(car) == {"brand", "model", "car_type"} and car["car_type"] in CAR["properties"]["car_type"]["enum"]
    assert re.fullmatch(EMAIL, outputs[2].text), outputs[2].text
    assert outputs[3].text in ("Positive", "Negative", "Neutral")
    assert all(outputs[i].finish_reason == "stop" for i in (0, 2, 3))


def test_constrained_outputs_obey_their_constraints(plain_outputs):
    check_valid(plain_outputs)
    assert plain_outputs[1].finish_reason == "length"  # the unconstrained row runs free


@pytest.fixture(scope="module")
def specs(plain_llm, tmp_path_factory) -> dict[str, dict]:
    """Every method, with the drafters the default model ships (a random DSpark, which it does not)."""
    assets = default_model.ASSETS
    dspark = write_random_drafter("dspark", plain_llm.model.cfg, tmp_path_factory.mktemp("dspark"), layers=1,
                                  block_size=4, dtype="float32")
    # MTP at the default (adaptive verification), the others at a fixed k: a smaller program each
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                      **FIXED_K},
            "mtp": {"method": "mtp", "num_speculative_tokens": 3},
            "dflash": {"method": "dflash", "model": str(assets / "dflash"), "num_speculative_tokens": 7, **FIXED_K},
            "dspark": {"method": "dspark", "model": str(dspark), "num_speculative_tokens": 4, **FIXED_K},
            "eagle3": {"method": "eagle3", "model": str(assets / "eagle3"), "num_speculative_tokens": 3, **FIXED_K},
            "draft_model": {"method": "draft_model", "model": str(assets / "draft"), "num_speculative_tokens": 3,
                            **FIXED_K}}


METHODS = ["ngram", "mtp", "dflash", "dspark", "eagle3", "draft_model"]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_constrained_spec_equals_spec_off(plain_llm, plain_outputs, specs, method):
    llm = plain_llm.with_speculation(specs[method])
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, mixed_params(), use_tqdm=False)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain_outputs]
    check_valid(outs)
    assert llm.metrics["num_draft_tokens"] > 0
    # Alone, too: the JSON row's first step has nothing beside it.
    alone = llm.generate(PROMPTS[:1], mixed_params()[:1], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == plain_outputs[0].token_ids


PAIR = r'\{"k":"[ab][ab]"\}'
SAMPLES = 192
P_VALUE = 1e-3  # fixed seeds make the test deterministic; this only sizes the bound


def test_sampled_constrained_output_keeps_its_distribution_with_speculation(specs):
    """Two free characters between forced text, sampled at temperature 1: the 4 outcomes are
    distributed alike with speculation on (MTP drafting probabilistically, the forced text drafted
    by the grammar) and off (two-sample chi-square)."""
    params = SamplingParams(n=SAMPLES, temperature=1.0, seed=0, max_tokens=24,
                            structured_outputs=constrained(regex=PAIR))
    # Optimised programs (the suite compiles at XLA's cheapest level): this test runs hundreds of rows.
    llm = LLM(dtype="float32", max_model_len=128, max_num_seqs=96, batch_buckets=[96],
              compiler_options={"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False})
    spec = llm.with_speculation({**specs["mtp"], "draft_sample_method": "probabilistic", **FIXED_K})
    tables = []
    for engine in (llm, spec):
        texts = [c.text for c in engine.generate(["Pick two letters:"], params, use_tqdm=False)[0].outputs]
        assert all(re.fullmatch(PAIR, t) for t in texts), [t for t in texts if not re.fullmatch(PAIR, t)][:3]
        tables.append([sum(t[6:8] == a + b for t in texts) for a in "ab" for b in "ab"])
    assert spec.metrics["num_accepted_tokens"] > 0
    table = np.asarray(tables)
    table = table[:, table.sum(0) >= 10]  # chi-square needs populated cells
    assert table.shape[1] >= 3, table
    assert stats.chi2_contingency(table).pvalue > P_VALUE, table


def test_the_server_scheduler_streams_constrained_rows_beside_free_ones(plain_llm, plain_outputs, specs):
    """Continuous batching (the server's path): the four requests of `mixed_params` join one live
    batch, MTP drafting; each streams the tokens of its offline, speculation-off run, and the
    finished rows' matchers are released."""
    llm = plain_llm.with_speculation(specs["mtp"])
    scheduler = Scheduler(llm.engine, steps_per_chunk=3).start()
    updates = [queue.Queue() for _ in PROMPTS]
    try:
        for prompt, params, sink in zip(PROMPTS, mixed_params(), updates):
            scheduler.submit(llm.engine.prompt_ids(prompt, "prompt").tolist(), params, sink.put)
        streamed = []
        for sink in updates:
            tokens, update = [], None
            while update is None or update.finish_reason is None:
                update = sink.get(timeout=300)
                tokens += update.token_ids
            streamed.append((tokens, update.finish_reason))
    finally:
        scheduler.shutdown()
    assert [t for t, _ in streamed] == [o.token_ids for o in plain_outputs]
    assert [r for _, r in streamed] == [o.finish_reason for o in plain_outputs]
    assert not llm.engine.grammar_rows().rows
