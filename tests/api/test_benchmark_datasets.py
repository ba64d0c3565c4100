"""vLLM's `vllm.benchmarks.datasets` at `spec_jax.benchmarks.datasets`: its flags and defaults, the
synthetic `random` set written with HF transformers' tokenizer or `LLM.get_tokenizer()`'s alike, and
the sets read from files or the hub refused by name."""

import argparse
import os
import re

import pytest
from transformers import AutoTokenizer

from spec_jax.api.chat import ChatTemplate, ChatTokenizer, tokenizer_config
from spec_jax.api.benchmark_datasets import random_samples
from spec_jax.benchmarks.datasets import add_dataset_parser, get_samples
from spec_jax.default_model import default_model_dir
from spec_jax.loading.tokenizer import Tokenizer
from spec_jax.utils import FlexibleArgumentParser


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture(scope="module")
def own_tokenizer():
    folder = default_model_dir()
    return ChatTokenizer(Tokenizer(folder / "tokenizer.json"), ChatTemplate.of_checkpoint(folder),
                         tokenizer_config(folder))


def parse(*flags):
    return add_dataset_parser(FlexibleArgumentParser()).parse_args(list(flags))


def test_flags_and_defaults_are_vllms():
    args = parse()
    assert (args.dataset_name, args.dataset_path, args.num_prompts, args.seed) == ("random", None, 1000, 0)
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio, args.random_prefix_len) == \
        (1024, 128, 0.0, 0)
    args = parse("--num_prompts", "3", "--random-input-len=9", "--random_range_ratio", "0.25", "--seed", "4")
    assert (args.num_prompts, args.random_input_len, args.random_range_ratio, args.seed) == (3, 9, 0.25, 4)


def test_the_tokenizers_special_ids_are_hfs(hf_tokenizer, own_tokenizer):
    assert own_tokenizer.all_special_ids == hf_tokenizer.all_special_ids
    assert own_tokenizer.vocab_size == hf_tokenizer.vocab_size


def test_random_prompts_have_their_drawn_lengths_and_no_special_token(hf_tokenizer):
    rng_ratio, prefix = 0.5, 4
    samples = get_samples(parse("--num-prompts", "6", "--random-input-len", "20", "--random-output-len", "7",
                                "--random-range-ratio", str(rng_ratio), "--random-prefix-len", str(prefix),
                                "--seed", "3"), hf_tokenizer)
    assert [s.request_id for s in samples] == [str(i) for i in range(6)]
    for s in samples:
        ids = hf_tokenizer.encode(s.prompt, add_special_tokens=False)
        assert len(ids) == s.prompt_len and prefix + 10 <= s.prompt_len <= prefix + 30
        assert 3 <= s.expected_output_len <= 11 and s.multi_modal_data is None
        assert not set(ids) & set(hf_tokenizer.all_special_ids)
    assert len(os.path.commonprefix([s.prompt for s in samples])) > 0  # the shared random prefix
    assert len({s.prompt_len for s in samples}) > 1  # lengths drawn, not fixed


def test_the_same_seed_gives_the_same_prompts_with_either_tokenizer(hf_tokenizer, own_tokenizer):
    def draw(tokenizer, seed):
        return random_samples(tokenizer, 4, input_len=12, output_len=5, range_ratio=0.3, seed=seed)

    assert draw(hf_tokenizer, 7) == draw(own_tokenizer, 7) == draw(hf_tokenizer, 7)
    assert draw(hf_tokenizer, 7) != draw(hf_tokenizer, 8)
    assert all(s.prompt_len == 12 for s in random_samples(own_tokenizer, 3, input_len=12, output_len=5))


@pytest.mark.parametrize("flags, message", [
    (["--dataset-name", "sharegpt"], "'sharegpt' is not built by spec_jax .*built here: random"),
    (["--dataset-name", "hf"], "'hf' is not built by spec_jax .*hub.*built here: random"),
    (["--dataset-path", "prompts.jsonl"], "'prompts.jsonl': the 'random' set is synthetic and reads no file"),
])
def test_sets_not_built_here_are_refused_by_name_at_parse(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse(*flags)
    assert re.search(message, capsys.readouterr().err)


def test_get_samples_refuses_what_the_parser_would(hf_tokenizer):
    args = argparse.Namespace(**{**vars(parse()), "dataset_name": "spec_bench"})
    with pytest.raises(ValueError, match="'spec_bench' is not built by spec_jax.*built here: random"):
        get_samples(args, hf_tokenizer)


@pytest.mark.parametrize("kwargs, message", [
    ({"range_ratio": 1.0}, r"--random-range-ratio=1.0 must be in \[0, 1\)"),
    ({"input_len": 0}, "can draw an empty prompt"),
    ({"input_len": -3}, "--random-input-len=-3 must be a number of tokens >= 0"),
    ({"prefix_len": 1.5}, "--random-prefix-len=1.5 must be a number of tokens"),
    ({"num_prompts": 0}, "--num-prompts=0 must be a positive number of prompts"),
])
def test_bad_random_settings_are_named(hf_tokenizer, kwargs, message):
    settings = {"num_prompts": 2, "input_len": 8, "output_len": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        random_samples(hf_tokenizer, settings.pop("num_prompts"), **settings)
