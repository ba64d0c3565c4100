"""Pallas kernels on the GPU: compile, check against the pure-JAX reference on random data, and
time against XLA's version of the same op, each inside one jitted fori_loop.

    python bench/kernels.py --json out.jsonl

GDN recurrent (decode T = 1, verify T = k + 1 with every state kept) at Qwen3.5 head layouts
(16 key heads; 16 / 32 / 48 value heads; dk = dv = 128). Bytes counted: q, k, v, gates read once,
the state read and written once (plus T states written when kept), outputs written once.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gdn_recurrent import gdn_recurrent_pallas, gdn_recurrent_reference

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")


def loop_time_us(step, carry, reps: int = 200) -> float:
    """Mean time of `step` over `reps` iterations of one jitted fori_loop (carry threads through)."""
    run = jax.jit(lambda c: jax.lax.fori_loop(0, reps, lambda i, c: step(c), c))
    jax.block_until_ready(run(carry))
    t = time.perf_counter()
    jax.block_until_ready(run(carry))
    return 1e6 * (time.perf_counter() - t) / reps


def gdn_case(B, T, nv, keep, rng):
    nk, d = 16, 128
    f = lambda *s, dt=jnp.bfloat16: jnp.asarray(rng.normal(size=s), dt)
    q, k, v = f(B, T, nk, d), f(B, T, nk, d), f(B, T, nv, d)
    g = -jnp.asarray(rng.uniform(0, 2, (B, T, nv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(B, T, nv)), jnp.float32)
    s0 = f(B, nv, d, d, dt=jnp.float32)
    got = gdn_recurrent_pallas(q, k, v, g, beta, s0, keep_states=keep)
    want = gdn_recurrent_reference(q, k, v, g, beta, s0, keep_states=keep)
    errs = [float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(got, want)]

    def stepper(fn):
        return lambda s: fn(q, k, v, g, beta, s, keep_states=keep)[1]

    t_kernel = loop_time_us(stepper(gdn_recurrent_pallas), s0)
    t_xla = loop_time_us(stepper(gdn_recurrent_reference), s0)
    state_bytes = B * nv * d * d * 4
    nbytes = 2 * state_bytes + (T * state_bytes if keep else 0) + q.nbytes + k.nbytes + v.nbytes + B * T * nv * d * 4
    return {"op": "gdn_recurrent", "B": B, "T": T, "nv": nv, "keep_states": keep, "max_rel_err": max(errs),
            "kernel_us": t_kernel, "xla_us": t_xla, "speedup_vs_xla": t_xla / t_kernel,
            "kernel_GB_s": nbytes / t_kernel / 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for nv in (16, 32, 48):
        for B in (1, 8):
            for T, keep in ((1, False), (2, True), (4, True), (4, False)):
                row = gdn_case(B, T, nv, keep, rng)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
