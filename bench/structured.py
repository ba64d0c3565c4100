"""What structured output costs, speculation on: constrained against unconstrained decoding per
token at batch 1 and 8, a mixed batch (one constrained row beside unconstrained ones: what the
others lose), and what drafting the grammar's forced tokens gives on JSON with long fixed keys.

    python -m bench.structured --geometry 27b --batch 1 8 --json structured.jsonl
    python -m bench.structured --geometry 27b --layers 16 --batch 1 8 --cost-only   # quicker compiles
    python -m bench.structured --model spec_jax/assets/default --batch 1 --forced-only   # the CPU figure

Without --model the target is a random --geometry model made on the device (`bench.models`) with a
synthetic tokenizer of its vocabulary size (a byte-level BPE trained on the standard library, the
rest of the ids filled with distinct made-up words), so llguidance builds its masks over as many
tokens as the real one. Acceptance is dialled (vLLM's synthetic rejection) so that both sides
accept alike. The constrained rows follow an array of at least MIN_ITEMS objects (a long key, a
bounded string, a bounded integer): JSON that never ends within the token budget. Each
configuration runs once to compile and is timed on a second run. Per step, the grammar's host work
the device waits on (included in "step ms"): "begin ms" (catching the matchers up, walking the
drafts) and "wait ms" (for masks not yet filled when the pass ended); "fill ms": the mask filling
that runs beside the device's target pass (`GrammarRows.begin_s`, `wait_s`, `fill_s`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import tempfile
from pathlib import Path

from bench.models import GEOMETRIES, geometry_config, random_model
from spec_jax import LLM, SamplingParams, StructuredOutputsParams
from spec_jax.default_model import train_tokenizer
from spec_jax.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, claim_device_memory

MIN_ITEMS = 400
ITEMS = {"type": "array", "minItems": MIN_ITEMS, "items": {
    "type": "object", "additionalProperties": False, "required": ["identifier_of_the_record", "value"],
    "properties": {"identifier_of_the_record": {"type": "string", "maxLength": 12},
                   "value": {"type": "integer", "minimum": 0, "maximum": 100000}}}}
# Long fixed keys, short values: most of the document is forced.
LONG_KEYS = {"type": "object", "additionalProperties": False,
             "properties": {key: {"type": "integer", "minimum": 0, "maximum": 9} for key in (
                 "customer_billing_address_line_one", "customer_billing_address_postal_code",
                 "customer_shipping_address_line_one", "customer_shipping_address_postal_code",
                 "preferred_contact_method_identifier", "number_of_previous_orders_this_year")}}
LONG_KEYS["required"] = list(LONG_KEYS["properties"])


def synthetic_tokenizer(vocab_size: int, folder: Path) -> Path:
    """A tokenizer.json of exactly vocab_size ids: a byte-level BPE trained on the standard library,
    then distinct made-up words (with and without a leading space) up to vocab_size."""
    tok = json.loads(train_tokenizer(vocab_size=min(vocab_size, 32000)).to_str())
    vocab = tok["model"]["vocab"]
    rng, letters = random.Random(0), "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < vocab_size:
        word = ("Ġ" if rng.random() < 0.5 else "") + "".join(rng.choice(letters) for _ in range(rng.randint(3, 10)))
        vocab.setdefault(word, len(vocab))
    path = folder / "tokenizer.json"
    path.write_text(json.dumps(tok))
    return path


def measure(llm: LLM, prompts, params) -> dict:
    """Decode figures of a batch (second run): step ms, tokens per step per row, ms per token, host ms."""
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # compile
    rows = llm.engine.grammar_rows() if any(p.structured for p in params) else None
    timers = ("begin_s", "wait_s", "fill_s")
    before = {name: getattr(rows, name) for name in (*timers, "calls", "forced")} if rows else {}
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    m = outs[0].metrics
    steps = m["batch_decode_steps"]
    per_row = [o.metrics["num_generated_tokens"] - 1 for o in outs]  # the first comes from prefill
    out = {"step_ms": 1e3 * m["decode_s"] / steps, "tokens_per_step": sum(per_row) / len(per_row) / steps,
           "ms_per_token": 1e3 * m["decode_s"] / (sum(per_row) / len(per_row)),
           "acceptance_rate": llm.metrics.get("acceptance_rate")}
    if rows:
        calls = max(rows.calls - before["calls"], 1)
        out.update({name.replace("_s", "_ms"): 1e3 * (getattr(rows, name) - before[name]) / calls for name in timers})
        out["forced_drafts"] = rows.forced - before["forced"]
    return out


def constrained(params: SamplingParams, schema: dict) -> SamplingParams:
    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema,
                                                                                 disable_any_whitespace=True))


def cost_rows(llm: LLM, batches, prompt_len: int, new_tokens: int) -> list[dict]:
    """Unconstrained, constrained and mixed batches, each row's figures."""
    plain = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    json_row = constrained(plain, ITEMS)
    rng = random.Random(0)
    results = []
    for B in batches:
        prompts = [[rng.randrange(llm.cfg.vocab_size) for _ in range(prompt_len)] for _ in range(B)]
        cases = {"unconstrained": [plain] * B, "constrained": [json_row] * B}
        if B > 1:
            cases["mixed (1 constrained)"] = [json_row] + [plain] * (B - 1)
        for name, params in cases.items():
            row = {"batch": B, "rows": name, **measure(llm, prompts, params)}
            print(json.dumps(row), flush=True)
            results.append(row)
    return results


