"""Every schema of the corpus (tests/fixtures/json_schemas.json, written by make_json_schemas.py)
constrains the default model, speculating with its MTP head, to a completion that parses and
validates (jsonschema, formats checked), and ends at EOS within the token budget: the grammar's
masks, its forced tokens drafted, its rejections of drafts, all at the real tokenizer's scale."""

import json

import jsonschema
import pytest
from helpers import FIXTURES

from spec_jax import LLM, SamplingParams
from spec_jax.engine.structured import StructuredOutputsParams

CORPUS = json.loads((FIXTURES / "json_schemas.json").read_text())
ROWS = 16


@pytest.fixture(scope="module")
def completions():
    llm = LLM(dtype="float32", max_model_len=640, max_num_seqs=ROWS, batch_buckets=[ROWS],
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    # Compact JSON (no whitespace between tokens): a model may otherwise pad with whitespace forever.
    params = [SamplingParams(max_tokens=600, temperature=0.0, structured_outputs=StructuredOutputsParams(
        json=entry["schema"], disable_any_whitespace=True)) for entry in CORPUS]
    prompts = [f"# {entry['name']} as JSON\n" for entry in CORPUS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0] for o in outs], llm.metrics


def test_the_corpus_has_the_features_it_claims():
    text = json.dumps(CORPUS)
    assert len(CORPUS) >= 200
    for feature in ('"$ref"', '"anyOf"', '"enum"', '"format"', '"required"', '"minItems"', '"maxItems"',
                    '"additionalProperties"', '"pattern"', '"minimum"', '"const"', '"$defs"'):
        assert feature in text, feature


def test_every_constrained_completion_parses_and_validates(completions):
    outputs, metrics = completions
    failures = []
    for entry, out in zip(CORPUS, outputs):
        try:
            value = json.loads(out.text)
            jsonschema.validate(value, entry["schema"], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            assert out.finish_reason == "stop", out.finish_reason
        except (ValueError, jsonschema.ValidationError, AssertionError) as e:
            failures.append((entry["name"], out.text[:120], str(e)[:120]))
    assert not failures, f"{len(failures)} of {len(CORPUS)} failed: {failures[:5]}"
    assert metrics["num_accepted_tokens"] > 0
