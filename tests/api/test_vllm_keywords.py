"""vLLM's keyword arguments that spec_jax does not have: refused by name with the reason (a
ValueError), never a bare TypeError; a keyword vLLM does not have either stays a TypeError that
names it."""

import dataclasses
import gc
import inspect
import re
import warnings
import weakref

import jax
import pytest

from spec_jax import LLM, EngineArgs, RequestOutput, SamplingParams, TokensPrompt
from spec_jax.api import engine_args
from spec_jax.engine.metrics import Counter, Vector
from spec_jax.utils import FlexibleArgumentParser


@pytest.mark.parametrize("name, value", [("output_kind", 1), ("flat_logprobs", True)])
def test_vllm_sampling_keywords_without_a_field_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\({name}=...\) is vLLM's but not supported here: \w"):
        SamplingParams(**{name: value})


def test_a_misspelt_sampling_keyword_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'temprature'; did you mean 'temperature'"):
        SamplingParams(temprature=0.5)


@pytest.mark.parametrize("name, value, reason", [
    ("hf_overrides", {"rope_theta": 1.0}, "config.json is read as written"),
    ("structured_outputs_config", {"backend": "xgrammar"}, "structured output"),
    ("reasoning_parser", "deepseek_r1", "accepted: None, 'qwen3'"), ("max_loras", 2, "LoRA"),
    ("generation_config", "vllm", "accepted: 'auto'"), ("task", "embed", "only text generation"),
])
def test_vllm_engine_keywords_not_built_are_refused_by_name(tiny_dir, name, value, reason):
    with pytest.raises(ValueError, match=f"{name}=.*{reason}"):
        LLM(str(tiny_dir), **{name: value})


def test_their_neutral_values_load(tiny_dir):
    llm = LLM(str(tiny_dir), max_model_len=64, hf_overrides=None, generation_config="auto", max_loras=None,
              enable_sleep_mode=False)
    assert llm.max_model_len == 64


# ----------------------------------------------------------------------------- vLLM's EngineArgs, every one

TABLES = {"ignored": engine_args.IGNORED, "single device": engine_args.SINGLE_DEVICE,
          "defaults only": engine_args.DEFAULTS_ONLY, "not built": engine_args.NOT_BUILT}


def test_every_vllm_engine_argument_is_classified_once():
    own = set(inspect.signature(LLM.__init__).parameters) - {"self", "kwargs"}
    for name in engine_args.VLLM_ENGINE_ARGS:
        homes = [kind for kind, table in TABLES.items() if name in table]
        homes += ["LLM's own"] * (name in own) + ["used"] * (name in engine_args.USED)
        assert len(homes) == 1, f"{name}: {homes or 'not classified'}"
    assert len(set(engine_args.VLLM_ENGINE_ARGS)) == len(engine_args.VLLM_ENGINE_ARGS) > 140


@pytest.mark.parametrize("name", [n for n in engine_args.VLLM_ENGINE_ARGS if any(n in t for t in TABLES.values())])
def test_a_vllm_argument_is_never_a_type_error(name, monkeypatch):
    """Unset (None) it passes silently; set, it is ignored with a warning naming it and why, or
    refused with a ValueError naming it."""
    monkeypatch.setattr(engine_args, "_said", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine_args.resolve({name: None})
    asked = True if name in engine_args.VLLM_BOOL_ARGS else 7
    if name in engine_args.IGNORED:
        with pytest.warns(UserWarning, match=f"{name}={asked!r} is accepted for vLLM compatibility and ignored: "
                                             f"{re.escape(engine_args.IGNORED[name])}"):
            engine_args.resolve({name: asked})
    else:
        with pytest.raises(ValueError, match=f"^{name}={asked!r}"):
            engine_args.resolve({name: asked})


def test_a_name_vllm_does_not_have_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_modle_len'"):
        engine_args.resolve({"max_modle_len": 64})


def test_engine_args_reads_vllms_flag_spellings(tiny_dir):
    parser = FlexibleArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", str(tiny_dir), "--max_model_len=64", "-tp", "1", "--no-enforce-eager",
                              "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                              "--hf-overrides", "{}", "--dtype", "float32", "--batch-buckets", "1,2"])
    engine = EngineArgs.from_cli_args(args)
    assert (engine.max_model_len, engine.tensor_parallel_size, engine.enforce_eager, engine.hf_overrides,
            engine.batch_buckets, engine.max_loras) == (64, 1, False, {}, [1, 2], None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing given asks for what is not here: no warning
        llm = LLM(**vars(args))
    assert llm.max_model_len == 64 and llm.speculative_config.method == "ngram"
    assert engine.create_llm().engine.config.batch_buckets == (1, 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-model-len", "many"])


def test_engine_args_defaults_are_llms_own():
    fields = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    own = {n: p.default for n, p in inspect.signature(LLM.__init__).parameters.items() if n not in ("self", "kwargs")}
    assert {n: fields[n] for n in own} == own
    assert set(fields) == set(own) | set(engine_args.VLLM_ENGINE_ARGS)
    assert all(fields[n] is None for n in engine_args.VLLM_ENGINE_ARGS if n not in own)


def test_vllms_import_paths_name_spec_jaxs_objects():
    from spec_jax import TextPrompt, TokensPrompt, inputs, outputs, sampling_params
    from spec_jax.distributed import cleanup_dist_env_and_memory
    from spec_jax.utils import argparse_utils
    from spec_jax.v1.metrics import reader

    assert sampling_params.SamplingParams is SamplingParams and outputs.RequestOutput is RequestOutput
    assert (inputs.TokensPrompt, inputs.TextPrompt) == (TokensPrompt, TextPrompt)
    assert TokensPrompt(prompt_token_ids=[1, 2]) == {"prompt_token_ids": [1, 2]}
    assert argparse_utils.FlexibleArgumentParser is FlexibleArgumentParser
    assert (reader.Counter, reader.Vector) == (Counter, Vector)
    assert callable(cleanup_dist_env_and_memory)


def test_cleanup_frees_a_deleted_llms_device_arrays(tiny_dir):
    """Even an LLM that a reference cycle of the script keeps alive after `del`."""
    from spec_jax.distributed import cleanup_dist_env_and_memory

    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    llm = LLM(str(tiny_dir), max_model_len=64)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2))
    cycle = {"llm": llm}
    cycle["self"] = cycle
    model = weakref.ref(llm.model)
    del llm, cycle
    assert model() is not None  # only the cycle holds it now
    cleanup_dist_env_and_memory()
    assert model() is None and {id(x) for x in jax.live_arrays()} <= before
