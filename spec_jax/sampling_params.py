"""`vllm.sampling_params`'s path: the request type `SamplingParams`."""

from spec_jax.engine.params import SamplingParams

__all__ = ["SamplingParams"]
