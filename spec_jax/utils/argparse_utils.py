"""`vllm.utils.argparse_utils`'s path: `FlexibleArgumentParser`."""

from spec_jax.api.engine_cli import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
