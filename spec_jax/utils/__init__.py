"""`vllm.utils`'s path for what scripts import from it: `FlexibleArgumentParser`."""

from spec_jax.api.arg_parser import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
