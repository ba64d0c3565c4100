"""`vllm.distributed`'s path for `cleanup_dist_env_and_memory`."""

from __future__ import annotations

import gc

import jax


def cleanup_dist_env_and_memory() -> None:
    """Free the device memory of engines no longer referenced (after `del llm`), as vLLM's
    function does before a script builds another: collects them, then drops every compiled
    program (they hold the device buffers of the weights they were traced with)."""
    gc.collect()
    jax.clear_caches()
    gc.collect()


__all__ = ["cleanup_dist_env_and_memory"]
