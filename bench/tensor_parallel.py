"""Tensor parallelism at the scale users run it: per tensor-parallel size, plain decode at each
batch size against each device's share of the weight bytes over its measured copy rate, where one
device's decode-step GPU time goes (all-reduces included, `--profile`), MTP k=1 and DFlash at a
controlled acceptance (speedup over the same size's plain decode and over TP = 1's), and greedy
output on `--prompts` prompts against TP = 1's (a divergence reported with the logit gap of its
two tokens, so a near-tie reads off the JSON). Random weights of a released geometry, drawn with
one seed on the first device for every size (so every size runs the same model) and split over
the mesh by `LLM(..., tensor_parallel_size=N)`.

    python -m bench.tensor_parallel --geometry 27b --tp 1 2 4 --batch 1 8 --profile --out results/tp.json
    python -m bench.tensor_parallel --geometry 27b --layers 8 --tp 1 2 --methods   # quick probe, no methods

Sizes run in the order given, one at a time (the last one's arrays freed first); the equality
needs TP = 1 first.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib

import jax

from bench.batch_invariant import first_divergence, greedy
from bench.models import GEOMETRIES, geometry_config, random_drafter, random_model, random_prompts, streamed_bytes
from bench.common import Ceilings
from bench.scale import DRAFTER_BLOCK, METHODS, decode_rows, profile_decode, spec_rows, synthetic
from spec_jax import LLM

DEFAULT_METHODS = ("mtp1", "dflash")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="27b", choices=GEOMETRIES)
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (a quick probe)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes, TP = 1 first")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens of the timed plain decode")
    ap.add_argument("--profile", action="store_true", help="trace --steps decode steps per batch size on GPU 0")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--methods", nargs="*", default=list(DEFAULT_METHODS), choices=METHODS)
    ap.add_argument("--acceptance", type=float, default=0.85)
    ap.add_argument("--spec-new-tokens", type=int, default=256)
    ap.add_argument("--cost-tokens", type=int, default=65, help="tokens of the run that measures a method's c")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of the greedy equality against TP = 1")
    ap.add_argument("--equal-tokens", type=int, default=128, help="greedy tokens per prompt of the equality")
    ap.add_argument("--out", default=None, help="write the results as JSON here (rewritten after each size)")
    args = ap.parse_args(argv)
    if args.prompts and args.tp[0] != 1:
        ap.error(f"--tp {' '.join(map(str, args.tp))}: the greedy equality compares against TP = 1, which must "
                 f"come first (or pass --prompts 0)")
    if max(args.tp) > jax.device_count():
        ap.error(f"--tp {max(args.tp)} needs {max(args.tp)} devices; this machine has {jax.device_count()}")
    return args


def profile_rows(llm: LLM, args) -> list[dict]:
    """Per batch size, one device's decode step: busy ms, kernel ms, and the all-reduces' share."""
    rows = []
    for B in args.batch:
        prof = profile_decode(llm, B, args.prompt_len, args.steps, device=0)
        collective = prof["categories"].get("collective", {"us_per_call": 0.0, "count_per_call": 0.0})
        rows.append({"batch": B, "busy_ms": prof["busy_ms_per_call"], "kernel_ms": prof["kernel_ms_per_call"],
                     "collective_ms": collective["us_per_call"] / 1e3,
                     "collective_kernels": collective["count_per_call"]})
        print(json.dumps({"profile": rows[-1]}), flush=True)
    return rows


def method_rows(llm: LLM, cfg, args, plain_ms: dict, tp1_plain_ms: dict) -> list[dict]:
    """Each method at --acceptance and every batch size: `bench.scale.spec_rows`' row, plus the
    speedup over TP = 1's plain decode."""
    rows = []
    for name in args.methods:
        config, drafter = METHODS[name]
        draft = random_drafter(drafter, cfg, block_size=DRAFTER_BLOCK.get(name)) if drafter else None
        config = {**config, "model": "random, made on the device"} if drafter else config
        spec = llm.with_speculation(synthetic(config, 0.0), draft=draft)
        for B in args.batch:
            for row in spec_rows(spec, name, B, [args.acceptance], args.prompt_len, args.spec_new_tokens,
                                 plain_ms[B], args.cost_tokens):
                if "bound" in row and B in tp1_plain_ms:
                    row["speedup_over_tp1"] = row["tok_s"] / (B / (tp1_plain_ms[B] / 1e3))
                rows.append(row)
        del spec, draft
    return rows


