"""The share of the GPU's memory the JAX allocator may take, set as vLLM's `gpu_memory_utilization`.

JAX's GPU client reads its share once, from the environment, when the backend starts (75% unless
told otherwise: on an 80 GB card with the 27B's 54.6 GB of bf16 weights that leaves about 5 GB
for caches). So the share is set before anything touches a device; a backend already started
keeps what it started with, and that is said, with how to change it.
"""

from __future__ import annotations

import logging
import os

from jax._src import xla_bridge

log = logging.getLogger("spec_jax")

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
JAX_DEFAULT_SHARE = 0.75  # the GPU client's own default, when no variable names one
SHARE_VARIABLES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")  # jax's name, its deprecated one


def share_from_environment() -> tuple[str | None, float]:
    """The variable that names the allocator's share, if one does, and that share."""
    for name in SHARE_VARIABLES:
        if os.environ.get(name):
            return name, float(os.environ[name])
    return None, JAX_DEFAULT_SHARE


def claim_device_memory(utilization: float | None) -> float:
    """Let the JAX allocator take `utilization` of each GPU's memory (None: the environment's
    share if it names one, else `DEFAULT_GPU_MEMORY_UTILIZATION`). Returns the share in force.

    Before the backend starts this sets the variable the GPU client reads. After, the share is
    fixed: a smaller one than asked for is logged as a warning that says how to get the asked one.
    """
    variable, current = share_from_environment()
    if xla_bridge.backends_are_initialized():
        wanted = DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None and variable is None else utilization
        if wanted is not None and current < wanted - 1e-3 and xla_bridge.get_backend().platform == "gpu":
            log.warning("gpu_memory_utilization=%s cannot take effect: JAX started before this LLM with %.0f%% of "
                        "the GPU's memory (%s). Build the LLM before any JAX computation, or set "
                        "XLA_CLIENT_MEM_FRACTION=%s in the environment before JAX starts.", wanted, 100 * current,
                        f"{variable}={os.environ[variable]}" if variable else "its default", wanted)
        return current
    if utilization is None and variable is not None:
        return current
    share = DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
    os.environ[variable or SHARE_VARIABLES[0]] = str(share)
    return share
