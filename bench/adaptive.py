"""Adaptive verification against every fixed k and plain decoding, per batch size and acceptance:
the grid of issue 53 at Qwen3.6-27B geometry (random weights made on the device, `bench.models`),
synthetic acceptance (vLLM's `rejection_sample_method: synthetic`, i.i.d. per position), all in
one process with plain decoding measured beside it.

    python -m bench.adaptive --layers 16 --json adaptive.json                # the whole grid
    python -m bench.adaptive --methods mtp --batch 1 8 --layers 16           # a part of it

Methods: "mtp" (the target's MTP head; fixed k = each of --mtp-k, each its own program, against
adaptive with k = max(--mtp-k)), and "dflash" (a random DFlash drafter of block 16, so k = 15
drafts a step; fixed k = each of --dflash-k, verified as a prefix of the block: the adaptive
program forced to that width, since a block-16 drafter only runs with k = 15; plus k = 15 as its
own program, which shows what the choice between widths costs). Per cell: tokens/s of the timed
(second) run, "x of plain" and the adaptive run's share of the best fixed k ("% of best"), the
mean verify length adaptive chose, and per batch bucket the step times it measured per width.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax

from bench.models import GEOMETRIES, geometry_config, random_drafter, random_model, random_prompts
from bench.scale import at_acceptance, synthetic
from spec_jax import LLM, SamplingParams
from spec_jax.engine.adaptive import CALIBRATION_ROUNDS, CALIBRATION_STEPS, StepTimes, compiled_widths, forcing
from spec_jax.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, claim_device_memory

DFLASH_BLOCK = 16


def timed_run(llm: LLM, batch: int, new_tokens: int, prompt_len: int) -> dict:
    """One greedy run of `batch` rows of `new_tokens` each: decode tokens/s and the step figures."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=random_prompts(llm.cfg, batch, prompt_len), sampling_params=params,
                        use_tqdm=False)
    m = outs[0].metrics
    row = {"tok_s": batch * (new_tokens - 1) / m["decode_s"], "step_ms": 1e3 * m["decode_s"] / m["batch_decode_steps"]}
    if "num_drafts" in m:
        total = llm.metrics
        row.update(mean_verify_length=total["mean_verify_length"], mean_acceptance_length=total[
            "mean_acceptance_length"])
    return row


def warm_tokens(new_tokens: int) -> int:
    """Tokens of a warm-up run: enough steps at acceptance 0 (one token each) to calibrate k = 15."""
    return max(new_tokens, (1 + CALIBRATION_ROUNDS * CALIBRATION_STEPS) * len(compiled_widths(DFLASH_BLOCK - 1)) + 8)


def warm(llm: LLM, batch: int, new_tokens: int, prompt_len: int) -> None:
    """Compile the bucket's programs and, under an adaptive plan, time its widths (a run at
    acceptance 0 emits one token a step)."""
    spec = llm.speculative_config
    timed_run(at_acceptance(llm, 0.0) if spec is not None else llm, batch, warm_tokens(new_tokens), prompt_len)
    plan = llm.engine.plan
    if plan is not None and plan.adaptive and not llm.engine.step_times[batch].done:
        raise SystemExit(f"the warm-up run of batch {batch} ended before its widths were timed")


def cells(llm: LLM, label: dict, batches, accepts, new_tokens, prompt_len, force: int | None = None) -> list[dict]:
    """Timed runs of a speculating `llm` at every batch size and acceptance; with `force`, the
    adaptive program held at widths[force] (the bucket's measured step times kept aside)."""
    rows = []
    for B in batches:
        warm(llm, B, new_tokens, prompt_len)
        kept = llm.engine.step_times.get(B)
        if force is not None:
            llm.engine.step_times[B] = StepTimes.measured(forcing(len(llm.engine.plan.widths), force))
        for a in accepts:
            rows.append({**label, "batch": B, "acceptance": a,
                         **timed_run(at_acceptance(llm, a), B, new_tokens, prompt_len)})
            print(json.dumps(rows[-1]), flush=True)
        if force is not None and kept is not None:
            llm.engine.step_times[B] = kept
        elif force is not None:
            llm.engine.step_times.pop(B)
    return rows


def method_rows(llm: LLM, method: str, args) -> tuple[list[dict], dict]:
    """Every run of one method: (rows, the adaptive plan's measured step times per batch bucket)."""
    run = dict(batches=args.batch, accepts=args.acceptance, new_tokens=args.new_tokens, prompt_len=args.prompt_len)
    rows = []
    if method == "mtp":
        for k in args.mtp_k:
            fixed = llm.with_speculation(synthetic({"method": "mtp", "num_speculative_tokens": k,
                                                    "enable_adaptive_verification": False}, 0.0))
            rows += cells(fixed, {"method": method, "config": "fixed", "k": k}, **run)
        k, draft = max(args.mtp_k), None
    else:
        k, draft = DFLASH_BLOCK - 1, random_drafter("dflash", llm.cfg, block_size=DFLASH_BLOCK)
    base = {"method": method, "num_speculative_tokens": k, "model": "random, made on the device"} if draft else {
        "method": method, "num_speculative_tokens": k}
    adaptive = llm.with_speculation(synthetic(base, 0.0), draft=draft)
    rows += cells(adaptive, {"method": method, "config": "adaptive", "k": k}, **run)
    if method == "dflash":
        widths = adaptive.engine.plan.widths
        for w in args.dflash_k:
            if w not in widths:
                raise SystemExit(f"--dflash-k {w} is not a compiled width of k = {k}: {widths}")
            rows += cells(adaptive, {"method": method, "config": "fixed", "k": w, "held": True}, force=widths.index(w),
                          **run)
        if not args.no_fixed_program:
            fixed = llm.with_speculation(synthetic({**base, "enable_adaptive_verification": False}, 0.0), draft=draft)
            rows += cells(fixed, {"method": method, "config": "fixed_program", "k": k}, **run)
    times = {B: {"widths": list(adaptive.engine.plan.widths), "step_ms": [1e3 * float(t) for t in s.times()]}
             for B, s in adaptive.engine.step_times.items()}
    print(json.dumps({"method": method, "measured_step_times": times}), flush=True)
    return rows, times


