"""`LLM.get_tokenizer()` answers HF's common tokenizer calls as HF transformers does on the same
files: every call recorded from transformers on the default model's tokenizer
(tests/fixtures/make_tokenizer_fixture.py writes hf_tokenizer_calls.json) is repeated here."""

import json
from pathlib import Path

import pytest

from spec_jax import LLM

RECORD = json.loads((Path(__file__).parents[1] / "fixtures" / "hf_tokenizer_calls.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    return LLM(max_model_len=64).get_tokenizer()  # the embedded default model


@pytest.mark.parametrize("call", RECORD["calls"], ids=lambda c: f"{c['method']}-{sorted(c['kwargs'].items())}")
def test_each_recorded_call_answers_as_hf(tokenizer, call):
    assert getattr(tokenizer, call["method"])(*call["args"], **call["kwargs"]) == call["result"]


@pytest.mark.parametrize("name", sorted(RECORD["attributes"]))
def test_special_tokens_and_sizes_are_hfs(tokenizer, name):
    assert getattr(tokenizer, name) == RECORD["attributes"][name]
    assert len(tokenizer) == RECORD["len"]


def test_a_tokenizer_set_by_the_user_is_returned_as_given():
    llm = LLM(max_model_len=64)
    mine = llm.get_tokenizer()
    llm.set_tokenizer(mine)
    assert llm.get_tokenizer() is mine
