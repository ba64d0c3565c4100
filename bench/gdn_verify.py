"""The GDN verify pass on the GPU at Qwen3.6-27B's GDN shape (16 key / 48 value heads, dk = dv =
128) and batch 32: the kernel reading its repeat's tiles in place from the stacked [G, B, nv, dk,
dv] states (`gdn_recurrent_pallas(..., repeat, final_state=False)`, what `gdn_verify` runs) against
the same kernel on a slice copied out of the stack and the pure-JAX reference, checked against
the reference and timed as back-to-back jitted calls.

    python -m bench.gdn_verify --tokens 2 4 16
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_recurrent import gdn_recurrent_pallas, gdn_recurrent_reference, gdn_verify

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")

NK, NV, DK, DV, REPEATS = 16, 48, 128, 128, 4


def call_ms(fn, args, calls: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    return 1e3 * (time.perf_counter() - t) / calls


def rel_error(got, want) -> float:
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def case(B: int, T: int) -> dict:
    keys = jax.random.split(jax.random.key(T), 6)
    q, k = (jax.random.normal(keys[i], (B, T, NK, DK), jnp.bfloat16) for i in (0, 1))
    v = jax.random.normal(keys[2], (B, T, NV, DV), jnp.bfloat16)
    g = -jax.random.uniform(keys[3], (B, T, NV), jnp.float32, 0, 2)
    beta = jax.random.uniform(keys[4], (B, T, NV), jnp.float32)
    states = 0.1 * jax.random.normal(keys[5], (REPEATS, B, NV, DK, DV), jnp.float32)
    args = (q, k, v, g, beta, states, jnp.int32(2))
    def sliced(s, r):
        return jax.lax.dynamic_index_in_dim(s, r, keepdims=False)
    runs = {
        "in_place": jax.jit(lambda *a: gdn_recurrent_pallas(*a, final_state=False)[0]),
        "dispatcher": jax.jit(lambda *a: gdn_verify(*a)[0]),
        "copied_slice": jax.jit(lambda q, k, v, g, b, s, r: gdn_recurrent_pallas(q, k, v, g, b, sliced(s, r))[0]),
        "reference": jax.jit(lambda q, k, v, g, b, s, r: gdn_recurrent_reference(q, k, v, g, b, sliced(s, r))[0]),
    }
    want = runs["reference"](*args)
    row = {"batch": B, "tokens": T}
    for name, fn in runs.items():
        row[f"{name}_ms"] = round(call_ms(fn, args), 4)
        row[f"{name}_rel_err"] = rel_error(fn(*args), want)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 16])
    args = ap.parse_args()
    print(jax.devices()[0].device_kind, flush=True)
    for T in args.tokens:
        print(json.dumps(case(args.batch, T)), flush=True)


if __name__ == "__main__":
    main()
