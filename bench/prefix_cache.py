"""Prefix caching at scale: time to first token of a long shared prefix plus new tokens, without
caching, on a miss and on a hit, against a plain prefill of the new tokens alone; the store's
bytes per cached token; and decode speed with caching on and off (plain, and MTP k=1 at a
synthetic acceptance of 0.85) after a shorter prompt. Random weights of a released geometry, made on the device.
With --profile, also the device time of each engine program (restore, block pass, start_decode;
the plain prefill) from a `jax.profiler` trace, and when each ran within its prefill.

    python -m bench.prefix_cache --geometry 27b --prefix 16384 --new 256 --out results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import time

import jax
import numpy as np

from bench.models import geometry_config, random_model, random_prompts
from bench.scale import synthetic
from bench.step_profile import Event, summarize, trace_calls
from spec_jax import LLM, SamplingParams

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=0)
LONG = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True, seed=0)


def ttft_s(llm: LLM, ids: list[int]) -> float:
    """Seconds from prompt to the first token on the device (the prefill, host work included)."""
    t = time.perf_counter()
    state = llm.prefill([ids], [FIRST])
    jax.block_until_ready(state.tokens)
    return time.perf_counter() - t


def hit_parts(llm: LLM, ids: list[int]) -> dict:
    """Where a hit's time goes: the prefill call as a whole, and inside it each engine program
    (empty row, restores, block passes, start_decode), waited for one by one."""
    seconds, calls = collections.defaultdict(float), collections.Counter()

    def timed(name, call):
        t = time.perf_counter()
        out = jax.block_until_ready(call())
        seconds[name] += time.perf_counter() - t
        calls[name] += 1
        return out

    with llm.engine.runner.watching(timed):
        whole = ttft_s(llm, ids)
    return {"whole_s": whole, "programs": {name: {"calls": calls[name], "s": seconds[name]} for name in seconds}}


def device_time(llm: LLM, prompts: list[list[int]]) -> dict:
    """Device time of each engine program over prefills of `prompts` (each traced alone with
    `jax.profiler`), per prefill: kernel sum, busy time, kernel count, the top kernels, and when
    it ran within its prefill (`program_timeline`)."""
    traces = [trace_calls(ttft_s, (llm, ids), calls=1)[0] for ids in prompts]
    programs = collections.defaultdict(list)
    for e in (e for events in traces for e in events):
        programs[e.module].append(e)
    when = [program_timeline(events) for events in traces]
    out = {}
    for module, evs in sorted(programs.items(), key=lambda kv: min(e.start_ns for e in kv[1])):
        summary = summarize(evs, len(prompts))
        out[module] = {"kernel_ms": summary["kernel_ms_per_call"], "busy_ms": summary["busy_ms_per_call"],
                       "kernels": summary["kernels_per_call"],
                       **{k: sum(w[module][k] for w in when) / len(when) for k in ("start_ms", "end_ms")
                          if all(module in w for w in when)},
                       "top": [{k: kernel[k] for k in ("name", "us_per_call", "count_per_call")}
                               for kernel in summary["kernels"][:8]]}
    return out


def plain_and_hits(plain: LLM, cached: LLM, prefix: list[int], news, rounds: int, repeats: int) -> dict:
    """Time to first token of plain prefills of new tokens alone and of hits (prefix + new
    tokens), in `rounds` alternating rounds of `repeats` runs of each, so that both see the same
    drift of the machine; runs in a row, since the first run after another program's can pay for
    XLA re-recording its command buffers on moved buffers. The best and the median of each."""
    plain_s, hit_s = [], []
    for _ in range(rounds):
        plain_s += [ttft_s(plain, next(news)) for _ in range(repeats)]
        hit_s += [ttft_s(cached, prefix + next(news)) for _ in range(repeats)]
    out = {"plain_new_only_s": min(plain_s), "plain_new_only_median_s": float(np.median(plain_s)),
           "hit_s": min(hit_s), "hit_median_s": float(np.median(hit_s)), "runs_each": len(hit_s)}
    out["hit_over_plain_new_only"] = out["hit_s"] / out["plain_new_only_s"]
    out["hit_over_plain_new_only_median"] = out["hit_median_s"] / out["plain_new_only_median_s"]
    return out


def program_timeline(events: list[Event]) -> dict[str, dict]:
    """When each program of one prefill ran on the device: its first kernel's start and its last
    kernel's end, in ms from the prefill's first kernel; transfers outside any program are left
    out. The device idles between one program's end and the next one's start while the host
    dispatches."""
    spans = {}
    for e in events:
        if e.module in ("", "?"):
            continue
        first, last = spans.get(e.module, (e.start_ns, e.start_ns + e.duration_ns))
        spans[e.module] = (min(first, e.start_ns), max(last, e.start_ns + e.duration_ns))
    origin = min((first for first, _ in spans.values()), default=0.0)
    return {module: {"start_ms": (first - origin) / 1e6, "end_ms": (last - origin) / 1e6}
            for module, (first, last) in spans.items()}


def decode_ms(llm: LLM, ids: list[int], steps: int) -> tuple[float, float]:
    """(ms a decode-loop step, tokens a step) over `steps` steps after a warm-up call."""
    state = llm.decode(llm.prefill([ids], [LONG]), 2)
    before = int(state.lengths[0])
    t = time.perf_counter()
    state = llm.decode(state, steps)
    jax.block_until_ready(state.tokens)
    return 1e3 * (time.perf_counter() - t) / steps, (int(state.lengths[0]) - before) / steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="27b")
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (a quick probe)")
    ap.add_argument("--prefix", type=int, default=16384, help="shared prefix tokens")
    ap.add_argument("--new", type=int, default=256, help="tokens after the prefix, different per request")
    ap.add_argument("--block", type=int, default=256, help="prefix_block_size")
    ap.add_argument("--budget-gb", type=float, default=24.0, help="prefix_cache_gb")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--decode-context", type=int, default=2048, help="prompt tokens before the timed decode")
    ap.add_argument("--repeats", type=int, default=4, help="plain prefills and hits timed in a row, per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of plain prefills and hits, alternating")
    ap.add_argument("--skip-decode", action="store_true", help="time the prefills only")
    ap.add_argument("--profile", action="store_true",
                    help="trace two plain prefills and two hits: device ms per program")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    cfg = geometry_config(args.geometry, args.layers)
    model = random_model(cfg)
    length = args.prefix + args.new
    room = -(-(length + 2 * args.steps + 64) // args.block) * args.block  # one cache length for both LLMs
    common = dict(model=model, max_model_len=room, max_num_seqs=1)
    plain = LLM(**common)
    cached = LLM(**common, enable_prefix_caching=True, prefix_block_size=args.block, prefix_cache_gb=args.budget_gb)
    prefix, other, *news = random_prompts(cfg, 14 + 2 * args.rounds * args.repeats, args.prefix, seed=1)
    news = iter(n[:args.new] for n in news)  # each hit needs a suffix the store has not seen
    out = {"geometry": args.geometry, "layers": cfg.num_hidden_layers, "device": jax.devices()[0].device_kind,
           "prefix": args.prefix, "new": args.new, "block": args.block}

    ttft_s(plain, next(news))  # compiles
    try:  # the whole prompt in one pass: attention over it at once may not fit
        ttft_s(plain, other + next(news))
        out["plain_full_s"] = ttft_s(plain, prefix + next(news))
    except jax.errors.JaxRuntimeError as e:
        out["plain_full_s"] = f"failed: {str(e).splitlines()[0][:200]}"
    ttft_s(cached, other + next(news))  # compiles every block program on another prefix: a miss,
    ttft_s(cached, other + next(news))  # then a hit
    out["miss_s"] = ttft_s(cached, prefix + next(news))
    out.update(plain_and_hits(plain, cached, prefix, news, args.rounds, args.repeats))
    out["hit_parts_s"] = hit_parts(cached, prefix + next(news))
    if args.profile:  # where a plain prefill's and a hit's device time goes, program by program
        out["device_ms"] = {"plain": device_time(plain, [next(news) for _ in range(2)]),
                            "hit": device_time(cached, [prefix + next(news) for _ in range(2)])}
    store = cached.engine.prefix_cache
    out["store"] = store.stats()
    out["store_bytes_per_token"] = store.bytes / (len(store.blocks) * args.block)
    print(json.dumps(out), flush=True)

    spec = synthetic({"method": "mtp", "num_speculative_tokens": 1}, 0.85)
    runs = () if args.skip_decode else (("plain", plain, cached),
                                        ("mtp k=1 a=0.85", plain.with_speculation(spec), cached.with_speculation(spec)))
    for name, off, on in runs:
        for label, llm in (("caching off", off), ("caching on", on)):
            ms, per_step = decode_ms(llm, other[:args.decode_context], args.steps)
            out.setdefault("decode", []).append({"method": name, "caching": label, "step_ms": ms,
                                                 "tokens_per_step": per_step, "ms_per_token": ms / per_step})
            print(json.dumps(out["decode"][-1]), flush=True)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
