"""Which device kernels a decode step (T=1) and a verify step (T=k+1) spend their time in: each
pass is jitted on a random model of a real geometry (as bench/verify_cost.py builds it), warmed
up, timed untraced, then run --calls times under jax.profiler.trace; the trace is read back and
device time is summed per kernel name. Prints per pass the totals per call, the top kernels and
a per-category view, then per batch the kernel families whose time grew most from decode to
each verify.

    python -m bench.step_profile --geometry 0.8b --batch 1 8 --k 3 --calls 20 --out prof.json
    python -m bench.step_profile --geometry 0.8b --batch 1 --quantization nvfp4   # quantized projections
    python -m bench.step_profile --geometry 27b --batch 1 8 --batch-invariant     # what the mode adds

With --batch-invariant each pass is also traced in batch-invariant mode, and the diff printed is
the mode's pass minus the default pass, kernel family by family, instead of verify minus decode.

(`python -m bench.step_profile` from the repository root: `bench` is not an installed package.)

Where the events come from (printed for every pass):
  * GPU: the "/device:GPU:N" planes' "Stream #..." lines, the raw CUPTI records with one event
    per kernel launch (or memcpy/memset) named after the kernel. The derived lines ("XLA Ops",
    "XLA Modules", "Steps", ...) re-describe the same work per HLO op, so they are used only when
    no stream line exists ("XLA Ops" then). Under an active profiler XLA runs its command
    buffers (CUDA graphs) as plain launches, so per-kernel times are exact but the traced wall
    time carries launch gaps a production step does not; compare with the untraced wall time.
  * CPU: the "/host:CPU" plane's events that carry an "hlo_op" stat (one per executed thunk).
    They nest (a while loop's event spans its body's), so each event counts its self time.

Totals: "kernel sum" adds the self times, "busy" is the union of the intervals (what the device
was occupied for), both divided by --calls. The decode/verify diff groups kernels by family
(the name without trailing numeric suffixes: "loop_add_fusion_12" -> "loop_add_fusion"),
since XLA numbers fusions per compilation and the two passes number them differently.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

from bench.models import GEOMETRIES, add_layout_flag, layout_name
from bench.verify_cost import build_model, make_forward, timed
from models.qwen3_5 import init_cache
from pallas_kernels.batch_invariant import batch_invariant, invariant_tile_rows
from pallas_kernels.quant_formats import FORMATS

TOP = 25
NAME_WIDTH = 90
GPU_PLANE_PREFIX = "/device:GPU"
HOST_PLANE = "/host:CPU"
GPU_STREAM_LINE_PREFIX = "Stream"
XLA_OPS_LINE = "XLA Ops"
# First match wins: "quant_matmul" is a Pallas kernel before it is a matmul.
CATEGORIES = (
    ("collective", ("nccl", "all-reduce", "all_reduce", "allreduce", "all-gather", "all_gather", "allgather")),
    ("memcpy", ("memcpy", "memset")),
    ("pallas", ("pallas", "mosaic", "gdn_", "quant_matmul")),
    ("matmul", ("dot", "gemm", "gemv", "cublas", "cutlass", "xmma", "matmul", "triton_gemm")),
    ("fusion", ("fusion",)),
)


@dataclass(frozen=True)
class Event:
    """One device event: a kernel launch (GPU) or an executed HLO thunk (CPU)."""

    name: str
    hlo_op: str
    start_ns: float
    duration_ns: float
    self_ns: float
    module: str = ""  # the XLA program it ran in (jit_<name>), where the trace says


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="0.8b", choices=GEOMETRIES)
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers of the geometry")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, nargs="+", default=[3], help="drafted tokens; verify runs T=k+1")
    ap.add_argument("--rollback", default="replay", choices=("replay", "checkpoint"))
    ap.add_argument("--calls", type=int, default=20, help="calls traced (and timed untraced) per pass")
    ap.add_argument("--context", type=int, default=384, help="tokens already in the cache")
    ap.add_argument("--cache-len", type=int, default=512)
    add_layout_flag(ap)
    ap.add_argument("--quantization", choices=FORMATS, default=None, help="weight-only format of the projections")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="also trace each pass in batch-invariant mode and diff it against the default pass")
    ap.add_argument("--out", default=None, help="write the full results (every kernel) here as JSON")
    return ap.parse_args()


def category(name: str, hlo_ops: str) -> str:
    """A coarse kind for a kernel, from its name and its HLO op names."""
    text = f"{name} {hlo_ops}".lower()
    for cat, markers in CATEGORIES:
        if any(m in text for m in markers):
            return cat
    return "other"


def family(name: str) -> str:
    """The kernel name without trailing numeric suffixes, stable across compilations."""
    return re.sub(r"([._]\d+)+$", "", name)


STAMP_JITTER_NS = 50.0  # GPU timestamps of adjacent events can overlap or overhang by a few ns


def nested(parent_end: float, start: float, dur: float) -> bool:
    """Whether an event starting at or after its candidate parent's start lies inside it: it starts
    clearly before the parent's end and ends no later than it, both up to timestamp jitter (so
    back-to-back kernels are siblings, and a child stamped a few ns past its parent still nests)."""
    return parent_end - start > STAMP_JITTER_NS and start + dur <= parent_end + STAMP_JITTER_NS


def with_self_times(raw: list[tuple]) -> list[Event]:
    """Events of one timeline line, (name, hlo_op, start, duration[, module]) each, with each
    event's self time: its duration less that of the events directly nested in it."""
    raw = sorted(raw, key=lambda e: (e[2], -e[3]))
    self_ns = [e[3] for e in raw]
    stack: list[int] = []
    for i, (_, _, start, dur, *_) in enumerate(raw):
        while stack and not nested(raw[stack[-1]][2] + raw[stack[-1]][3], start, dur):
            stack.pop()
        if stack:
            self_ns[stack[-1]] -= dur
        stack.append(i)
    return [Event(n, op, s, d, max(0.0, t), *module) for (n, op, s, d, *module), t in zip(raw, self_ns)]


