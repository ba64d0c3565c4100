"""`vllm.benchmarks.datasets`'s path: `add_dataset_parser`, `get_samples`, `SampleRequest`
(the `random` set only; the others are refused by name)."""

from spec_jax.api.benchmark_datasets import SampleRequest, add_dataset_parser, get_samples

__all__ = ["SampleRequest", "add_dataset_parser", "get_samples"]
