"""vLLM-style --speculative-config parsing: methods, aliases, inference, defaults and every refusal."""

import dataclasses
import json
import re
import warnings

import pytest

from proposers.ngram import NgramProposer
from spec_jax.engine.spec_config import (IMPLEMENTED_METHODS, INSTEAD, METHOD_ALIASES, MTP_ALIASES, VLLM_METHODS,
                                         SpeculativeConfig, canonical_method, infer_method, parse_speculative_config)


def parse(spec, **kwargs):
    """Parse with warnings turned into errors, so a test that expects none fails on a stray one."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return parse_speculative_config(spec, **kwargs)


# ----------------------------------------------------------------------------- accepted input

def test_vllm_mtp_example():
    cfg = parse('{"method":"mtp","num_speculative_tokens":1}', target_model="/models/qwen3.5")
    assert (cfg.method, cfg.num_speculative_tokens, cfg.model) == ("mtp", 1, "/models/qwen3.5")
    assert cfg.draft_sample_method == "greedy" and cfg.rejection_sample_method == "standard"


@pytest.mark.parametrize("spec", [None, "", "   "])
def test_no_speculation(spec):
    assert parse(spec) is None


def test_json_string_and_dict_are_equal():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    assert parse(json.dumps(spec)) == parse(spec)


def test_dict_is_not_modified():
    spec = {"method": "qwen3_5_mtp"}
    parse(spec)
    assert spec == {"method": "qwen3_5_mtp"}


def test_ngram_defaults_five_five():
    cfg = parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)


@pytest.mark.parametrize("given, expected", [({"prompt_lookup_min": 2}, (2, 2)), ({"prompt_lookup_max": 7}, (7, 7)),
                                             ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4))])
def test_ngram_one_bound_copies_to_the_other(given, expected):
    cfg = parse({"method": "ngram", "num_speculative_tokens": 3, **given})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == expected


def test_mtp_defaults():
    cfg = parse({"method": "mtp"}, target_model="tgt")
    assert (cfg.num_speculative_tokens, cfg.model, cfg.prompt_lookup_min) == (1, "tgt", None)
    with pytest.warns(UserWarning, match="model='other' is ignored"):  # the MTP head is the target's own
        assert parse_speculative_config({"method": "mtp", "model": "other"}, target_model="tgt").model == "other"
    assert parse({"method": "mtp", "num_speculative_tokens": 3}).num_speculative_tokens == 3


@pytest.mark.parametrize("alias", MTP_ALIASES)
def test_mtp_aliases_fold(alias):
    assert parse({"method": alias}).method == "mtp"
    assert canonical_method(alias) == "mtp"


def test_bracket_ngram_folds():
    assert parse({"method": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"


def test_a_proposer_of_ones_own():
    """custom_class runs the given proposer; with another method it replaces that method's own."""
    mine = NgramProposer(3, 2, 4)
    cfg = parse({"method": "custom_class", "num_speculative_tokens": 3, "proposer": mine})
    assert (cfg.method, cfg.proposer) == ("custom_class", mine) and "proposer=NgramProposer(" in repr(cfg)
    assert hash(cfg) == hash(parse({"method": "custom_class", "num_speculative_tokens": 3, "proposer": mine}))
    assert parse({"method": "ngram", "num_speculative_tokens": 3, "proposer": mine}).proposer is mine
    assert parse({"method": "ngram", "num_speculative_tokens": 3}).proposer is None


