"""Speculation on against off: decode tokens/s, acceptance figures and speedup, one model load.

    python -m bench.speculative --geometry 0.8b --batch 1 8 \
        --spec '{"method":"oracle","num_speculative_tokens":3,"oracle_corruption_rate":0.2}' \
        --spec '{"method":"mtp","num_speculative_tokens":1}' --rollback checkpoint replay
    python -m bench.speculative --model DIR --prompts prompts.txt --spec '{"method":"ngram","num_speculative_tokens":3}'

Each configuration runs once to compile and is timed on a second run. Decode time excludes
prefill. "step ms" is the decode time over the batch's decode steps; the speedup bound for a
drafter that costs nothing is mean acceptance length x (plain step ms / spec step ms).
Method "oracle" (`bench.oracle`) proposes the plain run's own continuation, each token corrupted
at `oracle_corruption_rate` (default 0), so speed is measured at a controlled acceptance without
trained weights.
A drafter method with `"model": "random"` gets a random drafter fitted to the target, made on the
device (`bench.models.random_drafter`), which measures the drafting cost at (near) zero acceptance;
without --model the target is a random --geometry model made on the device (`bench.models`).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from bench.models import GEOMETRIES, geometry_config, random_drafter, random_model
from bench.oracle import KnownSequences, resolved
from spec_jax import LLM, SamplingParams


def measure(llm: LLM, prompts, params) -> tuple[dict, list]:
    """The second run's figures, and its RequestOutputs."""
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # compile
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    m = outs[0].metrics
    generated = sum(o.metrics["num_generated_tokens"] - 1 for o in outs)  # the first comes from prefill
    row = {"decode_tok_s": generated / m["decode_s"], "step_ms": 1e3 * m["decode_s"] / m["batch_decode_steps"],
           "decode_s": m["decode_s"]}
    for key in ("acceptance_rate", "mean_acceptance_length", "acceptance_per_position"):
        if key in llm.metrics:
            row[key] = llm.metrics[key]
    return row, outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a random --geometry model)")
    ap.add_argument("--geometry", default="0.8b", choices=GEOMETRIES)
    ap.add_argument("--prompts", default=None, help="a text file, one prompt per line (needs a tokenizer)")
    ap.add_argument("--spec", action="append", required=True, help="a speculative config (JSON); repeat")
    ap.add_argument("--rollback", nargs="+", default=["checkpoint"], choices=["checkpoint", "replay"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=None, help="append the result rows to this file")
    args = ap.parse_args()

    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    target = args.model or random_model(geometry_config(args.geometry), dtype)
    base = LLM(model=target, dtype=args.dtype, max_num_seqs=max(args.batch),
               max_model_len=args.prompt_len + args.new_tokens + 64)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    if args.prompts:
        lines = [line.strip() for line in open(args.prompts) if line.strip()]
        pool = [base.tokenizer.encode(line)[: args.prompt_len] for line in lines]
    else:
        pool = [rng.integers(0, base.cfg.vocab_size, args.prompt_len).tolist() for _ in range(max(args.batch))]
    drafters = {}
    rows = []
    for B in args.batch:
        prompts = [pool[i % len(pool)] for i in range(B)]
        plain, plain_outs = measure(base, prompts, params)
        known = KnownSequences.of_outputs(plain_outs)  # what an oracle config drafts
        print(json.dumps({"batch": B, "spec": None, **plain}), flush=True)
        for spec in args.spec:
            parsed = json.loads(spec)
            draft = None
            if parsed.get("model") == "random":
                draft = drafters.setdefault(spec, random_drafter(parsed["method"], base.cfg))
            for rollback in args.rollback:
                t = time.perf_counter()
                config = resolved(parsed, known, base.cfg.vocab_size)
                r, _ = measure(base.with_speculation(config, rollback=rollback, draft=draft), prompts, params)
                r.update(batch=B, spec=parsed, rollback=rollback, device=jax.devices()[0].device_kind,
                         speedup=r["decode_tok_s"] / plain["decode_tok_s"],
                         verify_over_decode_step=r["step_ms"] / plain["step_ms"],
                         free_draft_bound=r.get("mean_acceptance_length", 1.0) * plain["step_ms"] / r["step_ms"],
                         plain_tok_s=plain["decode_tok_s"], wall_s=time.perf_counter() - t)
                rows.append(r)
                print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
