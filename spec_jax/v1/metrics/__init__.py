"""`vllm.v1.metrics`'s path (`reader`)."""