def gpu_lines(plane) -> list:
    """The lines of a GPU plane to read: its CUDA stream lines, else its "XLA Ops" line."""
    streams = [ln for ln in plane.lines if ln.name.startswith(GPU_STREAM_LINE_PREFIX)]
    return streams or [ln for ln in plane.lines if ln.name == XLA_OPS_LINE]


def read_events(profile: ProfileData, device: int | None = None) -> tuple[list[Event], dict]:
    """The device events of a trace and a description of where they were read from (lines,
    HLO modules, distinct run ids where events carry them). Raises if none were found, naming
    every plane and line seen. device: read that GPU's plane only (None: every GPU's)."""
    gpu = [p for p in profile.planes if p.name.startswith(GPU_PLANE_PREFIX)
           and (device is None or p.name == f"{GPU_PLANE_PREFIX}:{device}")]
    if gpu:
        picked, need_hlo_op = [(p, ln) for p in gpu for ln in gpu_lines(p)], False
    else:
        picked, need_hlo_op = [(p, ln) for p in profile.planes if p.name == HOST_PLANE for ln in p.lines], True
    events, lines, modules, run_ids = [], [], set(), set()
    for plane, line in picked:
        raw = []
        for e in line.events:
            stats = dict(e.stats)
            if need_hlo_op and "hlo_op" not in stats:
                continue
            module = str(stats.get("hlo_module", "?"))
            raw.append((e.name, str(stats.get("hlo_op", "")), e.start_ns, e.duration_ns, module))
            modules.add(module)
            run_ids.add(stats.get("run_id"))
        if raw:
            events += with_self_times(raw)
            lines.append(f"{plane.name} | {line.name} ({len(raw)} events)")
    if not events:
        seen = {p.name: [f"{ln.name} ({sum(1 for _ in ln.events)})" for ln in p.lines] for p in profile.planes}
        raise RuntimeError(f"no device events in the trace; planes and lines seen: {json.dumps(seen, indent=1)}")
    run_ids.discard(None)
    return events, {"lines": lines, "hlo_modules": sorted(modules), "runs_seen": len(run_ids) or None}


def trace_calls(fn, args: tuple, calls: int, device: int | None = None) -> tuple[list[Event], dict, float]:
    """Runs fn(*args) `calls` times under the profiler; returns its device events (of GPU `device`
    only, when given), where they were read from, and the traced wall time per call (ms)."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            t = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
            wall_ms = 1e3 * (time.perf_counter() - t) / calls
        paths = list(pathlib.Path(log_dir).rglob("*.xplane.pb"))
        if len(paths) != 1:
            raise RuntimeError(f"expected one .xplane.pb under the trace folder, found {paths}")
        events, source = read_events(ProfileData.from_file(str(paths[0])), device)
    return events, source, wall_ms


def busy_ns(events: list[Event]) -> float:
    """Length of the union of the events' intervals."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.start_ns):
        stop = e.start_ns + e.duration_ns
        if stop > end:
            total += stop - max(e.start_ns, end)
            end = stop
    return total