def grid(rows: list[dict], plain: dict[int, float]) -> list[dict]:
    """Per method, batch and acceptance: plain tok/s, the best fixed k, adaptive, and the ratios."""
    out = []
    for key in sorted({(r["method"], r["batch"], r["acceptance"]) for r in rows}):
        cell = [r for r in rows if (r["method"], r["batch"], r["acceptance"]) == key]
        fixed = [r for r in cell if r["config"] == "fixed"]
        best = max(fixed, key=lambda r: r["tok_s"]) if fixed else None
        adaptive = next(r for r in cell if r["config"] == "adaptive")
        method, B, a = key
        out.append({"method": method, "batch": B, "acceptance": a, "plain_tok_s": plain[B],
                    "best_fixed_k": best and best["k"], "best_fixed_x_plain": best and best["tok_s"] / plain[B],
                    "adaptive_x_plain": adaptive["tok_s"] / plain[B],
                    "adaptive_of_best_fixed": best and adaptive["tok_s"] / best["tok_s"],
                    "adaptive_mean_verify_length": adaptive["mean_verify_length"],
                    "fixed_x_plain": {r["k"]: r["tok_s"] / plain[B] for r in fixed}})
    return out


def print_grid(table: list[dict]) -> None:
    print(f"{'method':<7} {'B':>3} {'a':>5} {'plain tok/s':>11} {'best k':>6} {'best x':>7} {'adaptive x':>10} "
          f"{'% of best':>9} {'verify len':>10}  fixed k: x of plain")
    for r in table:
        fixed = " ".join(f"k{k}={x:.2f}" for k, x in r["fixed_x_plain"].items())
        print(f"{r['method']:<7} {r['batch']:>3} {r['acceptance']:>5.2f} {r['plain_tok_s']:>11.1f} "
              f"{r['best_fixed_k']!s:>6} {r['best_fixed_x_plain'] or 0:>6.2f}x {r['adaptive_x_plain']:>9.2f}x "
              f"{r['adaptive_of_best_fixed'] or 0:>8.1%} {r['adaptive_mean_verify_length']:>10.2f}  {fixed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="27b", choices=GEOMETRIES)
    ap.add_argument("--layers", type=int, default=None, help="keep only this many target layers (cheaper runs)")
    ap.add_argument("--methods", nargs="+", default=["mtp", "dflash"], choices=["mtp", "dflash"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.3, 0.6, 0.85],
                    help="synthetic per-position acceptance")
    ap.add_argument("--mtp-k", type=int, nargs="+", default=[1, 2, 3], help="MTP's fixed k; adaptive takes the most")
    ap.add_argument("--dflash-k", type=int, nargs="+", default=[1, 3, 7, 15],
                    help=f"DFlash's fixed k, among the compiled widths of k = {DFLASH_BLOCK - 1}")
    ap.add_argument("--no-fixed-program", action="store_true",
                    help="skip DFlash k = 15 as a program of its own (saves its compiles)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens a row generates in a timed run")
    ap.add_argument("--json", default=None, help="write every result here (rewritten after each method)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    args = ap.parse_args()

    claim_device_memory(args.gpu_memory_utilization)
    t0 = time.perf_counter()
    cfg = geometry_config(args.geometry, args.layers)
    model = random_model(cfg)
    llm = LLM(model=model, max_model_len=args.prompt_len + warm_tokens(args.new_tokens) + DFLASH_BLOCK,
              max_num_seqs=max(args.batch), batch_buckets=args.batch)
    result = {"geometry": args.geometry, "layers": cfg.num_hidden_layers, "device": jax.devices()[0].device_kind,
              "args": vars(args), "plain": {}, "rows": [], "step_times": {}}
    save = lambda: args.json and pathlib.Path(args.json).write_text(json.dumps(result, indent=1))  # noqa: E731
    for B in args.batch:
        warm(llm, B, args.new_tokens, args.prompt_len)
        result["plain"][B] = timed_run(llm, B, args.new_tokens, args.prompt_len)["tok_s"]
        print(json.dumps({"config": "plain", "batch": B, "tok_s": result["plain"][B]}), flush=True)
    for method in args.methods:
        rows, times = method_rows(llm, method, args)
        result["rows"] += rows
        result["step_times"][method] = times
        result["grid"] = grid(result["rows"], result["plain"])
        save()
    print(f"{args.geometry}, {cfg.num_hidden_layers} layers, widths {compiled_widths(DFLASH_BLOCK - 1)} for "
          f"k = {DFLASH_BLOCK - 1}; {time.perf_counter() - t0:.0f} s")
    print_grid(result["grid"])
    save()


if __name__ == "__main__":
    main()
