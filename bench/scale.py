"""The engine at the scale users run it: Qwen3.6-27B or 35B-A3B geometry, random weights made on
the device (`bench.models`), driven through `LLM.generate` as a user would.

    python -m bench.scale --geometry 27b                       # plain decode, batch 1 and 8
    python -m bench.scale --geometry 27b --profile             # + where a decode step's GPU time goes
    python -m bench.scale --geometry 27b --layers 16 --layout rolled    # quick probe, another layout
    python -m bench.scale --geometry 0.8b --quantization nvfp4          # any geometry, any weight format
    python -m bench.scale --geometry 27b --batch 1 --methods mtp1 dflash # the method table (see spec_rows)
    python -m bench.scale --geometry 27b --batch --first-token --ttft 4096 16384   # compile time, prefill
    python -m bench.scale --geometry 27b --batch 1 32 --mamba-ssm-cache-dtype bfloat16  # GDN state in 16 bits

It first measures the device's copy rate and bf16 matmul rate (`bench.common.Ceilings`) and
states every floor against those. Per batch size it prints the time per decode step inside the
engine's own on-device loop (second run of a 128-token prompt, `--new-tokens` greedy tokens), the
weight bytes one step must read (`bench.models.streamed_bytes`: of a MoE model the experts a
batch of that many tokens chooses) over that time, the share of the copy rate that is, and the
device's peak memory so far. `--profile` traces `--steps` steps of `LLM.decode` and sums GPU time
per kernel category and per kernel. The JAX allocator takes `--gpu-memory-utilization` of the card.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before jax is imported: cold start counts the imports too

import argparse
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.common import Ceilings, peak_memory_GB
from bench.models import (GEOMETRIES, active_params, expert_bytes, geometry_config, nbytes, random_drafter,
                          random_model, random_prompts, streamed_bytes)
from bench.step_profile import busy_ns, summarize, trace_calls
from pallas_kernels.quant_formats import FORMATS
from proposers.ngram import NgramProposer
from spec_jax import LLM, SamplingParams
from spec_jax.engine.config import LAYOUTS, MAMBA_SSM_CACHE_DTYPES
from spec_jax.engine.memory import DEFAULT_GPU_MEMORY_UTILIZATION, claim_device_memory
from spec_jax.engine.spec_config import ACTED_FIELDS, parse_speculative_config


def decode_rows(llm: LLM, batches, prompt_len: int, new_tokens: int, step_bytes, ceilings: Ceilings) -> list[dict]:
    """Plain greedy generation per batch size: the first run compiles, the second is timed against
    the floor of reading `step_bytes(batch)` bytes at the measured copy rate."""
    rows = []
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for B in batches:
        prompts = random_prompts(llm.cfg, B, prompt_len)
        t = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        first_s = time.perf_counter() - t
        m = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[0].metrics
        step_s = m["decode_s"] / (new_tokens - 1)
        wbytes = step_bytes(B)
        floor = ceilings.floor_s(wbytes)
        rows.append({"batch": B, "step_ms": 1e3 * step_s, "prefill_ms": 1e3 * m["prefill_s"],
                     "weight_GB": wbytes / 1e9, "weight_TB_s": wbytes / step_s / 1e12, "of_floor": floor / step_s,
                     "floor_ms": 1e3 * floor, "first_run_s": first_s, "peak_memory_GB": peak_memory_GB()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


# The method table's rows: (speculative config, drafter network made on the device or None).
METHODS = {
    "mtp1": ({"method": "mtp", "num_speculative_tokens": 1}, None),
    "mtp2": ({"method": "mtp", "num_speculative_tokens": 2}, None),
    "mtp3": ({"method": "mtp", "num_speculative_tokens": 3}, None),
    "mtp1_v32k": ({"method": "mtp", "num_speculative_tokens": 1, "draft_vocab_size": 32768}, None),
    "mtp3_v32k": ({"method": "mtp", "num_speculative_tokens": 3, "draft_vocab_size": 32768}, None),
    "ngram": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}, None),
    "no_drafts": ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
                  None),
    "dflash": ({"method": "dflash", "num_speculative_tokens": 15}, "dflash"),
    "dflash_swa": ({"method": "dflash", "num_speculative_tokens": 15}, "dflash"),
    "dflash2": ({"method": "dflash", "num_speculative_tokens": 15}, "dflash"),
    "dspark": ({"method": "dspark", "num_speculative_tokens": 16}, "dspark"),
    "eagle3": ({"method": "eagle3", "num_speculative_tokens": 3}, "eagle3"),
    "draft_model": ({"method": "draft_model", "num_speculative_tokens": 3}, "draft_model"),
}
DRAFTER_BLOCK = {"dflash": 16, "dflash_swa": 16, "dflash2": 16, "dspark": 16}  # one block size for the table
# z-lab's newer drafters: Qwen3.6's layer pattern S,S,S,S,F (window 2048), and DFlash2 (all sliding,
# non-causal, convolutions and a selector of rank 256 over the top 16).
SLIDING = "sliding_attention"
DRAFTER_FIELDS = {
    "dflash_swa": {"layer_types": (SLIDING,) * 4 + ("full_attention",), "sliding_window": 2048},
    "dflash2": {"layer_types": (SLIDING,) * 5, "sliding_window": 2048, "causal": False, "conv_kernel_size": 2,
                "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
}


@dataclasses.dataclass(frozen=True)
class NgramAlwaysDrafting(NgramProposer):
    """Benchmark-only ngram: the lookup runs as usual, and a row it finds nothing for drafts k
    copies of its newest token. A random model's output never repeats its prompt, so without
    this ngram would never draft and its drafting step could not be timed; with synthetic
    acceptance the accepted copies then repeat, and the lookup hits as on real text."""

    def propose(self, model, draft, state, tokens, lengths, choose):
        drafts, n_draft, q, state = super().propose(model, draft, state, tokens, lengths, choose)
        newest = tokens[jnp.arange(tokens.shape[0]), lengths - 1]
        missed = n_draft == 0
        return jnp.where(missed[:, None], newest[:, None], drafts), jnp.where(missed, self.k, n_draft), q, state


def always_drafting(config: dict) -> NgramAlwaysDrafting:
    """The `NgramAlwaysDrafting` proposer of an ngram speculative config (its lookup window resolved
    as the engine resolves it)."""
    spec = parse_speculative_config(config)
    return NgramAlwaysDrafting(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)


def synthetic(config: dict, a: float) -> dict:
    """`config` with vLLM's synthetic rejection at i.i.d. per-position acceptance a: drafts 1..i
    are all accepted with probability a^i, the model the bound S assumes."""
    k = config["num_speculative_tokens"]
    return {**config, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [a ** (i + 1) for i in range(k)]}


def at_acceptance(llm: LLM, a: float) -> LLM:
    """A speculating `llm` dialled to acceptance a without recompiling: the rates are data, so
    `with_speculation` keeps its drafter, proposer and programs."""
    spec = llm.speculative_config
    config = {name: getattr(spec, name) for name in ACTED_FIELDS if name != "synthetic_acceptance_length"}
    return llm.with_speculation(synthetic(config, a), rollback=llm.engine.config.rollback)


def bound(a: float, k: int, c: float) -> float:
    """The speedup speculation can reach at i.i.d. acceptance a with k drafts whose step costs
    (k c + 1) decode steps: S = (1 - a^(k+1)) / ((1 - a)(k c + 1))."""
    tokens = k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * c + 1)


def spec_rows(llm: LLM, name: str, batch: int, accept: list[float], prompt_len: int, new_tokens: int,
              plain_step_ms: float, cost_tokens: int) -> list[dict]:
    """One method at one batch size: compile (first run, acceptance 0), then the cost ratio c from
    a `cost_tokens` run at acceptance 0 (every step emits one token, so its time is (k c + 1)
    decode steps), then per acceptance a the decode tokens/s,
    the speedup over spec off, the bound and the share reached. "no_drafts" runs ngram with every
    row opted out (`speculative=False`): its one row is the cost of a step where no row drafts."""
    k = llm.engine.plan.k
    prompts = random_prompts(llm.cfg, batch, prompt_len)
    rows, c = [], None
    for i, a in enumerate([0.0, *([] if name == "no_drafts" else accept)]):
        llm = at_acceptance(llm, a)
        params = SamplingParams(max_tokens=cost_tokens if i == 0 else new_tokens, temperature=0.0, ignore_eos=True,
                                speculative=name != "no_drafts")
        t = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        first_s = time.perf_counter() - t
        if i == 0:  # the first run compiled; time a second
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        m = outs[0].metrics
        steps = m["batch_decode_steps"]
        step_ms = 1e3 * m["decode_s"] / steps
        tok_s = batch * (params.max_tokens - 1) / m["decode_s"]
        plain_tok_s = batch / (plain_step_ms / 1e3)
        drafted_steps = sum(o.metrics["num_drafts"] for o in outs) / (batch * steps)
        mal = float(np.mean([o.metrics["mean_acceptance_length"] for o in outs]))
        if i == 0:
            c = (step_ms / plain_step_ms - 1) / k
            row = {"first_run_s": first_s}
        else:
            s_bound = bound(a, k, c)
            # The same bound at the acceptance length this run drew (a short run draws few steps).
            drawn = mal / (k * c + 1)
            row = {"bound": s_bound, "of_bound": (tok_s / plain_tok_s) / s_bound,
                   "bound_at_drawn": drawn, "of_bound_at_drawn": (tok_s / plain_tok_s) / drawn}
        rows.append({"method": name, "batch": batch, "k": k, "acceptance": a, "step_ms": step_ms, "tok_s": tok_s,
                     "speedup": tok_s / plain_tok_s, "c": c, "mean_acceptance_length": mal,
                     "steps_with_drafts": drafted_steps, **row})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def method_memory(llm: LLM, draft) -> dict:
    """Device bytes a method adds: its drafter's weights and its per-row state (one-row prefill)."""
    state = llm.prefill([[1, 2, 3]], SamplingParams(max_tokens=4))
    return {"draft_weights_GB": nbytes(nnx.state(draft)) / 1e9 if draft is not None else 0.0,
            "proposer_state_GB_per_row": nbytes(state.proposer) / 1e9}


