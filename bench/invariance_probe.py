"""Which part of the target breaks batch invariance on this device: in batch-invariant mode, each
part computes the same token alone (T = 1, batch 1) and inside other passes (a 4-token verify, a
batch of 8, 64 and 65 tokens), each pass its own compiled program, and the largest |difference|
of that token's output is printed (0.0 everywhere when the mode holds). Parts: every projection of
the first layer group, the lm_head, a norm, attention, the gated delta rule, then the whole model
layer by layer (decode against verify, prefill beside other rows, a batch of 8 decoding).

    python -m bench.invariance_probe --geometry 27b --layers 4 --out results/invariance_27b.json

With --cost, what the mode costs part by part instead: each part's ms with the mode and without
it, at a decode step of one row (B1 T1) and a verify of 4 tokens in 8 rows (B8 T4), each
projection shape once (the projections whose (K, N) repeat are the same program).

    python -m bench.invariance_probe --geometry 27b --layers 4 --cost --out results/mode_cost_27b.json

Random weights of a released geometry, made on the device, in the engine's decode layout. Each
part's line is printed (and the file rewritten) as it finishes, so a run cut short keeps them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.models import geometry_config, random_model
from bench.verify_cost import timed as timed_ms
from models.layers import Batch, Linear, attend
from models.qwen3_5 import init_cache
from pallas_kernels.batch_invariant import batch_invariant, invariant_tile_rows
from pallas_kernels.gdn_recurrent import gdn_recurrent

CACHE = 256  # cache slots of the whole-model passes


def largest_difference(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


def jit_with_weights(fn, module: nnx.Module):
    """jax.jit of fn(module, *a) with the module's weights as arguments rather than constants
    baked into each program."""
    graphdef, state = nnx.split(module)
    run = jax.jit(lambda state, *a: fn(nnx.merge(graphdef, state), *a))
    return lambda *a: run(state, *a)


def jit_part(fn):
    """jax.jit of a part: a module, a module's bound method, or a plain function."""
    module, method = (fn, "__call__") if isinstance(fn, nnx.Module) else (getattr(fn, "__self__", None),
                                                                          getattr(fn, "__name__", None))
    if not isinstance(module, nnx.Module):
        return jax.jit(fn)
    return jit_with_weights(lambda m, *a: getattr(m, method)(*a), module)


def token_in_passes(fn, make) -> dict:
    """fn(*make(B, T))'s first output at row 0, token 0, for (B, T) = (1, 1) against 4-token,
    8-row, 64- and 65-token passes: {pass: largest |difference|}."""
    run = jit_part(fn)
    first = lambda out: (out[0] if isinstance(out, tuple) else out)[0, 0]  # noqa: E731
    alone = first(run(*make(1, 1)))
    return {f"B{B} T{T}": largest_difference(alone, first(run(*make(B, T))))
            for B, T in ((1, 4), (8, 1), (1, 64), (1, 65))}


def cost_in_passes(fn, make) -> dict:
    """{pass: {"default": ms, "mode": ms, "ratio": mode / default}} of fn at a one-row decode
    step and a 4-token verify of 8 rows, each traced once outside the mode and once in it (mean
    of 20 back-to-back calls after a compiling one)."""
    out = {}
    for B, T in ((1, 1), (8, 4)):
        args = make(B, T)
        timed = {}
        for label, rows in (("default", None), ("mode", invariant_tile_rows())):
            with batch_invariant(rows):
                timed[label] = timed_ms(jit_part(fn), *args, reps=20)
        out[f"B{B} T{T}"] = {**timed, "ratio": timed["mode"] / timed["default"]}
    return out


def distinct_shapes(named_parts):
    """The parts with a projection of each (K, N) once: the others compile to the same program."""
    seen = set()
    for name, fn, make in named_parts:
        shape = (fn.weight.shape[-1], fn.weight.shape[0]) if isinstance(fn, Linear) else name
        if shape not in seen:
            seen.add(shape)
            yield name, fn, make


