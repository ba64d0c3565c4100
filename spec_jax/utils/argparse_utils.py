"""`vllm.utils.argparse_utils`'s path: `FlexibleArgumentParser`."""

from spec_jax.api.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
