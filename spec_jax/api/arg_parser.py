"""vLLM's `FlexibleArgumentParser`: flags spelt with underscores or dashes alike. Kept apart from
`engine_cli` so that the command line parses without importing the engine."""

from __future__ import annotations

import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser: a flag may be spelt with underscores (`--max_model_len` is
    `--max-model-len`), as vLLM's scripts and users write them."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([dashed(a) for a in args], namespace)


def dashed(arg: str) -> str:
    """'--max_model_len=8' -> '--max-model-len=8'; anything that is not a long flag unchanged."""
    if not arg.startswith("--"):
        return arg
    flag, eq, value = arg.partition("=")
    return flag.replace("_", "-") + eq + value
