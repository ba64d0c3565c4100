"""Batch-invariant mode on the GPU: greedy speculation against plain decoding token for token, with
the mode on and off, at batch 1 and in mixed batches of 8; and what the mode costs at 27B dims.

    python -m bench.batch_invariant --model spec_jax/assets/default --out results/bi_default
    python -m bench.batch_invariant --geometry 27b --layers 8 --out results/bi_27b
    python -m bench.batch_invariant --geometry 27b --cost --out results/bi_cost_27b
    python -m bench.batch_invariant --geometry 35b-a3b --layers 8 --modes on --methods mtp ngram --out results/bi_35b

Equality: prompt i has `prompt_tokens + (37 i mod 64)` tokens, so the rows of a batch of 8 sit at
different positions in every pass. In each mode, plain decoding at batch 1 is the reference and
every other run (plain at batch 8, each method at batch 1 and 8) is compared with it token for
token. Where an output leaves it, the first differing position is reported with the target's
logit gap between the two tokens there (from a plain forward over the shared prefix) in units of
bf16's spacing at that logit: a divergence only bf16 rounding explains sits at a gap of a few
units. Methods: the trained model's drafters (`bench.acceptance.speculative_configs`), or random
drafters made on the device for a random geometry (ngram always drafting, so every step
verifies), plus the oracle at k = 3 (`bench.oracle`), whose drafts are the same batch's plain
decoding's own continuation, every one right.

Cost (--cost): decode ms a token with the mode and without, plain and MTP k = 3 at a synthetic
acceptance of 0.85, batch 1 and 8, the second run of each timed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax

from bench.acceptance import prompts_for, speculative_configs
from bench.models import geometry_config, random_drafter, random_model, random_prompts
from bench.oracle import KnownSequences, resolved
from bench.scale import always_drafting, synthetic
from spec_jax import LLM, SamplingParams

ORACLE = {"method": "oracle", "num_speculative_tokens": 3}  # corruption 0: every draft right (bench.oracle)
# (method, k, drafter network to make) for a random geometry; DFlash at block 8 as the trained one
RANDOM_METHODS = (("mtp", 1, None), ("mtp", 3, None), ("ngram", 3, None), ("dflash", 7, "dflash"),
                  ("eagle3", 3, "eagle3"), ("draft_model", 3, "draft_model"))


def mixed_prompts(base: list[list[int]], tokens: int) -> list[list[int]]:
    """Prompt i cut to tokens + (37 i mod 64) ids: a batch's rows end at different positions."""
    return [p[:tokens + (37 * i) % 64] for i, p in enumerate(base)]


