"""vLLM's keyword arguments that spec_jax does not have: refused by name with the reason (a
ValueError), never a bare TypeError; a keyword vLLM does not have either stays a TypeError that
names it."""

import pytest

from spec_jax import LLM, SamplingParams


@pytest.mark.parametrize("name, value", [("structured_outputs", object()), ("guided_decoding", object()),
                                         ("output_kind", 1), ("flat_logprobs", True)])
def test_vllm_sampling_keywords_without_a_field_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\({name}=...\) is vLLM's but not supported here: \w"):
        SamplingParams(**{name: value})


def test_a_misspelt_sampling_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'temprature'; did you mean 'temperature'"):
        SamplingParams(temprature=0.5)


@pytest.mark.parametrize("name, value, reason", [
    ("hf_overrides", {"rope_theta": 1.0}, "config.json is read as written"),
    ("structured_outputs_config", {"backend": "xgrammar"}, "structured output"),
    ("reasoning_parser", "qwen3", "--reasoning-parser"), ("max_loras", 2, "LoRA"),
    ("generation_config", "vllm", "accepted: 'auto'"), ("task", "embed", "only text generation"),
])
def test_vllm_engine_keywords_not_built_are_refused_by_name(tiny_dir, name, value, reason):
    with pytest.raises(ValueError, match=f"{name}=.*{reason}"):
        LLM(str(tiny_dir), **{name: value})


def test_their_neutral_values_load(tiny_dir):
    llm = LLM(str(tiny_dir), max_model_len=64, hf_overrides=None, generation_config="auto", max_loras=None,
              enable_sleep_mode=False)
    assert llm.max_model_len == 64
