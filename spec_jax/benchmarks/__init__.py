"""`vllm.benchmarks`'s path for what example scripts import from it: `datasets`."""
