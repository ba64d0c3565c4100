"""vLLM's `vllm.v1` import paths that scripts use (`spec_jax.v1.metrics.reader`)."""
