"""vLLM's `EngineArgs` and `FlexibleArgumentParser`, so that a script which builds its `LLM` from
vLLM's command line (`EngineArgs.add_cli_args(parser)`, then `LLM(**vars(args))` or
`EngineArgs.from_cli_args(args)`) runs with only its imports changed.

`EngineArgs` has a field for each of `LLM`'s own parameters (with `LLM`'s defaults) and one for
every other argument of vLLM's EngineArgs (`engine_args.VLLM_ENGINE_ARGS`, default None: not
given, so `LLM` neither uses nor refuses it). The flags are vLLM's spellings: `--max-model-len`
(or `--max_model_len`), `--enforce-eager` / `--no-enforce-eager`, `-tp 2`, JSON for dicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json

from spec_jax.api.arg_parser import FlexibleArgumentParser
from spec_jax.api.engine_args import VLLM_BOOL_ARGS, VLLM_ENGINE_ARGS
from spec_jax.api.llm import LLM

SHORT_FLAGS = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
               "quantization": "-q"}  # vLLM's one-dash aliases


def integer_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; an argparse error naming the text otherwise."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def json_or_text(text: str):
    """A flag's value as vLLM reads a typed one: JSON where it parses (numbers, true/false, dicts,
    lists), "None" as None, otherwise the text itself."""
    if text == "None":
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def json_object(text: str) -> dict:
    value = json_or_text(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


# `LLM`'s own parameters whose default (None) does not tell their type.
OWN_TYPES = {"max_model_len": int, "max_num_seqs": int, "batch_buckets": integer_list, "compiler_options": json_object,
             "prefix_block_size": int, "prefix_cache_gb": float}


def own_parameters() -> dict[str, object]:
    """`LLM.__init__`'s keyword parameters and their defaults."""
    params = inspect.signature(LLM.__init__).parameters
    return {name: p.default for name, p in params.items() if name != "self" and p.kind is not p.VAR_KEYWORD}


def flag_options(name: str, default) -> dict:
    """argparse options of the flag for field `name` (default: the field's)."""
    if name in VLLM_BOOL_ARGS or isinstance(default, bool):
        return dict(action=argparse.BooleanOptionalAction, default=default)
    kind = OWN_TYPES.get(name) or (type(default) if isinstance(default, (int, float)) else json_or_text)
    return dict(type=str if name in ("model", "tokenizer", "dtype", "layout", "rollback") else kind, default=default)


def make_engine_args():
    """The `EngineArgs` dataclass: `LLM`'s parameters, then vLLM's other arguments (default None)."""
    own = own_parameters()
    fields = [(name, object, dataclasses.field(default=default)) for name, default in own.items()]
    fields += [(name, object, dataclasses.field(default=None)) for name in VLLM_ENGINE_ARGS if name not in own]

    def add_cli_args(parser: argparse.ArgumentParser):
        """Add a flag for every field to `parser` (or an argument group); returns it."""
        for field in dataclasses.fields(EngineArgs):
            flags = ["--" + field.name.replace("_", "-"), *([SHORT_FLAGS[field.name]] if field.name in SHORT_FLAGS
                                                              else [])]
            parser.add_argument(*flags, dest=field.name, **flag_options(field.name, field.default))
        return parser

    def from_cli_args(cls, args: argparse.Namespace):
        """The fields' values from parsed flags (those `add_cli_args` added)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def create_llm(self) -> LLM:
        return LLM(**dataclasses.asdict(self))

    doc = ("vLLM's engine arguments: `LLM`'s own parameters and vLLM's other ones (None: not given). "
           "LLM(**dataclasses.asdict(args)) builds the engine they describe.")
    return dataclasses.make_dataclass("EngineArgs", fields, namespace={
        "__doc__": doc, "__module__": __name__, "add_cli_args": staticmethod(add_cli_args),
        "from_cli_args": classmethod(from_cli_args), "create_llm": create_llm})


EngineArgs = make_engine_args()

__all__ = ["EngineArgs", "FlexibleArgumentParser"]
