"""Pallas kernels on the GPU: compile, check against the pure-JAX reference on random data, and
time against XLA's version of the same op: inside one jitted fori_loop or as back-to-back jitted
calls, and (quantized matmuls, chunked prefill) as GPU time from a profiler trace, which is what
the comparisons with XLA's dots and flash-linear-attention's kernels use.

    python -m bench.kernels [--only gdn|quant|chunked|attention] --json out.jsonl

GDN recurrent (decode T = 1, verify T = k + 1 with every state kept) at Qwen3.5 head layouts
(16 key heads; 16 / 32 / 48 value heads; dk = dv = 128). Bytes counted: q, k, v, gates read once,
the state read and written once (plus T states written when kept), outputs written once.

Flash attention (prefill) at the 27B attention shape (24 query / 4 key heads, d = 256, bf16): a
block of T queries at the end of a context of S slots (a prefix-cache block pass: 256 after 16k)
and a whole prompt (T = S), against XLA's masked softmax (`attend_masked`).

The routed-expert kernels have their own sweep: `bench.experts`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import copy_rate, loop_time_s
from models.layers import attend_masked
from pallas_kernels.flash_attention import flash_attention_pallas
from pallas_kernels.flash_attention_wgmma import flash_attention_wgmma, use_wgmma_attention
from pallas_kernels.gdn_chunked import gdn_chunked, gdn_chunked_pallas, gdn_chunked_reference
from pallas_kernels.gdn_recurrent import gdn_recurrent_pallas, gdn_recurrent_reference
from pallas_kernels.nvfp4_mma_mosaic import MAX_ROWS as MOSAIC_MAX_ROWS
from pallas_kernels.quant_formats import FORMATS, quant_matmul_reference, quantize
from pallas_kernels.quant_matmul import has_tma, nvfp4_mosaic_matmul, quant_matmul, tuned_for
from pallas_kernels.quant_matmul_triton import quant_matmul_pallas
from pallas_kernels.quant_tiling import Tiling

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")


def max_rel_error(got, want) -> float:
    """The largest relative (norm) error over paired arrays."""
    return max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) for a, b in zip(got, want))


def loop_time_us(step, carry, reps: int = 200) -> float:
    """Mean microseconds of `step` over `reps` iterations of one jitted fori_loop."""
    return 1e6 * loop_time_s(step, carry, reps)


def gdn_case(B, T, nv, keep, rng):
    nk, d = 16, 128
    def f(*s, dt=jnp.bfloat16):
        return jnp.asarray(rng.normal(size=s), dt)
    q, k, v = f(B, T, nk, d), f(B, T, nk, d), f(B, T, nv, d)
    g = -jnp.asarray(rng.uniform(0, 2, (B, T, nv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(B, T, nv)), jnp.float32)
    s0 = f(B, nv, d, d, dt=jnp.float32)
    got = gdn_recurrent_pallas(q, k, v, g, beta, s0, keep_states=keep)
    want = gdn_recurrent_reference(q, k, v, g, beta, s0, keep_states=keep)

    def stepper(fn):
        return lambda s: fn(q, k, v, g, beta, s, keep_states=keep)[1]

    t_kernel = loop_time_us(stepper(gdn_recurrent_pallas), s0)
    t_xla = loop_time_us(stepper(gdn_recurrent_reference), s0)
    state_bytes = B * nv * d * d * 4
    nbytes = 2 * state_bytes + (T * state_bytes if keep else 0) + q.nbytes + k.nbytes + v.nbytes + B * T * nv * d * 4
    return {"op": "gdn_recurrent", "B": B, "T": T, "nv": nv, "keep_states": keep,
            "max_rel_err": max_rel_error(got, want),
            "kernel_us": t_kernel, "xla_us": t_xla, "speedup_vs_xla": t_xla / t_kernel,
            "kernel_GB_s": nbytes / t_kernel / 1e3}


def matmul_time_us(f, x, reps=200):
    """Time y = f(x) with a dependency through the loop so nothing is hoisted."""
    def step(c):
        x, acc = c
        y = f(x)
        acc = acc + y[0, 0].astype(jnp.float32)
        return x + (acc * 0).astype(x.dtype), acc
    return loop_time_us(step, (x, jnp.zeros((), jnp.float32)), reps)


def tilings(fmt: str, M: int) -> list[Tiling]:
    """Tilings to try: (block_n, block_k, split_k, warps, stages), and for one row the GEMV ones,
    the last field saying packed halves or float32 multiply-and-sum.
    An fp8-block tile's rows stay inside one 128-row scale block; small M wants many programs in
    flight (small block_n, or split K). The dispatcher's choices (`quant_matmul.TUNED`: one_row,
    multiply_and_sum, many_rows) are among them."""
    if fmt == "fp8_block":
        shapes = [(64, 256, 1, 4, 3), (64, 128, 2, 4, 3), (128, 128, 2, 8, 3), (64, 128, 1, 4, 3), (64, 512, 2, 8, 3)]
        gemv = [(16, 512, 1, 4, 3, False), (16, 256, 1, 4, 3, False), (16, 256, 1, 4, 4, True),
                (16, 512, 2, 8, 4, True),
                (32, 256, 4, 4, 4, True), (16, 256, 4, 4, 4, True)]
    elif fmt == "nvfp4":
        shapes = [(32, 128, 1, 4, 3), (32, 128, 4, 4, 3), (64, 128, 4, 4, 3), (32, 256, 2, 4, 3), (16, 256, 4, 4, 3)]
        gemv = [(16, 512, 1, 4, 3, True), (16, 256, 1, 4, 3, True), (8, 512, 1, 4, 3, True), (16, 512, 1, 4, 4, True),
                (16, 1024, 1, 4, 3, True), (16, 512, 1, 8, 3, True), (16, 512, 2, 8, 3, True), (16, 256, 4, 4, 3, True)]
    else:
        shapes = [(64, 128, 1, 4, 3), (64, 256, 1, 4, 3), (32, 256, 2, 4, 3), (32, 512, 1, 4, 3),
                  (64, 256, 2, 4, 4), (64, 512, 2, 8, 3), (128, 256, 4, 8, 3), (32, 256, 4, 4, 4)]
        gemv = [(16, 256, 1, 4, 3, True), (16, 128, 1, 4, 3, True), (8, 256, 1, 4, 3, True), (16, 256, 1, 4, 4, True),
                (16, 512, 1, 4, 3, False), (16, 256, 1, 4, 3, False), (16, 256, 1, 8, 4, True),
                (16, 256, 2, 8, 4, True),
                (16, 256, 4, 4, 4, True), (16, 512, 2, 8, 4, True)]
    if M > 8:
        shapes = shapes[:3]
    one_row = [Tiling(*s[:5], gemv=True, packed_halves=s[5]) for s in gemv] if M == 1 else []
    return [Tiling(*s) for s in shapes] + one_row


def device_us(fn, *args, calls: int = 10) -> tuple[float, dict]:
    """GPU time per call of jit(fn)(*args) from a profiler trace: the union of its kernels'
    intervals (µs), and each kernel's own time (µs)."""
    from bench.step_profile import busy_ns, summarize, trace_calls

    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    events, _, _ = trace_calls(f, args, calls)
    kernels = {k["name"][:60]: round(k["us_per_call"], 1) for k in summarize(events, calls)["kernels"][:8]}
    return busy_ns(events) / calls / 1e3, kernels


