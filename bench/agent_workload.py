"""Suffix decoding's workload: an agent session and prose, on the default model, with speculation
off and the `--configs` chosen (ngram, suffix, mtp, mtp+suffix: MTP with suffix decoding beside
it), adaptive verification on (the engine's default), greedy.

    python -m bench.agent_workload --model spec_jax/assets/default --json results/agent.json

Agent session (`--turns` turns on one held-out source file of this machine's Python): each turn
one request rewrites the current file (prompt: the file, a marker comment, the file's first
lines; the model writes the file out again) and one echoes a tool call (prompt: the file, then a
`grep -n def` of it, then the call's output cut to its first lines; the model goes on listing);
then the file gets a small edit (a name renamed, a line dropped) for the next turn. Prose:
held-out documentation windows continued. Requests run one at a time, as an agent waits for each
answer. Each configuration first runs the same session on another file (same prompt buckets: it
compiles, calibrates adaptive verification and leaves the suffix cache holding unrelated
outputs, as a server's would). Then `--rounds` rounds, each on another file and other prose
windows, every configuration in turn within a round; speedup: decode tokens/s over speculation
off's in the same round, the median over rounds reported (a shared CPU's speed drifts).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from spec_jax import LLM, SamplingParams
from spec_jax.training.corpus import heldout_texts

CONFIGS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix"},
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
    "mtp+suffix": {"method": "mtp", "num_speculative_tokens": 3, "enable_suffix_decoding": True},
}


def edited(text: str, turn: int) -> str:
    """A small edit: the turn's most frequent identifier renamed, and one line dropped."""
    names = re.findall(r"\b[a-z_][a-z0-9_]{3,}\b", text)
    lines = text.split("\n")
    if len(lines) > 4:
        del lines[len(lines) * (turn + 1) // (turn + 3)]
    text = "\n".join(lines)
    if names:
        common = max(set(names), key=names.count)
        text = re.sub(rf"\b{common}\b", f"{common}_{turn}", text)
    return text


def session(llm: LLM, source: str, turns: int, file_tokens: int) -> list[list[int]]:
    """The agent session's prompts (token ids) over `source`, cut to about file_tokens tokens."""
    encode = llm.tokenizer.encode
    prompts, text = [], llm.tokenizer.decode(encode(source)[:file_tokens])
    for turn in range(turns):
        lines = text.split("\n")
        prompts.append(encode(f"{text}\n\n# rewritten:\n" + "\n".join(lines[:3]) + "\n"))
        listing = [f"{i + 1}:{line}" for i, line in enumerate(lines) if re.match(r"\s*(def|class) ", line)]
        prompts.append(encode(f"{text}\n\n$ grep -n def\n" + "\n".join(listing) + "\n\n$ grep -n def\n"
                              + "\n".join(listing[:2]) + "\n"))
        text = edited(text, turn)
    return prompts


def prose(llm: LLM, n: int, tokens: int) -> list[list[int]]:
    """n held-out documentation windows of `tokens` tokens, evenly spaced."""
    stream = [t for text in heldout_texts("prose", 4_000_000) for t in llm.tokenizer.encode(text)]
    starts = np.linspace(0, len(stream) - tokens, n).astype(int)
    return [stream[s:s + tokens] for s in starts]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Each prompt alone, in turn: decode tokens/s and acceptance over all of them."""
    generated = decode_s = accepted = drafted = steps = 0
    for prompt in prompts:
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
        generated += out.metrics["num_generated_tokens"] - 1  # the first comes from prefill
        decode_s += out.metrics["decode_s"]
        steps += out.metrics["batch_decode_steps"]
        accepted += out.metrics.get("num_accepted_tokens", 0)
        drafted += out.metrics.get("num_draft_tokens", 0)
    return {"decode_tok_s": generated / decode_s, "tokens_per_step": generated / max(steps, 1),
            "generated": generated, "accepted": accepted, "drafted": drafted}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="spec_jax/assets/default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--file-tokens", type=int, default=600, help="the edited file's length in tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prose-prompts", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="rounds, each on another file and other prose windows")
    p.add_argument("--configs", default="ngram,suffix", help=f"which of {', '.join(CONFIGS)} (off always runs)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    base = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    sources = sorted((t for t in heldout_texts("code", 4_000_000) if len(t) > 6000), key=len)
    sessions = [session(base, source, args.turns, args.file_tokens) for source in sources[:args.rounds + 1]]
    texts = prose(base, args.prose_prompts * (args.rounds + 1), 256)
    windows = [texts[r::args.rounds + 1] for r in range(args.rounds + 1)]
    names = ["off"] + [n for n in args.configs.split(",") if n != "off"]
    llms = {name: base.with_speculation(CONFIGS[name]) for name in names}
    for llm in llms.values():  # round 0: compile, calibrate, and outputs in the suffix cache
        run(llm, sessions[0], params)
        run(llm, windows[0], params)
    rounds = []
    for r in range(1, args.rounds + 1):  # each round's configurations run in turn: a shared CPU drifts
        rounds.append({name: {"agent": run(llm, sessions[r], params), "prose": run(llm, windows[r], params)}
                       for name, llm in llms.items()})
    results = {}
    for name in names:
        for workload in ("agent", "prose"):
            speedups = [one[name][workload]["decode_tok_s"] / one["off"][workload]["decode_tok_s"] for one in rounds]
            row = {"config": name, "workload": workload, "speedup_median": float(np.median(speedups)),
                   "speedups": speedups, "tokens_per_step": [one[name][workload]["tokens_per_step"] for one in rounds],
                   "decode_tok_s": [one[name][workload]["decode_tok_s"] for one in rounds]}
            results[f"{name}/{workload}"] = row
            print(json.dumps(row))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
