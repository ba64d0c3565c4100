"""Batch eval: a JSONL of prompts through the jitted engine; per-request outputs and aggregate metrics.

    spec-jax bench --model DIR --input prompts.jsonl --speculative-config '{"method":"mtp","num_speculative_tokens":2}'

Each input line is {"prompt": TEXT} or {"prompt_token_ids": [ids]}, optionally with max_tokens,
temperature, top_p, top_k, seed, ignore_eos, stop (a string or a list of them), stop_token_ids, and
an "id" (a string or number) copied to its output line. The prompts run through `LLM.generate` in
batches of max_num_seqs rows, shortest first so that a batch shares a prompt bucket; a warm-up pass
of one token per prompt compiles every bucket first, so tokens/s is decode speed, not compilation.
Outputs come back in input order.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from spec_jax.api.llm import LLM, RequestOutput, SamplingParams

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop", "stop_token_ids")
LINE_KEYS = {"id", "prompt", "prompt_token_ids", *SAMPLING_KEYS}


@dataclasses.dataclass
class EvalRequest:
    line: int
    id: object
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams


def read_requests(llm: LLM, path: str | Path, *, max_tokens: int, temperature: float) -> list[EvalRequest]:
    """Parse and check every line (lines end at "\n" only, as JSONL's do: a string may hold any other
    line separator; blank lines are skipped); a bad line raises ValueError naming its number."""
    requests = []
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); the input is JSONL") from None
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip(" \t\r"):
            try:
                requests.append(parse_line(llm, line, n, max_tokens=max_tokens, temperature=temperature))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path} line {n}: {e}") from None
    if not requests:
        raise ValueError(f"{path} has no prompts")
    return requests


def parse_line(llm: LLM, line: str, n: int, *, max_tokens: int, temperature: float) -> EvalRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError("nests too deeply: a line is one object of a prompt and its settings") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - LINE_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; expected some of {', '.join(sorted(LINE_KEYS))}")
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise ValueError('give exactly one of "prompt" (text) or "prompt_token_ids"')
    if not isinstance(obj.get("id"), str | int | float | None) or isinstance(obj.get("id"), bool):
        raise ValueError(f"id must be a string or a number, got {repr(obj['id'])[:80]}")
    prompt, ids = obj.get("prompt"), obj.get("prompt_token_ids")
    if prompt is None and not isinstance(ids, list):
        raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
    settings = {"max_tokens": max_tokens, "temperature": temperature, **{k: obj[k] for k in SAMPLING_KEYS if k in obj}}
    ids = llm.tokenize(prompt if prompt is not None else ids, "the prompt")
    return EvalRequest(n, obj.get("id"), prompt, ids, SamplingParams(**settings))


def run(llm: LLM, requests: list[EvalRequest], *, warmup: bool = True) -> tuple[list[RequestOutput], dict]:
    """Generate every request; returns the outputs in input order and the aggregate metrics
    (`llm.metrics` plus prompt tokens and wall time)."""
    order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_token_ids))
    ids = [requests[i].prompt_token_ids for i in order]
    params = [requests[i].params for i in order]
    if warmup:
        one_token = [dataclasses.replace(p, max_tokens=1) for p in params]
        llm.generate(prompt_token_ids=ids, sampling_params=one_token, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
    wall = time.perf_counter() - t0
    outputs: list[RequestOutput] = [None] * len(requests)  # type: ignore[list-item]
    for i, out in zip(order, outs):
        outputs[i] = out
    spec = llm.speculative_config
    metrics = {**llm.metrics, "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "wall_s": wall,
               "model": str(llm.model_path), "max_num_seqs": llm.engine.max_num_seqs, "warmup": warmup,
               "speculative_config": None if spec is None else config_fields(spec)}
    return outputs, metrics


def config_fields(spec) -> dict:
    """The speculative config's fields that are set: away from their defaults, or required."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
            if f.default is dataclasses.MISSING or getattr(spec, f.name) != f.default}


def output_line(req: EvalRequest, out: RequestOutput) -> dict:
    c = out.outputs[0]
    line = {"line": req.line, "id": req.id, "prompt": req.prompt, "prompt_token_ids": req.prompt_token_ids,
            "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason, "metrics": out.metrics}
    return {k: v for k, v in line.items() if v is not None}


def output_paths(input_path: str, output_path: str | None = None, metrics_path: str | None = None) -> tuple[Path, Path]:
    """Where `run_file` writes: the paths given, else INPUT.outputs.jsonl and INPUT.metrics.json.
    ValueError naming one that is a folder or whose folder does not exist: checked before anything
    runs, since a typo would otherwise cost the whole run."""
    stem = Path(input_path).with_suffix("")
    paths = Path(output_path or f"{stem}.outputs.jsonl"), Path(metrics_path or f"{stem}.metrics.json")
    for path in paths:
        if path.is_dir():
            raise ValueError(f"cannot write {path}: it is a folder; name a file in it")
        if not path.parent.is_dir():
            raise ValueError(f"cannot write {path}: its directory {path.parent} does not exist")
    return paths


def run_file(llm: LLM, input_path: str, output_path: str | None = None, metrics_path: str | None = None, *,
             max_tokens: int = 64, temperature: float = 0.0, warmup: bool = True) -> dict:
    """Read `input_path`, generate, write outputs (JSONL) and metrics (JSON) next to it unless
    told where; returns the metrics."""
    output_path, metrics_path = output_paths(input_path, output_path, metrics_path)
    requests = read_requests(llm, input_path, max_tokens=max_tokens, temperature=temperature)
    outputs, metrics = run(llm, requests, warmup=warmup)
    output_path.write_text("".join(json.dumps(output_line(r, o)) + "\n" for r, o in zip(requests, outputs)))
    metrics_path.write_text(json.dumps(metrics, indent=2) + "\n")
    summary = f"{metrics['num_requests']} requests, {metrics['num_generated_tokens']} tokens in " \
              f"{metrics['wall_s']:.2f}s ({metrics['tokens_per_s']:.1f} tok/s)"
    if "acceptance_rate" in metrics:
        summary += f", acceptance rate {metrics['acceptance_rate']:.3f}, mean acceptance length " \
                   f"{metrics['mean_acceptance_length']:.2f}"
    print(f"{summary}; outputs in {output_path}, metrics in {metrics_path}", file=sys.stderr)
    return metrics
