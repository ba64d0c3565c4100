"""vLLM's benchmark prompt sets (`vllm.benchmarks.datasets`), as its example scripts call them:
`add_dataset_parser(parser)` adds the flags, `get_samples(args, tokenizer)` returns the prompts.

    parser = FlexibleArgumentParser(); add_dataset_parser(parser); args = parser.parse_args()
    samples = get_samples(args, tokenizer)  # [SampleRequest(prompt=text, prompt_len=..., ...)]

Only the synthetic `random` set (vLLM's default) is built here: prompts of `--random-input-len`
tokens walking the vocabulary from a random offset, after `--random-prefix-len` random tokens
shared by all. The sets vLLM reads from files or the Hugging Face hub are refused by name.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("spec_jax")

# vLLM's --dataset-name choices, and where vLLM reads each set spec_jax does not build
NOT_BUILT = {
    "sharegpt": "a ShareGPT JSON file", "burstgpt": "a BurstGPT CSV trace", "sonnet": "a text file of sonnets",
    "random-mm": "random images beside the text (the models here read text only)",
    "random-rerank": "query-document pairs for a reranker", "hf": "a Hugging Face hub dataset",
    "custom": "a JSONL file of prompts", "prefix_repetition": "shared-prefix prompts",
    "spec_bench": "the SpecBench JSONL file",
}
BUILT = ("random",)
DATASET_NAMES = (*BUILT, *NOT_BUILT)
FIT_RETRIES = 10  # decode / re-encode rounds that bring a random prompt back to its drawn length


@dataclass
class SampleRequest:
    """One benchmark prompt: its text, its length in tokens and the completion length drawn for it."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    multi_modal_data: dict | None = None
    lora_request: None = None
    request_id: str | None = None


def check_dataset_name(name: str, path: str | None) -> None:
    """ValueError unless `name` is a set built here, given without a --dataset-path."""
    if name in NOT_BUILT:
        raise ValueError(f"--dataset-name {name!r} is not built by spec_jax (vLLM reads it from {NOT_BUILT[name]}); "
                         f"built here: {', '.join(BUILT)}")
    if name not in BUILT:
        raise ValueError(f"--dataset-name {name!r} is not one of vLLM's datasets: {', '.join(DATASET_NAMES)}")
    if path is not None:
        raise ValueError(f"--dataset-path {path!r}: the {name!r} set is synthetic and reads no file")


class _DatasetName(argparse.Action):
    """--dataset-name / --dataset-path, checked together as they are parsed."""

    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        try:
            check_dataset_name(namespace.dataset_name, namespace.dataset_path)
        except ValueError as e:
            parser.error(str(e))


def add_dataset_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """vLLM's dataset flags under vLLM's names and defaults: --seed, --num-prompts, --dataset-name,
    --dataset-path, and the random set's --random-input-len / -output-len / -range-ratio / -prefix-len."""
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt sampler")
    parser.add_argument("--num-prompts", type=int, default=1000, help="how many prompts to make")
    parser.add_argument("--dataset-name", type=str, default="random", choices=DATASET_NAMES, action=_DatasetName,
                        help=f"the prompt set; built here: {', '.join(BUILT)}")
    parser.add_argument("--dataset-path", type=str, default=None, action=_DatasetName,
                        help="a dataset file (for the sets vLLM reads from files; none is read here)")
    group = parser.add_argument_group("random dataset options")
    group.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens after the shared prefix")
    group.add_argument("--random-output-len", type=int, default=128, help="completion tokens per request")
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="lengths drawn from [len * (1 - r), len * (1 + r)], r in [0, 1)")
    group.add_argument("--random-prefix-len", type=int, default=0, help="random tokens shared by every prompt")
    return parser


def get_samples(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    """The prompts `args` (from `add_dataset_parser`) ask for, written with `tokenizer` (HF's calls:
    `encode(text, add_special_tokens=)`, `decode`, `vocab_size`, `all_special_ids`)."""
    check_dataset_name(args.dataset_name, args.dataset_path)
    return random_samples(tokenizer, args.num_prompts, input_len=args.random_input_len,
                          output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                          prefix_len=args.random_prefix_len, seed=args.seed)


def check_length(name: str, length) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"{name}={length!r} must be a number of tokens >= 0")


def length_range(length: int, ratio: float, least: int) -> tuple[int, int]:
    """[floor(length * (1 - ratio)), ceil(length * (1 + ratio))], both at least `least`."""
    return max(least, math.floor(length * (1 - ratio))), max(least, math.ceil(length * (1 + ratio)))


def random_samples(tokenizer, num_prompts: int, *, input_len: int, output_len: int, range_ratio: float = 0.0,
                   prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """vLLM's `random` set: per prompt an input and output length drawn uniformly within
    `range_ratio` of the given ones, then `prefix_len` shared random tokens and `input_len`
    consecutive vocabulary ids from a random offset (special tokens skipped), decoded to text and
    re-encoded to that length. The same seed gives the same prompts."""
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"--num-prompts={num_prompts!r} must be a positive number of prompts")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio={range_ratio!r} must be in [0, 1)")
    for name, length in (("--random-input-len", input_len), ("--random-output-len", output_len),
                         ("--random-prefix-len", prefix_len)):
        check_length(name, length)
    added = len(tokenizer.encode("", add_special_tokens=True))  # the tokens the tokenizer adds (BOS, ...)
    in_low, in_high = length_range(max(0, input_len - added), range_ratio, 0)
    if prefix_len + in_low < 1:
        raise ValueError(f"--random-input-len={input_len} with --random-range-ratio={range_ratio} and "
                         f"--random-prefix-len={prefix_len} can draw an empty prompt; raise the input or prefix length")
    out_low, out_high = length_range(output_len, range_ratio, 1)
    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_prompts)
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), tokenizer.all_special_ids)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
    samples, off_by = [], 0
    for i in range(num_prompts):
        walk = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        text, ids = fit_to_length(tokenizer, prefix + walk, prefix_len + int(input_lens[i]), allowed, rng)
        off_by += len(ids) - prefix_len - int(input_lens[i])
        samples.append(SampleRequest(text, len(ids), int(output_lens[i]), request_id=str(i)))
    if off_by:
        log.warning("random prompts: %d tokens %s in all than drawn (decoded text re-encodes differently)",
                    abs(off_by), "more" if off_by > 0 else "fewer")
    return samples


def fit_to_length(tokenizer, ids: list[int], length: int, allowed: np.ndarray,
                  rng: np.random.Generator) -> tuple[str, list[int]]:
    """Text that encodes back to `length` tokens where a few rounds reach it: decode, re-encode,
    then cut what is over or append random allowed ids for what is short. Returns (text, its ids)."""
    for _ in range(FIT_RETRIES):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return text, ids
        ids = ids[:length] + allowed[rng.integers(0, len(allowed), size=max(0, length - len(ids)))].tolist()
    text = tokenizer.decode(ids)
    return text, tokenizer.encode(text, add_special_tokens=False)
