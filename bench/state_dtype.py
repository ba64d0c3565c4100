"""What caching the GDN state in 16 bits (`mamba_ssm_cache_dtype`) does to a model's output: greedy
completions of held-out code and prose with the state in float32 and in the asked dtype, compared
token for token, and MTP's acceptance under each (k = 3, every draft verified).

    python -m bench.state_dtype                      # the default model, bf16 weights, bf16 state
    python -m bench.state_dtype --state float16 --prompts 16
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from models.qwen3_5 import STATE_DTYPES
from spec_jax import LLM, SamplingParams
from spec_jax.training.corpus import KINDS, heldout_texts


def completions(llm: LLM, kind: str, prompts: int, prompt_tokens: int, new_tokens: int) -> tuple[list, float]:
    """Greedy completions of `prompts` evenly spaced held-out documents of `kind`, and MTP's acceptance."""
    docs = [ids for ids in map(llm.tokenizer.encode, heldout_texts(kind)) if len(ids) >= prompt_tokens + 8]
    picked = [docs[i][:prompt_tokens] for i in np.linspace(0, len(docs) - 1, prompts).astype(int)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=picked, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.metrics["acceptance_rate"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    ap.add_argument("--dtype", default="bfloat16", help="the weights' dtype")
    ap.add_argument("--state", default="bfloat16", choices=[d for d in STATE_DTYPES if d != "float32"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per kind")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()
    spec = {"method": "mtp", "num_speculative_tokens": 3, "enable_adaptive_verification": False}
    runs = {}
    for state in ("float32", args.state):
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.prompt_tokens + args.new_tokens + 64,
                  max_num_seqs=args.prompts, batch_buckets=[args.prompts], mamba_ssm_cache_dtype=state,
                  speculative_config=spec)
        for kind in KINDS:
            runs[state, kind] = completions(llm, kind, args.prompts, args.prompt_tokens, args.new_tokens)
    for kind in KINDS:
        (full, full_acc), (half, half_acc) = runs["float32", kind], runs[args.state, kind]
        equal = [sum(a == b for a, b in zip(r, s)) for r, s in zip(full, half)]
        print(json.dumps({"kind": kind, "weights": args.dtype, "state": args.state, "rows": args.prompts,
                          "rows_identical": sum(r == s for r, s in zip(full, half)),
                          "tokens_equal": round(sum(equal) / sum(map(len, full)), 4),
                          "mtp_acceptance_float32_state": round(full_acc, 4),
                          f"mtp_acceptance_{args.state}_state": round(half_acc, 4)}), flush=True)


if __name__ == "__main__":
    main()