# The H200's L2 holds 50 MB: a weight read again after fewer bytes than that can come back from L2,
# not HBM (a 27B NVFP4 MLP matrix, 50 MB, timed call after call: 13.0 against 16.2 us, session 10
# run 10). A decode step reads each layer's weights once, so the quantized matmuls are timed with
# weights that cycle through at least this many bytes of others first.
COLD_BYTES = 200 << 20


def cold_device_us(fn, xs: list, ws: list) -> tuple[float, dict]:
    """GPU time per call of fn(x, w) with cold weights: one jitted call runs fn on each pair (xs[i],
    ws[i]) in turn (distinct rows, so XLA shares nothing between them), each weight read once. The
    union of its kernels' intervals (µs) and each kernel's time (µs), divided by the pairs."""
    us, kernels = device_us(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)], xs, ws)
    return us / len(ws), {name: round(t / len(ws), 2) for name, t in kernels.items()}


COLD_MOST = 8  # copies at most: one jitted call runs them all; a weight under COLD_BYTES / 7 stays partly warm


def cold_copies(w: jax.Array, nbytes: int, make) -> list:
    """make(w'), for w and shifted copies of it, enough that the copies after one hold COLD_BYTES
    (at most COLD_MOST)."""
    return [make(jnp.roll(w, i, axis=1)) for i in range(min(COLD_MOST, 1 + -(-COLD_BYTES // nbytes)))]


def quant_cases(rng, ceiling, rows_tried, shape, formats=FORMATS):
    """Every format on a weight shape [N, K] at each row count in rows_tried. Each op is timed
    two ways: its GPU time per call from a profiler trace with cold weights (`cold_device_us`;
    kernels only: what a GEMV streams at) and the mean of a jitted loop on one weight (which adds the
    loop's own overhead, 5-11 µs on the H200, and keeps what fits of the weight in L2). The
    dispatcher `quant_matmul` is timed too (its tiling, with the SM rounds of a one-row GEMV), and
    NVFP4 rows (up to 16) on a GPU with TMA also run the dispatcher's Mosaic GPU kernel alone (`mosaic_case`)."""
    N, K = shape
    w = jnp.asarray(rng.normal(size=(N, K)) * K ** -0.5, jnp.float32)
    w_bf16 = cold_copies(w, N * K * 2, lambda w: w.astype(jnp.bfloat16))
    w_fp8 = cold_copies(w, N * K, lambda w: w.astype(jnp.float8_e4m3fn))
    nt = (((1,), (1,)), ((), ()))
    def bf16_dot(x, w):
        return jax.lax.dot_general(x, w, nt, preferred_element_type=jnp.bfloat16)
    def fp8_dot(x, w):
        return jax.lax.dot_general(x.astype(jnp.float8_e4m3fn), w, nt, preferred_element_type=jnp.bfloat16)
    rows = []
    for M in rows_tried:
        x = jnp.asarray(rng.normal(size=(M, K)), jnp.bfloat16)
        xs = [jnp.roll(x, i, axis=1) for i in range(COLD_MOST)]  # a row for each copy (zip takes what it needs)
        bf16_us, fp8_us = cold_device_us(bf16_dot, xs, w_bf16)[0], cold_device_us(fp8_dot, xs, w_fp8)[0]
        rows.append({"op": "xla_dot", "M": M, "bf16_device_us": bf16_us, "fp8xfp8_device_us": fp8_us,
                     "bf16_loop_us": matmul_time_us(lambda x: bf16_dot(x, w_bf16[0]), x),
                     "bf16_GB_s": w_bf16[0].nbytes / bf16_us / 1e3, "ceiling_GB_s": ceiling})
        print(json.dumps(rows[-1]), flush=True)
        for fmt in formats:
            qws = cold_copies(w, N * K // (2 if fmt == "nvfp4" else 1), lambda w: quantize(w, fmt))
            qw = qws[0]
            wbytes = sum(a.nbytes for a in (qw.data, qw.scale))
            want = quant_matmul_reference(x.astype(jnp.float32), qw)
            best, tried = None, {}
            for tiling in tilings(fmt, M):
                if not tiling.fits(qw):
                    continue
                try:
                    f = functools.partial(quant_matmul_pallas, tiling=tiling)
                    err = max_rel_error([f(x, qw).astype(jnp.float32)], [want])
                    us, kernels = cold_device_us(f, xs, qws)
                except Exception as e:  # a Triton limit: report it, try the next tile
                    tried[str(dataclasses.astuple(tiling))] = f"error: {str(e)[:300]}"
                    continue
                tried[str(dataclasses.astuple(tiling))] = round(us, 1)
                if best is None or us < best["device_us"]:
                    best = {"op": f"quant_matmul_{fmt}", "M": M, "tiling": dataclasses.astuple(tiling), "rel_err": err,
                            "device_us": us, "kernel_us": kernels.get(f"quant_matmul_{fmt}",
                                                                      kernels.get(f"quant_gemv_{fmt}", float("nan"))),
                            "kernels": kernels}
            if best is None:
                rows.append({"op": f"quant_matmul_{fmt}", "M": M, "tried": tried})
            else:
                loop_us = matmul_time_us(functools.partial(quant_matmul_pallas, w=qw, tiling=Tiling(*best["tiling"])),
                                         x)
                dispatch_us, dispatch_kernels = cold_device_us(quant_matmul, xs, qws)  # its own tiling, SM rounds
                def of(us):
                    return wbytes / us / 1e3 / ceiling
                best.update(loop_us=loop_us, weight_bytes=wbytes, of_ceiling=of(best["device_us"]),
                            kernel_of_ceiling=of(best["kernel_us"]), loop_of_ceiling=of(loop_us),
                            vs_bf16=bf16_us / best["device_us"], vs_fp8xfp8=fp8_us / best["device_us"],
                            dispatch_us=dispatch_us, dispatch_of_ceiling=of(dispatch_us),
                            dispatch_kernels=dispatch_kernels, tried=tried)
                rows.append(best)
            print(json.dumps(rows[-1]), flush=True)
            if fmt == "nvfp4" and M <= MOSAIC_MAX_ROWS and has_tma(jax.devices()[0]):
                rows.append(mosaic_case(xs, qws, wbytes, ceiling, bf16_us))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def mosaic_case(xs, qws, wbytes, ceiling, bf16_us) -> dict:
    """The dispatcher's Mosaic GPU NVFP4 kernel for these rows (the f16x2 GEMV up to `TunedTilings.mosaic_gemv_rows`,
    the tensor-core one above) with its tiling: its error against dequantize-then-dot on N(0, 1) rows,
    the same rows times 3e4 and 1e-5, and with their first halves 10^4 smaller (every output finite),
    and its GPU time with cold weights."""
    (M, K), sm_count = xs[0].shape, jax.devices()[0].core_count
    op = "nvfp4_gemv_mosaic" if M <= tuned_for(jax.devices()[0].device_kind).mosaic_gemv_rows else "nvfp4_mma_mosaic"
    if jax.eval_shape(lambda x, q: nvfp4_mosaic_matmul(x, q, sm_count), xs[0], qws[0]) is None:  # traced, not run
        return {"op": op, "M": M, "shape": list(qws[0].shape), "tiling": None}
    f = jax.jit(lambda x, q: nvfp4_mosaic_matmul(x, q, sm_count))
    x, errors = xs[0], {}
    for name, rows in (("normal", x), ("x3e4", x * 3e4), ("x1e-5", x * 1e-5),
                       ("halves", x.at[:, : K // 2].multiply(1e-4))):
        rows = rows.astype(jnp.bfloat16)
        got = f(rows, qws[0])
        errors[name] = max_rel_error(got, quant_matmul_reference(rows.astype(jnp.float32), qws[0]))
        if not bool(jnp.all(jnp.isfinite(got.astype(jnp.float32)))):
            errors[name] = float("inf")
    us, kernels = cold_device_us(f, xs, qws)
    return {"op": op, "M": M, "shape": list(qws[0].shape), "rel_err": errors, "device_us": us,
            "of_ceiling": wbytes / us / 1e3 / ceiling, "vs_bf16": bf16_us / us, "kernels": kernels}


def fla_run(q, k, v, g, beta, s0):
    """flash-linear-attention's Triton chunked kernel on the same data (torch): its outputs as
    numpy and its time (µs), or why it could not run."""
    try:
        import torch
        import triton.testing
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        return {"fla_error": f"not installed: {e}"}, None
    def t(x):
        return torch.tensor(np.asarray(x)).cuda()
    r = v.shape[2] // q.shape[2]  # grouped value heads: repeat q/k per value head, as HF does before FLA
    tq, tk = (t(x.astype(jnp.float32)).bfloat16().repeat_interleave(r, dim=2) for x in (q, k))
    tv = t(v.astype(jnp.float32)).bfloat16()
    tg, tb, ts = t(g), t(beta), t(s0)
    def run():
        return chunk_gated_delta_rule(tq, tk, tv, tg, tb, initial_state=ts, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    try:
        o, s = run()
        outputs = (jnp.asarray(o.float().cpu().numpy()), jnp.asarray(s.float().cpu().numpy()))
        timing = {"fla_us": 1e3 * triton.testing.do_bench(run, return_mode="median")} | torch_gpu_time(run)
    except Exception as e:  # GVA layouts, API differences or a profiler failure: report, do not guess
        return {"fla_error": str(e)[:300]}, None
    return timing, outputs


def torch_gpu_time(run, calls: int = 5) -> dict:
    """GPU time per call of run() from torch's profiler: its CUDA kernels' times summed (µs), and
    each kernel's. Excludes the host's launch overhead, which do_bench's median includes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.self_device_time_total:  # self: a CPU op's total would count its kernels again
            kernels[e.key[:60]] = round(e.self_device_time_total / calls, 1)
    return {"fla_gpu_us": sum(kernels.values()), "fla_kernels_us": kernels}


CHUNKED_VARIANTS = {  # name: the op timed; "dispatcher" is what a model runs (bf16: bf16 operands and output)
    "dispatcher": gdn_chunked,
    "f32": functools.partial(gdn_chunked_pallas, operands=jnp.float32),
    "bf16_bv64_s2": functools.partial(gdn_chunked_pallas, operands=jnp.bfloat16, state_stages=2,
                                      out_dtype=jnp.bfloat16),
    "bf16_bv128_s3": functools.partial(gdn_chunked_pallas, operands=jnp.bfloat16, block_v=128, out_dtype=jnp.bfloat16),
    "bf16_bv32_s3": functools.partial(gdn_chunked_pallas, operands=jnp.bfloat16, block_v=32, out_dtype=jnp.bfloat16),
}


def call_time_us(fn, args: tuple, reps: int = 20) -> float:
    """Mean time of back-to-back calls of jit(fn)(*args) after a warm-up call (µs)."""
    from bench.verify_cost import timed

    return 1e3 * timed(jax.jit(fn), *args, reps=reps)


def chunked_args(rng, T: int) -> tuple:
    """(q, k, v, g, beta, state) for one row at the 27B GDN shape (16 key / 48 value heads, 128 dims)."""
    B, nk, nv, d = 1, 16, 48, 128
    def f(*s, dt=jnp.bfloat16):
        return jnp.asarray(rng.normal(size=s), dt)
    g = -jnp.asarray(rng.uniform(0, 1, (B, T, nv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(B, T, nv)), jnp.float32)
    return f(B, T, nk, d), f(B, T, nk, d), f(B, T, nv, d), g, beta, f(B, nv, d, d, dt=jnp.float32)


def chunked_cases(rng, tokens):
    """Chunked GDN prefill for each length against XLA's reference and flash-linear-attention;
    errors are relative to XLA's reference (FLA's too). Wall times are back-to-back jitted calls
    on argument arrays (inside a loop on captured inputs XLA folds the input-only work); GPU times
    come from profiler traces, JAX's for ours and torch's for FLA. FLA runs after every JAX trace:
    once torch's profiler has held CUPTI, JAX's traces come back empty."""
    rows, wants, cases = [], [], [(T, chunked_args(rng, T)) for T in tokens]  # 130: a ragged tail past two chunks
    for T, args in cases:
        row = {"op": "gdn_chunked", "T": T}
        want = jax.jit(gdn_chunked_reference)(*args)
        wants.append(want)
        row["xla_us"] = call_time_us(gdn_chunked_reference, args)
        for name, fn in CHUNKED_VARIANTS.items():
            try:
                row[f"rel_err_{name}"] = max_rel_error(fn(*args), want)
                row[f"gpu_us_{name}"], row[f"kernels_us_{name}"] = device_us(fn, *args, calls=5)
            except Exception as e:  # a Triton limit on one variant: report it, time the rest
                row[f"error_{name}"] = str(e)[:300]
        row["wall_us_dispatcher"] = call_time_us(gdn_chunked, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for row, want, (T, args) in zip(rows, wants, cases):
        fla, fla_out = fla_run(*args)
        row.update(fla)
        if fla_out is not None:
            row["rel_err_fla"] = max_rel_error(fla_out, want)
            row["fla_gpu_over_ours"] = row["fla_gpu_us"] / row["gpu_us_dispatcher"]
        print(json.dumps({"op": "fla", "T": T, **fla}), flush=True)
    return rows


def cudnn_attention(q, k, v, start):
    """cuDNN's fused attention for the T queries at positions start..start+T-1 of each row over its
    cache: q [B, T, nq, d], k, v [B, S, nkv, d], start [B] int32. Two cuDNN calls merged by their
    log-sum-exp: the keys before start, all visible (a padding mask), and the T new keys, causal
    (a square, where cuDNN's causal mask lines up; for T < S it is aligned to the first key). JAX's
    public wrapper rounds the log-sum-exp to the output's dtype, so this calls its cuDNN module
    for float32 statistics."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    B, T, _, d = q.shape
    before, lse_before = cudnn.dot_product_attention(
        q, k, v, None, None, jnp.full((B,), T, jnp.int32), start, scale=d**-0.5,
        mask_type=cudnn.MaskType.PADDING, return_residual=True)
    own = [jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, T, axis=0))(x, start) for x in (k, v)]
    new, lse_new = cudnn.dot_product_attention(q, *own, scale=d**-0.5, mask_type=cudnn.MaskType.CAUSAL,
                                               return_residual=True)
    seen = start[:, None, None] > 0  # a row at position 0 has no keys before it
    lse_before = jnp.where(seen, lse_before, -jnp.inf)
    top = jnp.maximum(lse_before, lse_new)
    w_before, w_new = (jnp.swapaxes(jnp.exp(x - top), 1, 2)[..., None] for x in (lse_before, lse_new))  # [B, T, nq, 1]
    before = jnp.where(seen[..., None], before.astype(jnp.float32), 0.0)
    return ((before * w_before + new.astype(jnp.float32) * w_new) / (w_before + w_new)).astype(q.dtype)


def attention_cases(rng, shapes=((256, 16640), (4096, 4096), (16384, 16384))) -> list[dict]:
    """Flash attention (the Triton kernel and the wgmma one), and cuDNN's (`cudnn_attention`),
    against XLA's masked softmax for (T queries, S slots): the queries are the last T positions of
    the context; error relative to XLA's in float32."""
    rows = []
    for T, S in shapes:
        nq, nkv, d = 24, 4, 256
        f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.bfloat16)  # noqa: E731
        q, k, v = f(1, T, nq, d), f(1, S, nkv, d), f(1, S, nkv, d)
        pos = jnp.arange(S - T, S, dtype=jnp.int32)[None]
        flop = 4 * nq * d * T * (S - T / 2)  # causal: QK^T and PV over the visible triangle and the slots before it
        xla = lambda q, k, v, pos: attend_masked(q, k, v, jnp.arange(k.shape[1])[None, None] <= pos[:, :, None])  # noqa: E731
        want = jax.jit(lambda *a: xla(*(x.astype(jnp.float32) for x in a[:3]), a[3]))(q, k, v, pos)
        row = {"op": "flash_attention", "T": T, "S": S,
               "rel_err_flash": max_rel_error([flash_attention_pallas(q, k, v, pos).astype(jnp.float32)], [want]),
               "rel_err_xla_bf16": max_rel_error([jax.jit(xla)(q, k, v, pos).astype(jnp.float32)], [want]),
               "flash_us": call_time_us(flash_attention_pallas, (q, k, v, pos)),
               "xla_us": call_time_us(xla, (q, k, v, pos))}
        if use_wgmma_attention(q, S):
            row["rel_err_wgmma"] = max_rel_error([flash_attention_wgmma(q, k, v, pos).astype(jnp.float32)], [want])
            row["wgmma_us"] = call_time_us(flash_attention_wgmma, (q, k, v, pos))
            row["wgmma_TFLOP_s"] = flop / row["wgmma_us"] / 1e6
        start = jnp.asarray([S - T], jnp.int32)
        try:
            cudnn = jax.jit(cudnn_attention)
            row["rel_err_cudnn"] = max_rel_error([cudnn(q, k, v, start).astype(jnp.float32)], [want])
            row["cudnn_us"] = call_time_us(cudnn, (q, k, v, start))
        except Exception as e:  # a cuDNN or device without these shapes: say so and go on
            row["cudnn"] = f"failed: {str(e).splitlines()[0][:200]}"
        row["flash_TFLOP_s"] = flop / row["flash_us"] / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=["gdn", "quant", "chunked", "attention"], default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[130, 4096, 16384], help="chunked prefill lengths")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64], help="quantized matmul activation rows")
    ap.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS), help="quantized weight formats")
    ap.add_argument("--shape", type=int, nargs=2, default=[17408, 5120], metavar=("N", "K"),
                    help="quantized matmul weight shape (e.g. 3584 1024, a 0.8B MLP projection)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    if args.only in (None, "quant"):
        ceiling = copy_rate() / 1e9
        print(json.dumps({"hbm_ceiling_GB_s": ceiling}), flush=True)
    if args.only in (None, "quant"):
        rows += quant_cases(rng, ceiling, args.rows, tuple(args.shape), args.formats)
    for nv in (16, 32, 48) if args.only in (None, "gdn") else ():
        for B in (1, 8):
            for T, keep in ((1, False), (2, True), (4, True), (4, False)):
                row = gdn_case(B, T, nv, keep, rng)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.only in (None, "attention"):
        rows += attention_cases(rng)
    if args.only in (None, "chunked"):  # last: FLA's torch profiler leaves JAX's traces empty
        rows += chunked_cases(rng, args.tokens)
    if args.json:
        with open(args.json, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
