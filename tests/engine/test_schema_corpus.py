"""Every schema of the corpus (tests/fixtures/json_schemas.json, written by make_json_schemas.py)
constrains the default model, speculating with its MTP head, to a completion that parses and
validates (jsonschema, formats checked), and ends at EOS within the token budget: the grammar's
masks, its forced tokens drafted, its rejections of drafts, all at the real tokenizer's scale."""

import copy
import json

import jsonschema
import pytest
from helpers import FIXED_K, FIXTURES

from spec_jax import LLM, SamplingParams
from spec_jax.engine.structured import StructuredOutputsParams

CORPUS = json.loads((FIXTURES / "json_schemas.json").read_text())
ROWS = 48
# Draft 2020-12's format checks (time and date-time through rfc3339-validator), with the year 0000 as
# RFC 3339 allows it: Python's date types, which those checks parse with, start at year 1, so such a value
# is checked as year 2000 (a leap year, as the proleptic year 0 is).
FORMATS = copy.deepcopy(jsonschema.Draft202012Validator.FORMAT_CHECKER)


def from_year_zero(name: str):
    check, raises = FORMATS.checkers[name]

    def checked(value) -> bool:
        return check("2000" + value[4:] if isinstance(value, str) and value.startswith("0000-") else value)

    FORMATS.checks(name, raises)(checked)


for name in ("date", "date-time"):
    from_year_zero(name)


@pytest.fixture(scope="module")
def completions():
    # Optimised programs (the suite compiles at XLA's cheapest level): this test runs thousands of steps.
    llm = LLM(dtype="float32", max_model_len=512, max_num_seqs=ROWS, batch_buckets=[ROWS],
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, **FIXED_K},
              compiler_options={"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False})
    # Batches of schemas of alike sizes: a batch runs until its longest completion ends, and a larger
    # schema asks for a longer one (so ordered, the corpus runs about 40% fewer row-steps).
    entries = sorted(CORPUS, key=lambda entry: len(json.dumps(entry["schema"])))
    # Compact JSON (no whitespace between tokens) in closed objects: a small model decoding greedily
    # may otherwise pad with whitespace, or add properties, without end.
    params = [SamplingParams(max_tokens=400, temperature=0.0, structured_outputs=StructuredOutputsParams(
        json=entry["schema"], disable_any_whitespace=True, disable_additional_properties=True))
        for entry in entries]
    prompts = [f"# {entry['name']} as JSON\n" for entry in entries]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(entry, o.outputs[0]) for entry, o in zip(entries, outs)], llm.metrics


def test_the_corpus_has_the_features_it_claims():
    text = json.dumps(CORPUS)
    assert len(CORPUS) >= 200
    assert {"date", "time", "date-time", "email", "uuid", "ipv4"} <= set(FORMATS.checkers)  # each one checked
    for feature in ('"$ref"', '"anyOf"', '"enum"', '"format"', '"required"', '"minItems"', '"maxItems"',
                    '"additionalProperties"', '"pattern"', '"minimum"', '"const"', '"$defs"'):
        assert feature in text, feature


def test_every_constrained_completion_parses_and_validates(completions):
    completed, metrics = completions
    assert len(completed) == len(CORPUS)
    failures = []
    for entry, out in completed:
        try:
            value = json.loads(out.text)
            jsonschema.validate(value, entry["schema"], format_checker=FORMATS)
            assert out.finish_reason == "stop", out.finish_reason
        except (ValueError, jsonschema.ValidationError, AssertionError) as e:
            failures.append((entry["name"], out.text[:120], str(e)[:120]))
    assert not failures, f"{len(failures)} of {len(CORPUS)} failed: {failures[:5]}"
    assert metrics["num_accepted_tokens"] > 0
