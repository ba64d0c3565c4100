"""`vllm.utils`'s path for what scripts import from it: `FlexibleArgumentParser`."""

from spec_jax.api.engine_cli import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
