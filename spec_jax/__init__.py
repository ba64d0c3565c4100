"""spec_jax: speculative decoding for Qwen3.5 / Qwen3.6 GDN-hybrid models in JAX."""

from spec_jax.api.llm import LLM, CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
