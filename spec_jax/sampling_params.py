"""vLLM's `vllm.sampling_params` module path, so a vLLM script's `from vllm.sampling_params import ...`
becomes `from spec_jax.sampling_params import ...`: the request types, defined in `spec_jax.engine`."""

from spec_jax.engine.params import SamplingParams
from spec_jax.engine.structured import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams"]
