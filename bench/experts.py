"""The routed-expert kernels at Qwen3.6-35B-A3B's expert shape (256 experts, H 2048, I 512, top 8),
from one decode row to a 16,384-token prefill, against the floor measured on this device.

    python -m bench.experts                          # every path and tiling at every size
    python -m bench.experts --tokens 1 8 1024        # some sizes

Per size and path: time per call (wall time of calls back to back, cycling over 4 routings so no
one expert set stays in L2), the error against the gathering reference (on the first 64 tokens
for sizes the reference cannot hold), and the share of the floor: the larger of the distinct
chosen experts' bytes at the copy rate and 2 x pairs x 3 x I x H FLOPs at the matmul rate.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import Ceilings
from pallas_kernels import expert_grouped, expert_matmul

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")

E, H, INNER, K = 256, 2048, 512, 8
CHECKED_TOKENS = 64
TILINGS = [expert_grouped.GroupTiling(m, n, kk, w, s) for m, n, kk, w, s in (
    (16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (16, 64, 256, 4, 2), (32, 128, 64, 4, 3), (64, 128, 64, 4, 3),
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 128, 8, 2))]


def runs_for(tokens: int) -> dict:
    """The paths worth timing at this size."""
    runs = {}
    if tokens <= 32:
        runs["gather (XLA)"] = expert_matmul.expert_swiglu_reference
        runs["gemv kernel"] = expert_matmul.expert_swiglu_pallas
    for t in TILINGS:
        if t.block_m <= max(16, 2 * tokens * K // E):  # taller tiles than an expert's share only pad
            runs[f"grouped m{t.block_m} n{t.block_n} k{t.block_k} w{t.num_warps} s{t.num_stages}"] = \
                functools.partial(expert_grouped.expert_swiglu_grouped_pallas, tiling=t)
    runs["dispatcher"] = expert_matmul.expert_swiglu
    return runs


def call_us(fn, x, gate_up, down, routings, w, rounds: int = 10) -> float:
    """Microseconds a call, over `rounds` passes through the routings, calls queued back to back."""
    jax.block_until_ready([fn(x, gate_up, down, r, w) for r in routings])
    t = time.perf_counter()
    outs = [fn(x, gate_up, down, r, w) for _ in range(rounds) for r in routings]
    jax.block_until_ready(outs)
    return 1e6 * (time.perf_counter() - t) / (rounds * len(routings))


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def size_rows(rng, ceilings: Ceilings, gate_up, down, tokens: int) -> list[dict]:
    x = jnp.asarray(rng.normal(size=(tokens, H)), jnp.bfloat16)
    routings = [jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)]), jnp.int32)
                for _ in range(4)]
    w = jnp.asarray(rng.dirichlet(np.ones(K), size=tokens), jnp.bfloat16)
    checked = min(tokens, CHECKED_TOKENS)
    want = expert_matmul.expert_swiglu_reference(x[:checked], gate_up, down, routings[0][:checked], w[:checked])
    expert_bytes = (gate_up.nbytes + down.nbytes) / E
    distinct = np.mean([len(np.unique(np.asarray(r))) for r in routings])
    floor = ceilings.floor_s(distinct * expert_bytes, 2 * tokens * K * 3 * INNER * H)
    rows = []
    for name, fn in runs_for(tokens).items():
        err = rel_error(fn(x, gate_up, down, routings[0], w)[:checked], want)
        us = call_us(jax.jit(fn), x, gate_up, down, routings, w)
        row = {"tokens": tokens, "pairs": tokens * K, "run": name, "rel_err": round(err, 5), "us": round(us, 1),
               "floor_us": round(1e6 * floor, 1), "of_floor": round(1e6 * floor / us, 3)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 32, 128, 1024, 4096, 16384])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ceilings = Ceilings.measure()
    print(ceilings.summary(), flush=True)
    kg, kd = jax.random.split(jax.random.key(0))  # 1.6 GB, made on the device
    gate_up = (jax.random.normal(kg, (E, 2 * INNER, H), jnp.float32) / H**0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (E, H, INNER), jnp.float32) / INNER**0.5).astype(jnp.bfloat16)
    rng = np.random.default_rng(0)
    rows = [row for n in args.tokens for row in size_rows(rng, ceilings, gate_up, down, n)]
    print(f"{'tokens':>6} {'best run':<40} {'us':>9} {'of floor':>8}   dispatcher us")
    for n in args.tokens:
        mine = [r for r in rows if r["tokens"] == n and r["run"] != "dispatcher"]
        best = min(mine, key=lambda r: r["us"])
        chosen = next(r for r in rows if r["tokens"] == n and r["run"] == "dispatcher")
        print(f"{n:>6} {best['run']:<40} {best['us']:>9.1f} {best['of_floor']:>8.1%}   {chosen['us']:.1f} "
              f"({chosen['of_floor']:.1%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": vars(ceilings), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
