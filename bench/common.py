"""What every benchmark measures the same way: the device's two ceilings, taken in the same run.

A floor is stated against the copy rate and matmul rate of the device the figure came from (an
H100 copies at about 3.0 TB/s, an H200 at about 4.3, with the same matmul rate), never a constant.

    from bench.common import Ceilings
    ceilings = Ceilings.measure()       # ~2 s on a GPU
    floor_s = ceilings.floor_s(bytes_moved, flops)
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp


def loop_time_s(step, carry, reps: int) -> float:
    """Mean seconds of `step` over `reps` iterations of one jitted fori_loop (the second run)."""
    run = jax.jit(lambda c: jax.lax.fori_loop(0, reps, lambda i, c: step(c), c))
    jax.block_until_ready(run(carry))
    t = time.perf_counter()
    jax.block_until_ready(run(carry))
    return (time.perf_counter() - t) / reps


def copy_rate(reps: int = 20) -> float:
    """Bytes per second of an elementwise pass over 2 GiB of random bf16, read plus written: one
    jitted call after another, each on the last one's output (inside one loop XLA folds the
    repeated passes into one)."""
    step = jax.jit(lambda a: a * jnp.bfloat16(0.999))
    x = jax.block_until_ready(step(jax.random.normal(jax.random.key(0), (1 << 30,), jnp.bfloat16)))
    t = time.perf_counter()
    for _ in range(reps):
        x = step(x)
    jax.block_until_ready(x)
    return 2 * x.nbytes * reps / (time.perf_counter() - t)


def matmul_rate(n: int = 8192) -> float:
    """FLOP per second of a bf16 n x n x n matmul on random data, the product fed back so that
    nothing is hoisted out of the loop."""
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16) / n**0.5

    def step(x):
        return jnp.dot(x, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    return 2 * n**3 / loop_time_s(step, a, reps=20)


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """The device's measured copy rate (B/s, read plus written) and bf16 matmul rate (FLOP/s)."""

    device: str
    copy_B_s: float
    matmul_FLOP_s: float

    @classmethod
    def measure(cls) -> "Ceilings":
        return cls(jax.devices()[0].device_kind, copy_rate(), matmul_rate())

    def floor_s(self, nbytes: float = 0.0, flops: float = 0.0) -> float:
        """The larger of the time to move `nbytes` and to do `flops` at these rates."""
        return max(nbytes / self.copy_B_s, flops / self.matmul_FLOP_s)

    def summary(self) -> str:
        return (f"{self.device}: copy {self.copy_B_s / 1e12:.2f} TB/s, bf16 matmul "
                f"{self.matmul_FLOP_s / 1e12:.0f} TFLOP/s (measured now)")


def peak_memory_GB() -> float | None:
    """The device allocator's peak bytes in use so far, in GB (None where it reports none)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in stats else None