def parts(model, cfg, rng):
    """(name, fn, make) for every part checked on its own: make(B, T) gives fn's arguments, the
    first B rows and T tokens of one draw (so a smaller pass holds the same values)."""
    def drawn(*shapes_dtypes):
        arrays = [jnp.asarray(rng.standard_normal(shape), dtype) for shape, dtype in shapes_dtypes]
        return lambda B, T: tuple(a[:B, :T] for a in arrays)

    for path, m in nnx.iter_modules(model.groups[0]):
        if isinstance(m, Linear):
            K, N = m.weight.shape[-1], m.weight.shape[0]
            yield f"linear {'.'.join(map(str, path))} (K {K}, N {N})", m, drawn(((8, 65, K), jnp.bfloat16))
    H = cfg.hidden_size
    yield "lm_head", model.logits, drawn(((8, 65, H), jnp.bfloat16))
    yield "final norm", model.norm, drawn(((8, 65, H), jnp.bfloat16))

    nq, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, kv = drawn(((8, 65, nq, d), jnp.bfloat16)), drawn(((8, CACHE, nkv, d), jnp.bfloat16),
                                                        ((8, CACHE, nkv, d), jnp.bfloat16))
    positions = 100 + jnp.arange(65)[None, :].repeat(8, 0)
    yield "attention", attend, lambda B, T: (*q(B, T), *(x[:B] for x in kv(B, CACHE)), positions[:B, :T])

    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    qkv = drawn(((8, 65, nk, dk), jnp.bfloat16), ((8, 65, nk, dk), jnp.bfloat16), ((8, 65, nv, dv), jnp.bfloat16))
    gates = [jnp.asarray(x, jnp.float32) for x in (-np.abs(rng.standard_normal((8, 65, nv))),
                                                   1 / (1 + np.exp(-rng.standard_normal((8, 65, nv)))))]
    state = jnp.asarray(0.1 * rng.standard_normal((8, nv, dk, dv)), jnp.float32)
    yield "gated delta rule", gdn_recurrent, lambda B, T: (*qkv(B, T), *(x[:B, :T] for x in gates), state[:B])


def whole_model(model, cfg, rng) -> dict:
    """Positions 20..23 of a sequence decoded one token at a time against a 4-token verify pass,
    a prefill beside two other rows, and a batch of 8 decoding position 20: the logits' and each
    decoder layer's largest |difference|."""
    taps = tuple(range(cfg.num_hidden_layers))
    H = cfg.hidden_size

    def forward(net, tokens, start, n, cache):
        out = net(tokens, Batch(start, n), cache, kv_len=CACHE, taps=taps)
        return net.logits(out.hidden), out.taps, out.cache

    run = jit_with_weights(forward, model)
    ids = lambda t: jnp.asarray(t, jnp.int32)  # noqa: E731
    seq = rng.integers(0, 1000, (8, 30))
    _, _, after_20 = run(ids(seq[:1, :20]), ids([0]), ids([20]), init_cache(cfg, 1, CACHE, model.dtype))
    logits, layers, cache = [], [], after_20
    for t in range(20, 24):
        lg, tp, cache = run(ids(seq[:1, t:t + 1]), ids([t]), ids([1]), cache)
        logits.append(lg[0, 0])
        layers.append(tp[0, 0])

    def compare(other_logits, other_layers):
        return {"logits": largest_difference(other_logits, logits[0]),
                "layers": [largest_difference(other_layers[j * H:(j + 1) * H], layers[0][j * H:(j + 1) * H])
                           for j in taps]}

    verify_logits, verify_layers, _ = run(ids(seq[:1, 20:24]), ids([20]), ids([4]), after_20)
    prefill_logits, prefill_layers, _ = run(ids(seq[:3]), ids([0] * 3), ids([30] * 3),
                                            init_cache(cfg, 3, CACHE, model.dtype))
    _, _, cache_8 = run(ids(seq[:, :20]), ids([0] * 8), ids([20] * 8), init_cache(cfg, 8, CACHE, model.dtype))
    batch_logits, batch_layers, _ = run(ids(seq[:, 20:21]), ids([20] * 8), ids([1] * 8), cache_8)
    return {"verify of 4": compare(verify_logits[0, 0], verify_layers[0, 0]),
            "prefill of 3 rows": compare(prefill_logits[0, 20], prefill_layers[0, 20]),
            "decode of 8 rows": compare(batch_logits[0, 0], batch_layers[0, 0])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="27b")
    ap.add_argument("--layers", type=int, default=4,
                    help="decoder layers kept (one 4-layer pattern: 3 GDN, 1 attention)")
    ap.add_argument("--cost", action="store_true", help="time each part with the mode and without it instead")
    ap.add_argument("--out", required=True, help="write OUT.json")
    args = ap.parse_args(argv)
    cfg = geometry_config(args.geometry, args.layers)
    model = random_model(cfg)
    model.use_decode_layout()
    rng = np.random.default_rng(0)
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": jax.devices()[0].device_kind, "args": vars(args), "parts": {}}

    def record(name, value):
        result["parts"][name] = value
        print(json.dumps({name: value}), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    if args.cost:
        for name, fn, make in distinct_shapes(parts(model, cfg, rng)):
            record(name, cost_in_passes(fn, make))
        return
    with batch_invariant(invariant_tile_rows()):
        for name, fn, make in parts(model, cfg, rng):
            record(name, token_in_passes(fn, make))
        for name, value in whole_model(model, cfg, rng).items():
            record(f"model, {name}", value)


if __name__ == "__main__":
    main()