def first_token(llm: LLM, prompt_len: int) -> dict:
    """Seconds from the process start (imports included) to the first generated token of one
    request, the compilation of every executable `generate` runs included."""
    t = time.perf_counter()
    llm.generate(prompt_token_ids=random_prompts(llm.cfg, 1, prompt_len),
                 sampling_params=SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    return {"compile_and_first_token_s": time.perf_counter() - t, "since_process_start_s": time.perf_counter() -
            PROCESS_START}


def ttft_rows(model, lengths: list[int], ceilings: Ceilings, layout: str, profile: bool = False) -> list[dict]:
    """Prefill time of one prompt of each length (second run), against its floor: the larger of
    2 x active decoder-layer params x tokens at the measured matmul rate (prefill runs every layer
    over every token, the lm_head over the last one only) and, of a MoE model, every expert's bytes
    read once at the measured copy rate. Its own LLM, so the decode figures keep their short cache.
    With `profile`, a third prefill of each length is traced (`profile_prefill`)."""
    params_count, experts = active_params(model), expert_bytes(model)
    llm = LLM(model=model, max_model_len=max(lengths) + 64, max_num_seqs=1, layout=layout)
    rows = []
    for n in lengths:
        prompts = random_prompts(llm.cfg, 1, n)
        one = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate(prompt_token_ids=prompts, sampling_params=one, use_tqdm=False)
        m = llm.generate(prompt_token_ids=prompts, sampling_params=one, use_tqdm=False)[0].metrics
        floor = ceilings.floor_s(experts, 2 * params_count * n)
        rows.append({"prompt_tokens": n, "ttft_s": m["prefill_s"], "floor_s": floor,
                     "of_floor": floor / m["prefill_s"], "peak_memory_GB": peak_memory_GB()})
        print(json.dumps(rows[-1]), flush=True)
        if profile:
            rows[-1]["profile"] = profile_prefill(llm, prompts)
            print_profile(rows[-1]["profile"])
    return rows


def profile_prefill(llm: LLM, prompts: list[list[int]]) -> dict:
    """GPU time of one prefill of `prompts` (the first token chosen), by category and by kernel."""
    one = SamplingParams(max_tokens=1, temperature=0.0)
    events, _, wall_ms = trace_calls(lambda: llm.prefill(prompts, one).tokens, (), 1)
    out = summarize(events, 1)
    out["busy_ms_per_step"] = busy_ns(events) / 1e6
    out["traced_wall_ms_per_step"] = wall_ms
    return out


def profile_decode(llm: LLM, batch: int, prompt_len: int, steps: int, device: int | None = None) -> dict:
    """GPU time per decode step inside the engine's loop (a speculative step for a speculating
    `llm`), by category and by kernel; of GPU `device` only when given (a tensor-parallel mesh)."""
    per_step = 1 + (llm.engine.plan.k if llm.engine.plan else 0)  # the most tokens a step emits
    params = SamplingParams(max_tokens=per_step * (steps + 2) + 8, temperature=0.0, ignore_eos=True)
    state = llm.prefill(random_prompts(llm.cfg, batch, prompt_len), params)
    state = llm.decode(state, 2)  # compiled already by generate; warm
    holder = [state]

    def run():
        holder[0] = llm.decode(holder[0], steps)
        return holder[0].tokens

    events, source, wall_ms = trace_calls(run, (), 1, device)
    out = summarize(events, steps)
    out["busy_ms_per_step"] = busy_ns(events) / steps / 1e6
    out["traced_wall_ms_per_step"] = wall_ms / steps
    return out


def print_profile(prof: dict, top: int = 20) -> None:
    print(f"profile: busy {prof['busy_ms_per_step']:.2f} ms/step, kernel sum {prof['kernel_ms_per_call']:.2f} ms, "
          f"{prof['kernels_per_call']:.0f} kernels/step")
    for cat, c in prof["categories"].items():
        print(f"  {cat:<8} {c['us_per_call'] / 1e3:8.2f} ms {c['count_per_call']:7.1f} kernels")
    for k in prof["kernels"][:top]:
        print(f"  {k['us_per_call']:9.1f} us {k['count_per_call']:6.1f}x  {k['category']:<7} {k['name'][:100]}")


def print_methods(result: dict) -> None:
    """The method table: per method, batch and acceptance, tokens/s, speedup, c, bound, share."""
    if not result["methods"]:
        return
    print(f"{'method':<12} {'B':>2} {'k':>2} {'a':>5} {'tok/s':>8} {'speedup':>8} {'c':>6} {'bound':>6} "
          f"{'of bound':>8} {'acc len':>7} {'of bound at drawn':>17}")
    for r in result["methods"]:
        if "bound" not in r:  # the cost run
            continue
        print(f"{r['method']:<12} {r['batch']:>2} {r['k']:>2} {r['acceptance']:>5.2f} {r['tok_s']:>8.1f} "
              f"{r['speedup']:>7.2f}x {r['c']:>6.3f} {r['bound']:>5.2f}x {r['of_bound']:>7.1%} "
              f"{r['mean_acceptance_length']:>7.2f} {r['of_bound_at_drawn']:>17.1%}")
    for name, mem in result["memory"].items():
        print(f"{name}: drafter {mem['draft_weights_GB']:.2f} GB, "
              f"state {mem['proposer_state_GB_per_row']:.3f} GB a row")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="27b", choices=GEOMETRIES)
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers (quick probes)")
    ap.add_argument("--layout", default="decode", choices=LAYOUTS)
    ap.add_argument("--quantization", choices=FORMATS, default=None,
                    help="every decoder projection in this weight-only format (quantized on the device)")
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8], help="plain decode (and method) batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--steps", type=int, default=16, help="decode steps traced by --profile")
    ap.add_argument("--methods", nargs="*", default=[], choices=METHODS,
                    help="speculative methods to table (synthetic acceptance, drafters made on the device)")
    ap.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.85])
    ap.add_argument("--spec-new-tokens", type=int, default=512,
                    help="tokens a method run generates: at k = 15 and a = 0.85 a step emits 6 on average, so "
                         "fewer steps than this leave the drawn acceptance far from a")
    ap.add_argument("--cost-tokens", type=int, default=65, help="tokens of the run that measures a method's c")
    ap.add_argument("--first-token", action="store_true",
                    help="first: time from the process start to one request's first token (run it twice to see "
                         "the persistent compilation cache; SPEC_JAX_XLA_CACHE names its folder)")
    ap.add_argument("--ttft", type=int, nargs="*", default=[], help="prefill times at these prompt lengths")
    ap.add_argument("--json", default=None, help="write every result here (rewritten after each method)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="cache length of the decode and method LLM (default: what the prompt and tokens need)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                    help="the share of the card the JAX allocator may take (vLLM's option of that name)")
    ap.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_CACHE_DTYPES,
                    help="the dtype the GDN state is cached in (vLLM's option of that name)")
    args = ap.parse_args()

    claim_device_memory(args.gpu_memory_utilization)  # before the weights start the backend
    ceilings = Ceilings.measure()
    print(ceilings.summary(), flush=True)
    cfg = geometry_config(args.geometry, args.layers)
    t = time.perf_counter()
    model = random_model(cfg, quantization=args.quantization)
    result = {"geometry": args.geometry, "layers": cfg.num_hidden_layers, "layout": args.layout,
              "device": jax.devices()[0].device_kind, "ceilings": vars(ceilings),
              "weights_made_s": time.perf_counter() - t}
    save = lambda: args.json and pathlib.Path(args.json).write_text(json.dumps(result, indent=1))  # noqa: E731
    llm = LLM(model=model, max_model_len=args.max_model_len or args.prompt_len + max(args.new_tokens,
                                                                                   args.spec_new_tokens) + 64,
              max_num_seqs=max(args.batch, default=1), layout=args.layout,
              mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
    if args.first_token:
        result["first_token"] = first_token(llm, args.prompt_len)
        print(json.dumps(result["first_token"]), flush=True)
    result["streamed_bytes"] = wbytes = streamed_bytes(model)
    print(f"{args.geometry}, {cfg.num_hidden_layers} layers, layout {args.layout}: {wbytes / 1e9:.2f} GB read a "
          f"step of one row, floor {1e3 * ceilings.floor_s(wbytes):.2f} ms", flush=True)
    step_bytes = lambda batch: streamed_bytes(model, batch)  # noqa: E731
    result["decode"] = decode_rows(llm, args.batch, args.prompt_len, args.new_tokens, step_bytes, ceilings) \
        if args.batch else []
    if args.profile:
        result["profile"] = profile_decode(llm, args.batch[0], args.prompt_len, args.steps)
        print_profile(result["profile"])
    save()
    plain_ms = {row["batch"]: row["step_ms"] for row in result["decode"]}
    result["methods"], result["memory"] = [], {}
    compiled = {}  # methods with one config (ngram, no_drafts) share one speculating LLM
    for name in args.methods:
        config, drafter = METHODS[name]
        draft = (random_drafter(drafter, cfg, block_size=DRAFTER_BLOCK.get(name), **DRAFTER_FIELDS.get(name, {}))
                 if drafter else None)
        config = {**config, "model": "random, made on the device"} if drafter else config
        if "draft_vocab_size" in config:  # small geometries have fewer ids
            config["draft_vocab_size"] = min(config["draft_vocab_size"], cfg.vocab_size // 2)
        config = {**config, "enable_adaptive_verification": False}  # c and the bound are a fixed k's
        key = json.dumps(config, sort_keys=True) if draft is None else name
        if key not in compiled:
            if config["method"] == "ngram":
                config = {**config, "proposer": always_drafting(config)}
            compiled[key] = llm.with_speculation(synthetic(config, 0.0), draft=draft)
        spec = compiled[key]
        result["memory"][name] = method_memory(spec, draft)
        for B in args.batch:
            result["methods"] += spec_rows(spec, name, B, args.acceptance, args.prompt_len, args.spec_new_tokens,
                                           plain_ms[B], args.cost_tokens)
            if args.profile:
                prof = result.setdefault("method_profiles", {})[f"{name} B={B}"] = profile_decode(
                    at_acceptance(spec, 0.0), B, args.prompt_len, args.steps)
                print(f"{name}, batch {B}, speculative steps at a = 0:")
                print_profile(prof, top=12)
            save()
        del spec, draft
        if key == name:
            compiled.pop(key)
    print_methods(result)
    if args.ttft:
        del llm
        result["ttft"] = ttft_rows(model, args.ttft, ceilings, args.layout, args.profile)
        save()


if __name__ == "__main__":
    main()
