"""spec_jax: speculative decoding for Qwen3.5 / Qwen3.6 GDN-hybrid models in JAX."""

import logging
import os


def configure_logging() -> None:
    """Log lines on stderr, as vLLM prints them: INFO by default (SPEC_JAX_LOGGING_LEVEL sets the
    level; SPEC_JAX_CONFIGURE_LOGGING=0 leaves the "spec_jax" logger to the application)."""
    if os.environ.get("SPEC_JAX_CONFIGURE_LOGGING", "1") == "0":
        return
    logger = logging.getLogger("spec_jax")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [spec_jax] %(message)s", "%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(os.environ.get("SPEC_JAX_LOGGING_LEVEL", "INFO").upper())


configure_logging()

from spec_jax.api.engine_cli import EngineArgs  # noqa: E402
from spec_jax.api.llm import LLM  # noqa: E402
from spec_jax.engine.params import CompletionOutput, Logprob, RequestOutput, SamplingParams  # noqa: E402
from spec_jax.engine.structured import GuidedDecodingParams, StructuredOutputsParams  # noqa: E402
from spec_jax.inputs import TextPrompt, TokensPrompt  # noqa: E402

__all__ = ["LLM", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "TextPrompt",
           "TokensPrompt", "StructuredOutputsParams", "GuidedDecodingParams"]
