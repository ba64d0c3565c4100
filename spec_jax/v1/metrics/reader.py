"""`vllm.v1.metrics.reader`'s path: the metric types `LLM.get_metrics()` returns."""

from spec_jax.engine.metrics import Counter, Vector

__all__ = ["Counter", "Vector"]