def bf16_spacing(x: float) -> float:
    """The gap between adjacent bf16 values at magnitude |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def first_divergence(reference: LLM, prompt, got, want) -> dict | None:
    """Where got leaves want: its index, and the target's logit gap between the two tokens there
    in bf16 spacings of the larger logit."""
    if got == want:
        return None
    n = min(len(got), len(want))
    i = next((j for j in range(n) if got[j] != want[j]), n)
    if i == n:
        return {"at": i, "length_differs": True}
    logits = reference.logits(prompt + want[:i])[-1].astype(float)
    a, b = logits[want[i]], logits[got[i]]
    gap = abs(float(a - b))
    return {"at": i, "gap": gap, "gap_in_bf16_spacings": gap / bf16_spacing(max(abs(a), abs(b))),
            "top": float(logits.max()), "wanted_is_top": bool(logits.argmax() == want[i])}


def greedy(llm: LLM, prompts, new_tokens: int) -> tuple[list[list[int]], dict]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    run = {"run_s": time.perf_counter() - t}
    for key in ("acceptance_rate", "mean_acceptance_length"):
        if key in llm.metrics:
            run[key] = llm.metrics[key]
    return [o.outputs[0].token_ids for o in outs], run


def method_list(args, cfg) -> list[tuple[str, dict, object]]:
    """(name, speculative config, drafter network or None) for each method to compare that
    --methods names (a random drafter is made only for those)."""
    wanted = lambda name: args.methods is None or name.startswith(tuple(args.methods))  # noqa: E731
    if args.model:
        specs = speculative_configs(Path(args.model), has_mtp=cfg.mtp_num_hidden_layers > 0)
        named = [(f"{s['method']} k={s['num_speculative_tokens']}", s) for s in specs] + [("oracle k=3", ORACLE)]
        return [(name, spec, None) for name, spec in named if wanted(name)]
    out = []
    for method, k, drafter in RANDOM_METHODS:
        if not wanted(f"{method} k={k}"):
            continue
        draft = random_drafter(drafter, cfg, block_size=k + 1) if drafter else None
        config = {"method": method, "num_speculative_tokens": k, **({"model": "random"} if drafter else {})}
        out.append((f"{method} k={k}", config, draft))
    return out + [("oracle k=3", ORACLE, None)] * wanted("oracle k=3")


def equality(args, model_or_path, cfg, prompts, record) -> None:
    """Every method's greedy tokens against plain batch-1 decoding, in each mode, at each batch:
    a row each to record(row)."""
    methods = method_list(args, cfg)
    for invariant in [mode == "on" for mode in args.modes]:
        for batch in sorted(set(args.batch) | {1}):  # batch 1's plain run is the reference
            llm = LLM(model=model_or_path, max_num_seqs=batch, batch_invariant=invariant,
                      max_model_len=max(map(len, prompts)) + args.new_tokens + 32)
            plain, run = greedy(llm, prompts, args.new_tokens)
            if batch == 1:
                reference, reference_llm = plain, llm

            def compare(name, tokens, run):  # recorded as each run ends: a run cut short keeps the rows before
                where = [first_divergence(reference_llm, p, got, want) for p, got, want in zip(prompts, tokens,
                                                                                                reference)]
                record({"batch_invariant": invariant, "batch": batch, "method": name,
                        "same": sum(w is None for w in where), "prompts": len(prompts),
                        "divergences": [w for w in where if w is not None], **run})

            if batch > 1:
                compare("off", plain, run)
            known = KnownSequences(list(zip(prompts, plain)))
            for name, config, draft in methods if batch in args.batch else ():  # batch 1 only as the reference
                if config["method"] == "ngram" and not args.model:
                    config = {**config, "proposer": always_drafting(config)}
                spec = llm.with_speculation(resolved(config, known, cfg.vocab_size), draft=draft)
                compare(name, *greedy(spec, prompts, args.new_tokens))


def cost(args, model, cfg, record) -> None:
    """Decode ms a token with the mode on and off: plain and MTP k=3 at synthetic acceptance 0.85:
    a row each to record(row)."""
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for batch in args.batch:
        prompts = random_prompts(cfg, batch, args.prompt_tokens)
        for invariant in (False, True):
            llm = LLM(model=model, max_num_seqs=batch, batch_invariant=invariant,
                      max_model_len=args.prompt_tokens + args.new_tokens + 32)
            for name, run in (("off", llm), ("mtp k=3 a=0.85", llm.with_speculation(
                    synthetic({"method": "mtp", "num_speculative_tokens": 3}, 0.85)))):
                run.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # compiles
                outs = run.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
                m = outs[0].metrics
                generated = sum(o.metrics["num_generated_tokens"] - 1 for o in outs) / batch
                record({"batch": batch, "batch_invariant": invariant, "method": name,
                        "ms_per_token": 1e3 * m["decode_s"] / generated,
                        "step_ms": 1e3 * m["decode_s"] / m["batch_decode_steps"],
                        "prefill_ms": 1e3 * m["prefill_s"]})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a trained export with its drafters (spec_jax/assets/default)")
    ap.add_argument("--geometry", default=None, help="or a released geometry with random weights (27b)")
    ap.add_argument("--layers", type=int, default=None, help="keep this many decoder layers of the geometry")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=65,
                    help="the shortest prompt (others up to 63 longer: from 65, all in the 128-token prefill bucket, "
                         "so each batch size compiles one prefill)")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="rows per batch")
    ap.add_argument("--methods", nargs="+", default=None, help="equality: only methods whose name starts so")
    ap.add_argument("--modes", nargs="+", choices=["on", "off"], default=["on", "off"], help="equality: which modes")
    ap.add_argument("--cost", action="store_true", help="time the mode against the default instead")
    ap.add_argument("--out", required=True, help="write OUT.json")
    args = ap.parse_args(argv)
    if (args.model is None) == (args.geometry is None):
        ap.error("give one of --model and --geometry")
    out = Path(args.out).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": jax.devices()[0].device_kind, "args": vars(args), "rows": []}

    def record(row: dict) -> None:  # the file rewritten after every row: a run cut short keeps them
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    if args.model:
        base = LLM(model=args.model, max_model_len=args.prompt_tokens + 64)
        model, cfg = args.model, base.cfg
        prompts = mixed_prompts(prompts_for("code", argparse.Namespace(corpus=None, prompts=args.prompts,
                                                                       prompt_tokens=args.prompt_tokens + 64), base),
                                args.prompt_tokens)
    else:
        cfg = geometry_config(args.geometry, args.layers)
        model = random_model(cfg)
        prompts = mixed_prompts(random_prompts(cfg, args.prompts, args.prompt_tokens + 64), args.prompt_tokens)
    if args.cost:
        cost(args, model, cfg, record)
    else:
        equality(args, model, cfg, prompts, record)


if __name__ == "__main__":
    main()