def test_custom_class_needs_a_proposer():
    with pytest.raises(ValueError, match="'custom_class' is not implemented: .*give a proposer object as 'proposer'"):
        parse({"method": "custom_class", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'custom_class' needs 'proposer'"):
        SpeculativeConfig("custom_class", 2)


@dataclasses.dataclass  # not frozen: eq without a hash
class Unhashable:
    k: int = 2

    def init_state(self, *args): ...

    def propose(self, *args): ...

    def update(self, *args): ...


@pytest.mark.parametrize("proposer, lacks", [(object(), "init_state, propose, update, k"), (Unhashable(), "__hash__"),
                                             ("ngram", "init_state, propose, update, k")])
def test_a_proposer_must_meet_the_protocol(proposer, lacks):
    with pytest.raises(ValueError, match=f"proposer {type(proposer).__name__} does not meet the Proposer protocol "
                                         rf"\(proposers/__init__.py\): it lacks {lacks}$"):
        parse({"method": "custom_class", "num_speculative_tokens": 2, "proposer": proposer})


def test_a_proposer_drafts_the_configs_k():
    with pytest.raises(ValueError, match="proposer drafts k=3 tokens but num_speculative_tokens is 2"):
        parse({"method": "custom_class", "num_speculative_tokens": 2, "proposer": NgramProposer(3, 2, 4)})


def test_oracle_is_no_engine_method():
    with pytest.raises(ValueError, match="unknown speculative method 'oracle'"):
        parse({"method": "oracle", "num_speculative_tokens": 2})


def test_all_thirteen_vllm_methods_are_known():
    assert len(VLLM_METHODS) == 13
    for method in VLLM_METHODS:
        assert canonical_method(method) == ("ngram" if method == "ngram_gpu" else method)
    assert IMPLEMENTED_METHODS == ("ngram", "mtp", "draft_model", "eagle3", "dflash", "dspark", "suffix")


def test_config_is_frozen_and_hashable():
    cfg = parse({"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_speculative_tokens = 3
    assert hash(cfg) == hash(parse({"method": "ngram", "num_speculative_tokens": 2}))
    assert "method='ngram'" in repr(cfg) and "suffix_decoding" not in repr(cfg)


def test_direct_construction_is_validated():
    assert SpeculativeConfig("qwen3_next_mtp", 2).method == "mtp"
    assert SpeculativeConfig("ngram", 2).prompt_lookup_max == 5
    with pytest.raises(ValueError, match="num_speculative_tokens must be between 1 and 64, got 0"):
        SpeculativeConfig("mtp", 0)


# ----------------------------------------------------------------------------- method inference

@pytest.mark.parametrize("model, method", [
    ("ngram", "ngram"), ("[ngram]", "ngram"), ("my_pkg.proposers.MyProposer", "custom_class"),
    ("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle"), ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
    ("z-lab/Qwen3-8B-DFlash-b16", "dflash"), ("deepseek-ai/DSpark-Qwen3", "dspark"),
    ("Qwen/Qwen3.5-0.8B", "draft_model"), ("/models/draft", "draft_model"), ("https://x.org/a.b", "draft_model"),
])
def test_infer_method(model, method):
    assert infer_method(model) == method


def test_inferred_ngram_parses():
    cfg = parse({"model": "ngram", "num_speculative_tokens": 3})
    assert (cfg.method, cfg.prompt_lookup_min) == ("ngram", 5)


@pytest.mark.parametrize("model, method", [("pkg.Prop", "custom_class"), ("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle")])
def test_inferred_method_not_implemented(model, method):
    with pytest.raises(ValueError, match=f"speculative method '{method}' is not implemented: "):
        parse({"model": model, "num_speculative_tokens": 3})


def test_no_method_no_model_with_k():
    with pytest.raises(ValueError, match="num_speculative_tokens was provided but without speculative model"):
        parse({"num_speculative_tokens": 3})


def test_no_method_no_model():
    with pytest.raises(ValueError, match="needs 'method' or 'model'"):
        parse({})


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("method", [m for m in VLLM_METHODS if m not in IMPLEMENTED_METHODS + ("ngram_gpu",)])
def test_unimplemented_methods_say_what_to_use_instead(method):
    msg = (f"speculative method '{method}' is not implemented: {re.escape(INSTEAD[method])}; implemented: "
           f"{', '.join(IMPLEMENTED_METHODS)}")
    with pytest.raises(ValueError, match=msg):
        parse({"method": method, "num_speculative_tokens": 2, "model": "m"})


def test_every_vllm_method_works_or_says_what_to_use():
    canonical = {METHOD_ALIASES.get(m, m) for m in VLLM_METHODS}
    assert canonical - set(IMPLEMENTED_METHODS) == INSTEAD.keys()
    assert "eagle3" in INSTEAD["eagle"]


def test_ngram_gpu_is_the_device_ngram():
    cfg = parse({"method": "ngram_gpu", "num_speculative_tokens": 3})
    assert (cfg.method, cfg.prompt_lookup_max) == ("ngram", 5)


def test_unknown_method_lists_accepted():
    with pytest.raises(ValueError, match=r"unknown speculative method 'medusa2'; accepted: ngram, medusa, .*dspark.*"
                                         r"qwen3_5_mtp"):
        parse({"method": "medusa2", "num_speculative_tokens": 2})


def test_method_not_a_string():
    with pytest.raises(ValueError, match="method must be a string, got 3"):
        parse({"method": 3})


def test_model_not_a_string():
    with pytest.raises(ValueError, match="model must be a string, got 3"):
        parse({"model": 3, "num_speculative_tokens": 2})


def test_malformed_json():
    with pytest.raises(ValueError, match=r"speculative_config is not valid JSON: .* line 1 column 12"):
        parse('{"method": mtp}')


@pytest.mark.parametrize("spec", ["[1, 2]", "3", "null", '"mtp"'])
def test_json_not_an_object(spec):
    with pytest.raises(ValueError, match="speculative_config must be a JSON object"):
        parse(spec)


def test_spec_of_wrong_python_type():
    with pytest.raises(ValueError, match="must be a dict or a JSON string, got list"):
        parse([("method", "mtp")])


def test_ngram_requires_k():
    with pytest.raises(ValueError, match="num_speculative_tokens is required for speculative method 'ngram'"):
        parse({"method": "ngram"})
    with pytest.raises(ValueError, match="num_speculative_tokens is required for speculative method 'custom_class'"):
        parse({"method": "custom_class", "num_speculative_tokens": None, "proposer": NgramProposer(3, 2, 4)})


@pytest.mark.parametrize("k", [0, -2])
def test_k_must_be_positive(k):
    with pytest.raises(ValueError, match=f"num_speculative_tokens must be between 1 and 64, got {k}"):
        parse({"method": "ngram", "num_speculative_tokens": k})


@pytest.mark.parametrize("k, shown", [("3", r"'3' \(str\)"), (True, r"True \(bool\)"), (2.0, r"2.0 \(float\)")])
def test_k_must_be_an_int(k, shown):
    with pytest.raises(ValueError, match=f"num_speculative_tokens must be int, got {shown}"):
        parse({"method": "mtp", "num_speculative_tokens": k})


def test_k_as_json_string_is_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens must be int, got '3'"):
        parse('{"method": "ngram", "num_speculative_tokens": "3"}')


def test_lookup_min_above_max():
    with pytest.raises(ValueError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2})


@pytest.mark.parametrize("name", ["prompt_lookup_min", "prompt_lookup_max"])
def test_lookup_bound_below_one(name):
    with pytest.raises(ValueError, match=f"{name} must be between 1 and 1024, got 0"):
        parse({"method": "ngram", "num_speculative_tokens": 3, name: 0})


def test_lookup_bound_type():
    with pytest.raises(ValueError, match="prompt_lookup_max must be int or null, got '5'"):
        parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": "5"})


def test_draft_sample_method():
    assert parse({"method": "mtp", "draft_sample_method": "probabilistic"}).draft_sample_method == "probabilistic"
    with pytest.raises(ValueError, match="draft_sample_method must be one of greedy, probabilistic; got 'random'"):
        parse({"method": "mtp", "draft_sample_method": "random"})


def test_rejection_sample_method_unknown():
    with pytest.raises(ValueError, match="rejection_sample_method must be one of standard, synthetic, block; "
                                         "got 'strict'"):
        parse({"method": "mtp", "rejection_sample_method": "strict"})


def test_rejection_sample_method_not_implemented():
    with pytest.raises(ValueError, match="rejection_sample_method 'block' is not implemented yet; "
                                         "implemented: standard, synthetic"):
        parse({"method": "mtp", "rejection_sample_method": "block"})


def test_tensor_parallel_size_is_refused():
    with pytest.raises(ValueError, match="'tensor_parallel_size' .* use 'draft_tensor_parallel_size'"):
        parse({"method": "mtp", "tensor_parallel_size": 2})


def test_mtp_needs_mtp_tensors():
    with pytest.raises(ValueError, match=r"no mtp\.\* tensors \(a GGUF/safetensors export without the MTP head"):
        parse({"method": "qwen3_5_mtp", "num_speculative_tokens": 1}, target_has_mtp=False)
    assert parse({"method": "ngram", "num_speculative_tokens": 1}, target_has_mtp=False).method == "ngram"


def test_ignored_field_type_is_still_checked():
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth must be int, got 'deep'"):
        parse({"method": "mtp", "suffix_decoding_max_tree_depth": "deep"})


# ----------------------------------------------------------------------------- warnings

def test_unknown_field_warns():
    with pytest.warns(UserWarning, match="unknown fields speculative_tokens, foo are ignored"):
        cfg = parse_speculative_config({"method": "mtp", "speculative_tokens": 2, "foo": 1})
    assert cfg.num_speculative_tokens == 1


def test_ignored_vllm_field_with_non_default_value_warns():
    spec = {"method": "mtp", "enforce_eager": True, "suffix_decoding_max_spec_factor": 2,
            "num_speculative_tokens_per_batch_size": [[1, 8, 3]], "target_model_config": {}}
    with pytest.warns(UserWarning, match="vLLM fields enforce_eager, suffix_decoding_max_spec_factor, "
                                         "num_speculative_tokens_per_batch_size, target_model_config are accepted "
                                         "but ignored"):
        cfg = parse_speculative_config(spec)
    assert cfg.enforce_eager is True and cfg.suffix_decoding_max_spec_factor == 2.0
    assert cfg.num_speculative_tokens_per_batch_size == ((1, 8, 3),)
    hash(cfg)


def test_ignored_vllm_fields_at_default_do_not_warn():
    cfg = parse({"method": "mtp", "enforce_eager": None, "parallel_drafting": False,
                 "suffix_decoding_max_tree_depth": 24,
                 "suffix_decoding_min_token_prob": 0.1, "tensor_parallel_size": None})
    assert cfg.method == "mtp"


def test_mtp_alias_of_another_family_warns():
    assert parse({"method": "qwen3_5_mtp"}, target_model_type="qwen3_5_moe").method == "mtp"
    assert parse({"method": "mtp"}, target_model_type="qwen3_next").method == "mtp"
    with pytest.warns(UserWarning, match="'deepseek_mtp' names another model family than the target"):
        parse_speculative_config({"method": "deepseek_mtp"}, target_model_type="qwen3_next")


def test_draft_model_needs_its_checkpoint():
    with pytest.raises(ValueError, match="'draft_model' needs 'model'"):
        parse({"method": "draft_model", "num_speculative_tokens": 3})
    cfg = parse({"model": "/models/Qwen3.5-0.8B", "num_speculative_tokens": 3})
    assert (cfg.method, cfg.model) == ("draft_model", "/models/Qwen3.5-0.8B")


@pytest.mark.parametrize("fields, message", [
    ({"method": "mtp", "num_speculative_tokens": 1000}, "num_speculative_tokens must be between 1 and 64, got 1000"),
    ({"method": "mtp", "num_speculative_tokens": 2**63}, "num_speculative_tokens must be between 1 and 64"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 10**9},
     "prompt_lookup_max must be between 1 and 1024, got 1000000000"),
])
def test_unbounded_k_and_lookup_window_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        parse(fields)


def test_deeply_nested_configs_are_clean_errors():
    with pytest.raises(ValueError, match="nests too deeply"):
        parse("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="synthetic_acceptance_rates nests lists more than 8 deep"):
        parse({"method": "mtp", "num_speculative_tokens": 1, "rejection_sample_method": "synthetic",
               "synthetic_acceptance_rates": [[[[[[[[[[0.5]]]]]]]]]]})


def test_an_mtp_model_other_than_the_target_is_named_as_ignored(tmp_path):
    with pytest.warns(UserWarning, match="method 'mtp' drafts with the target's own MTP head"):
        config = parse_speculative_config({"method": "mtp", "model": str(tmp_path / "other")},
                                          target_model=str(tmp_path / "target"))
    assert config.model == str(tmp_path / "other")  # as vLLM reports it
    parse({"method": "mtp", "model": str(tmp_path / "target")}, target_model=str(tmp_path / "target"))  # no warning
