"""Where a speculative step's time goes: the target forward for 1 token (decode) against k+1
tokens (verify) with each rollback, the commit, and the logits, each jitted and timed over
back-to-back calls on a random model of a real geometry.

    python -m bench.verify_cost --geometry 0.8b --batch 1 8 --k 1 3 [--quantization nvfp4]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.models import GEOMETRIES, add_layout_flag, geometry_config, layout_name, random_model
from models.qwen3_5 import init_cache
from pallas_kernels.quant_formats import FORMATS
from spec_jax.engine.config import default_decode_layout
from spec_jax.engine.step import verify_pass


def timed(fn, *args, reps: int = 50) -> float:
    """Median-free mean over back-to-back calls after a warm-up (ms)."""
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t) / reps


def build_model(geometry: str, quantization: str | None = None, rolled: bool = False, layers: int | None = None):
    """(config, graphdef, params) of a random bf16 model of a geometry (its first `layers` layers
    if given) made on the device, its projections in a weight-only format if given, in the layout
    the engine runs (the decode layout on the GPU) unless `rolled`."""
    model = random_model(geometry_config(geometry, layers), quantization=quantization)
    if default_decode_layout() and not rolled:
        model.use_decode_layout()
    gdef, params = nnx.split(model)
    return model.cfg, gdef, params


def make_forward(gdef, kv_len: int):
    """forward(params, tokens, start, cache, rollback, with_logits) -> (logits or hidden, cache):
    the speculative step's target pass (`verify_pass`) over tokens [B, T] at positions start; with
    a rollback it commits T // 2 + 1 tokens (the verify step's bookkeeping)."""

    def forward(params, tokens, start, cache, rollback, with_logits):
        m = nnx.merge(gdef, params)
        out = verify_pass(m, cache, tokens, start, jnp.full_like(start, tokens.shape[1]), kv_len=kv_len,
                          rollback=rollback)
        hidden, cache = out.hidden, out.cache
        if rollback is not None:
            cache = m.commit(cache, out.pending, jnp.full_like(start, tokens.shape[1] // 2 + 1))
        return (m.logits(hidden) if with_logits else hidden), cache

    return forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="0.8b", choices=GEOMETRIES)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--context", type=int, default=384, help="tokens already in the cache")
    ap.add_argument("--cache-len", type=int, default=512)
    add_layout_flag(ap)
    ap.add_argument("--quantization", choices=FORMATS, default=None, help="weight-only format of the projections")
    args = ap.parse_args()
    cfg, gdef, params = build_model(args.geometry, args.quantization, args.rolled_layers)
    L = args.cache_len
    forward = make_forward(gdef, L)

    for B in args.batch:
        cache = init_cache(cfg, B, L, jnp.bfloat16)
        start = jnp.full((B,), args.context, jnp.int32)
        runs = [("decode", 1, None)] + [(f"verify k={k} {rb}", k + 1, rb) for k in args.k
                                         for rb in ("checkpoint", "replay")]
        base = None
        for name, T, rb in runs:
            tokens = jnp.ones((B, T), jnp.int32)
            row = {"batch": B, "pass": name, "layers": layout_name(args.rolled_layers),
                   "quantization": args.quantization}
            for with_logits in (False, True):
                fn = jax.jit(lambda p, t, s, c, rb=rb, wl=with_logits: forward(p, t, s, c, rb, wl))
                row["ms_with_logits" if with_logits else "ms_body"] = timed(fn, params, tokens, start, cache)
            base = base or row["ms_with_logits"]
            row["over_decode"] = row["ms_with_logits"] / base
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