def forced_rows(model, tokenizer, spec: dict, dtype: str, max_model_len: int, memory: float) -> list[dict]:
    """The long-keys document at batch 1, greedy, with the grammar's forced drafts on and off."""
    results = []
    params = constrained(SamplingParams(max_tokens=512, temperature=0.0), LONG_KEYS)
    for on in (True, False):
        llm = LLM(model=model, tokenizer=tokenizer, dtype=dtype, max_num_seqs=1, max_model_len=max_model_len,
                  speculative_config=spec, grammar_drafts=on, gpu_memory_utilization=memory)
        prompt = [llm.tokenizer.encode("Write the customer record as JSON:\n")]
        row = {"case": "long fixed keys", "grammar_drafts": on, **measure(llm, prompt, [params])}
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a random --geometry model)")
    ap.add_argument("--geometry", default="27b", choices=GEOMETRIES)
    ap.add_argument("--layers", type=int, default=None,
                    help="keep only this many target layers: quicker compiles; the grammar's host work is then a "
                         "larger share of a step than at full depth, so the cost measured is an upper bound")
    ap.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    ap.add_argument("--spec", default='{"method":"mtp","num_speculative_tokens":3,'
                                      '"rejection_sample_method":"synthetic","synthetic_acceptance_length":2.5}',
                    help="the speculative config (JSON)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--forced-only", action="store_true", help="only the forced-drafts comparison")
    ap.add_argument("--cost-only", action="store_true", help="only the cost rows (no forced-drafts comparison)")
    ap.add_argument("--json", default=None, help="append the result rows to this file")
    args = ap.parse_args()

    spec = json.loads(args.spec)
    claim_device_memory(args.gpu_memory_utilization)  # before the weights start the backend
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    max_model_len = args.prompt_len + args.new_tokens + 64
    with tempfile.TemporaryDirectory() as folder:
        if args.model:
            model, tokenizer = args.model, None
        else:
            model = random_model(geometry_config(args.geometry, args.layers), dtype)
            tokenizer = str(synthetic_tokenizer(model.cfg.vocab_size, Path(folder)))
        rows = []
        if not args.forced_only:
            llm = LLM(model=model, tokenizer=tokenizer, dtype=args.dtype, max_num_seqs=max(args.batch),
                      max_model_len=max_model_len, speculative_config=spec,
                      gpu_memory_utilization=args.gpu_memory_utilization)
            rows += cost_rows(llm, args.batch, args.prompt_len, args.new_tokens)
        if not args.cost_only:
            forced_spec = {k: v for k, v in spec.items() if not k.startswith(("rejection", "synthetic"))}
            rows += forced_rows(model, tokenizer, forced_spec, args.dtype, max(max_model_len, 640),
                                args.gpu_memory_utilization)
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps({"geometry": None if args.model else args.geometry, "layers": args.layers,
                                    "spec": spec, **row}) + "\n")


if __name__ == "__main__":
    main()