def summarize(events: list[Event], calls: int) -> dict:
    """Per-call totals, every kernel (by time, descending) and the per-category view."""
    per = defaultdict(lambda: {"ns": 0.0, "count": 0, "hlo_ops": set()})
    for e in events:
        row = per[e.name]
        row["ns"] += e.self_ns
        row["count"] += 1
        row["hlo_ops"].add(e.hlo_op)
    total_ns = sum(r["ns"] for r in per.values())
    kernels = []
    for name, r in sorted(per.items(), key=lambda kv: -kv[1]["ns"]):
        hlo_ops = sorted(op for op in r["hlo_ops"] if op)
        kernels.append({"name": name, "hlo_ops": hlo_ops, "family": family(name),
                        "category": category(name, " ".join(hlo_ops)),
                        "us_per_call": r["ns"] / calls / 1e3, "count_per_call": r["count"] / calls,
                        "share": r["ns"] / total_ns if total_ns else 0.0})
    cats = defaultdict(lambda: {"us_per_call": 0.0, "count_per_call": 0.0, "share": 0.0})
    for k in kernels:
        for key in cats[k["category"]]:
            cats[k["category"]][key] += k[key]
    return {"kernel_ms_per_call": total_ns / calls / 1e6, "busy_ms_per_call": busy_ns(events) / calls / 1e6,
            "kernels_per_call": len(events) / calls, "kernels": kernels,
            "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1]["us_per_call"]))}


def profile_pass(forward, params, cache, start, B: int, T: int, rollback, calls: int) -> dict:
    """Compiles, warms up, times and traces one pass (logits included) at batch B over T tokens."""

    def step(params, tokens, start, cache):
        return forward(params, tokens, start, cache, rollback, True)

    fn = jax.jit(step)
    args = (params, jnp.ones((B, T), jnp.int32), start, cache)
    wall_ms = timed(fn, *args, reps=calls)  # compiles and warms up first
    events, source, traced_ms = trace_calls(fn, args, calls)
    return {"wall_ms_per_call": wall_ms, "traced_wall_ms_per_call": traced_ms, "source": source,
            **summarize(events, calls)}


def clip(name: str) -> str:
    """A name cut to NAME_WIDTH characters for the tables."""
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "…"


def op_note(kernel: dict) -> str:
    """" [first hlo op, +n]" when the kernel's HLO ops say more than its name."""
    ops = kernel["hlo_ops"]
    if not ops or ops == [kernel["name"]]:
        return ""
    return f" [{ops[0]}" + (f", +{len(ops) - 1}]" if len(ops) > 1 else "]")


def print_pass(run: dict) -> None:
    """Totals, the top kernels and the categories of one pass."""
    print(f"\n== batch {run['batch']} | {run['pass']} (T={run['T']}) ==")
    print("events from: " + "; ".join(run["source"]["lines"]))
    runs = run["source"]["runs_seen"]
    print("hlo modules: " + ", ".join(run["source"]["hlo_modules"])
          + (f"; {runs} distinct run ids in the trace" if runs else ""))
    print(f"per call: wall {run['wall_ms_per_call']:.3f} ms untraced, {run['traced_wall_ms_per_call']:.3f} ms traced;"
          f" kernel sum {run['kernel_ms_per_call']:.3f} ms; busy {run['busy_ms_per_call']:.3f} ms;"
          f" {run['kernels_per_call']:.0f} kernels")
    print(f"{'us/call':>10} {'n/call':>7} {'share':>6}  {'category':<8} kernel [hlo op, +other ops]")
    for k in run["kernels"][:TOP]:
        print(f"{k['us_per_call']:10.1f} {k['count_per_call']:7.1f} {k['share']:6.1%}  {k['category']:<8} "
              f"{clip(k['name'] + op_note(k))}")
    print("by category:")
    for cat, c in run["categories"].items():
        print(f"{c['us_per_call']:10.1f} {c['count_per_call']:7.1f} {c['share']:6.1%}  {cat}")


def by_key(run: dict, key: str) -> dict:
    """(us, count) per call of a pass's kernels grouped by `key` ("family" or "category")."""
    out = defaultdict(lambda: (0.0, 0.0))
    for k in run["kernels"]:
        us, n = out[k[key]]
        out[k[key]] = (us + k["us_per_call"], n + k["count_per_call"])
    return out


def diff(decode: dict, verify: dict, key: str) -> list[dict]:
    """Per `key` group, decode and verify us and count per call, largest growth first."""
    a, b = by_key(decode, key), by_key(verify, key)
    category_of = {k[key]: k["category"] for k in decode["kernels"] + verify["kernels"]}
    rows = [{key: g, "category": category_of[g], "us_decode": a[g][0], "us_verify": b[g][0],
             "delta_us": b[g][0] - a[g][0], "n_decode": a[g][1], "n_verify": b[g][1]} for g in a.keys() | b.keys()]
    return sorted(rows, key=lambda r: -r["delta_us"])


def print_diff(decode: dict, verify: dict, families: list[dict], categories: list[dict]) -> None:
    """The growth of totals, families and categories from one pass (decode, or a pass outside the
    mode) to another (a verify pass, or the same pass in the mode)."""
    print(f"\n== batch {verify['batch']} | {verify['pass']} minus {decode['pass']} ==")
    for key, label in (("wall_ms_per_call", "wall untraced"), ("kernel_ms_per_call", "kernel sum"),
                       ("busy_ms_per_call", "busy")):
        print(f"{label}: {decode[key]:.3f} -> {verify[key]:.3f} ms ({verify[key] / decode[key]:.2f}x)")
    print(f"kernels per call: {decode['kernels_per_call']:.0f} -> {verify['kernels_per_call']:.0f}")
    print(f"{'+us/call':>10} {'from':>9} {'to':>9} {'n from':>6} {'n to':>6}  {'category':<8} kernel family")
    for r in families[:TOP]:
        print(f"{r['delta_us']:+10.1f} {r['us_decode']:9.1f} {r['us_verify']:9.1f} {r['n_decode']:6.1f} "
              f"{r['n_verify']:6.1f}  {r['category']:<8} {clip(r['family'])}")
    print("by category:")
    for r in categories:
        print(f"{r['delta_us']:+10.1f} {r['us_decode']:9.1f} {r['us_verify']:9.1f} {r['n_decode']:6.1f} "
              f"{r['n_verify']:6.1f}  {r['category']}")


def main() -> None:
    args = parse_args()
    cfg, gdef, params = build_model(args.geometry, args.quantization, args.rolled_layers, args.layers)
    forward = make_forward(gdef, args.cache_len)
    layers = f" ({args.layers} layers)" if args.layers else ""
    print(f"{args.geometry}{layers} ({args.quantization or 'bf16'} projections) on {jax.devices()[0].device_kind}; "
          f"{args.calls} calls per pass", flush=True)
    runs, diffs = [], []
    for B in args.batch:
        cache = init_cache(cfg, B, args.cache_len, jnp.bfloat16)
        start = jnp.full((B,), args.context, jnp.int32)
        passes = [("decode", 1, None)] + [(f"verify k={k} {args.rollback}", k + 1, args.rollback) for k in args.k]
        batch_runs = []
        for name, T, rollback in passes:
            for mode in (False, True) if args.batch_invariant else (False,):
                with batch_invariant(invariant_tile_rows() if mode else None):
                    run = {"batch": B, "pass": name + (" in the mode" if mode else ""), "T": T,
                           "layers": layout_name(args.rolled_layers),
                           **profile_pass(forward, params, cache, start, B, T, rollback, args.calls)}
                print_pass(run)
                batch_runs.append(run)
        pairs = (zip(batch_runs[::2], batch_runs[1::2]) if args.batch_invariant
                 else ((batch_runs[0], verify) for verify in batch_runs[1:]))
        for before, after in pairs:
            families, categories = diff(before, after, "family"), diff(before, after, "category")
            print_diff(before, after, families, categories)
            diffs.append({"batch": B, "pass": after["pass"], "families": families, "categories": categories})
        runs += batch_runs
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"geometry": args.geometry, "quantization": args.quantization,
                                                      "calls": args.calls,
                                                      "device": jax.devices()[0].device_kind,
                                                      "runs": runs, "diffs": diffs}, indent=1))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
