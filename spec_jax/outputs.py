"""`vllm.outputs`'s path: the result types of `LLM.generate`."""

from spec_jax.engine.params import CompletionOutput, Logprob, RequestOutput

__all__ = ["CompletionOutput", "Logprob", "RequestOutput"]