def equality(llm: LLM, prompts, tokens, reference) -> dict:
    """Greedy output against TP = 1's (`reference`: its token lists; None at TP = 1 itself)."""
    got, _ = greedy(llm, prompts, tokens)
    if reference is None:
        return {"tokens": got}
    divergences = [d for d in (first_divergence(llm, p, g, w) for p, g, w in zip(prompts, got, reference)) if d]
    out = {"equal": sum(g == w for g, w in zip(got, reference)), "of": len(prompts), "divergences": divergences}
    print(json.dumps({"equality": out}), flush=True)
    return out


def run_size(tp: int, cfg, args, prompts, reference, tp1_plain_ms: dict, ceilings: Ceilings) -> dict:
    """One tensor-parallel size, its model and LLM freed when it returns."""
    model = random_model(cfg, args.dtype)
    weight_bytes = streamed_bytes(model)
    share = weight_bytes / tp
    llm = LLM(model=model, max_model_len=args.prompt_len + max(args.new_tokens, args.spec_new_tokens,
                                                                 args.equal_tokens) + 64,
              max_num_seqs=max([*args.batch, args.prompts]), tensor_parallel_size=tp)
    out = {"tp": tp, "weight_bytes": weight_bytes, "per_device_bytes": share,
           "per_device_floor_ms": 1e3 * ceilings.floor_s(share)}
    print(f"TP = {tp}: {weight_bytes / 1e9:.2f} GB read a step, {share / 1e9:.2f} GB a device, floor "
          f"{out['per_device_floor_ms']:.2f} ms ({ceilings.summary()})", flush=True)
    out["decode"] = decode_rows(llm, args.batch, args.prompt_len, args.new_tokens,
                                lambda batch: streamed_bytes(model, batch) / tp, ceilings)
    if args.profile:
        out["profile"] = profile_rows(llm, args)
    plain_ms = {row["batch"]: row["step_ms"] for row in out["decode"]}
    out["methods"] = method_rows(llm, cfg, args, plain_ms, tp1_plain_ms or plain_ms)
    if args.prompts:
        out["greedy"] = equality(llm, prompts, args.equal_tokens, reference)
    return out


def print_table(sizes: list[dict]) -> None:
    """The BENCHMARKS table: plain decode and each method per size and batch."""
    print("| TP | batch | plain ms/step | per-device floor | of floor | all-reduce ms/step |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        collective = {r["batch"]: r["collective_ms"] for r in size.get("profile", [])}
        for row in size["decode"]:
            c = collective.get(row["batch"])
            print(f"| {size['tp']} | {row['batch']} | {row['step_ms']:.2f} | {row['floor_ms']:.2f} | "
                  f"{row['of_floor']:.0%} | {'-' if c is None else f'{c:.2f}'} |")
    print("\n| TP | method | batch | acceptance | tok/s | over own plain | over TP = 1 plain | c |")
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for r in size["methods"]:
            if "bound" in r:
                print(f"| {size['tp']} | {r['method']} | {r['batch']} | {r['acceptance']:.2f} | {r['tok_s']:.1f} | "
                      f"{r['speedup']:.2f}x | {r.get('speedup_over_tp1', r['speedup']):.2f}x | {r['c']:.3f} |")


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = geometry_config(args.geometry, args.layers)
    prompts = random_prompts(cfg, args.prompts, args.prompt_len, seed=7) if args.prompts else []
    result = {"geometry": args.geometry, "layers": cfg.num_hidden_layers, "dtype": args.dtype,
              "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "sizes": []}
    reference, tp1_plain_ms = None, {}
    ceilings = Ceilings.measure()
    result["ceilings"] = vars(ceilings)
    for tp in args.tp:
        size = run_size(tp, cfg, args, prompts, reference, tp1_plain_ms, ceilings)
        gc.collect()  # the size's arrays go before the next size draws its model
        if tp == 1:
            if "greedy" in size:
                reference, size["greedy"] = size["greedy"]["tokens"], {"reference": True}
            tp1_plain_ms = {row["batch"]: row["step_ms"] for row in size["decode"]}
        result["sizes"].append(size)
        if args.out:
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print_table(result["sizes"])


if __name__ == "__main__":
    main()
