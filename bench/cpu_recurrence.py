"""The recurrent gated delta rule on the CPU, unrolled against rolled: compile and run time of
`gdn_recurrent_reference` per pass length T, at one Qwen3.5 head layout (16 key heads, 32 value
heads, dk = dv = 128, batch 1) and the tests' tiny one, with and without every state kept. This
is what sets `CPU_MAX_UNROLL`.

    python -m bench.cpu_recurrence [--runs 20]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_recurrent import gdn_recurrent_reference

LAYOUTS = {"qwen3.5 (16/32 heads, 128)": (1, 16, 32, 128), "tiny (2/4 heads, 32), batch 4": (4, 2, 4, 32)}


def inputs(B: int, T: int, nk: int, nv: int, d: int):
    keys = jax.random.split(jax.random.key(0), 5)
    q, k = (jax.random.normal(key, (B, T, nk, d)) for key in keys[:2])
    v = jax.random.normal(keys[2], (B, T, nv, d))
    g = -jax.random.uniform(keys[3], (B, T, nv))
    beta = jax.random.uniform(keys[4], (B, T, nv))
    return q, k, v, g, beta, jnp.zeros((B, nv, d, d))


def timed(fn, args, runs: int) -> tuple[float, float]:
    """(compile s, run ms a call)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(runs):
        jax.block_until_ready(fn(*args))
    return compile_s, (time.perf_counter() - t0) / runs * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    print("| layout | T | states kept | unrolled: compile s / run ms | rolled: compile s / run ms |")
    print("|---|---|---|---|---|")
    for name, (B, nk, nv, d) in LAYOUTS.items():
        for T in (2, 4, 8, 16):
            for keep in (False, True):
                x = inputs(B, T, nk, nv, d)
                cells = []
                for unroll in (True, False):
                    fn = jax.jit(lambda *a, u=unroll, kp=keep: gdn_recurrent_reference(*a, keep_states=kp, unroll=u))
                    cells.append("%.2f / %.2f" % timed(fn, x, args.runs))
                print(f"| {name} | {T} | {'yes' if keep else 'no'} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
