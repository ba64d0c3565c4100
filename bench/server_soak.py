"""A soak of the OpenAI server: rounds of a load mix from concurrent streaming clients, with the
server's resident memory (RSS) and latency per round.

    python -m bench.server_soak                  # 10 rounds against a fresh `spec-jax serve` of the default model
    python -m bench.server_soak --rounds 3 --requests 40 --clients 8 --out soak.json

The server starts on a free loopback port with MTP k = 3 and serve's defaults (prefix caching on).
Each round sends --requests requests from --clients clients, all streaming, drawn in turn from MIX
(plain, penalties, min_p with logit_bias, bad_words, logprobs, stop strings, chat; every other one
seeded sampling, the rest greedy), and drops every --drop-every-th after its first chunk. Request i
is the same in every round. Per round it reports the server's RSS, and of the requests: completed,
dropped, lost (no answer), 5xx answers, streams that ended without [DONE], outputs that differ
from the same request's output in the first round (greedy and seeded requests give the same tokens
in any batch), and p50 / p99 latency. `soak` drives any server's URL: the tests run a short form.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np

PROMPTS = ["def fibonacci(n):", "import os\nfor", "The module provides", "class Stack:\n    def push(self, x):",
           "Return the sum of the squares of the numbers in a list, skipping", "x = [", "# Parse the arguments\n"]
# (name, the request's fields beside prompt or messages); token ids are below 512, the test model's vocabulary.
MIX = [("plain", {}),
       ("penalties", {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2}),
       ("min_p+logit_bias", {"min_p": 0.05, "logit_bias": {"7": -100.0, "11": 5.0}}),
       ("bad_words", {"bad_words": ["return", "self"]}),
       ("logprobs", {"logprobs": 3}),
       ("stop", {"stop": ["\n\n", "):"]}),
       ("chat", {})]
SPECULATIVE_CONFIG = {"method": "mtp", "num_speculative_tokens": 3}


@dataclasses.dataclass
class Result:
    """One request's outcome: HTTP status (None: no answer), seconds to its last byte, the text
    streamed, whether it ended with [DONE], whether the client dropped it, any error text."""

    status: int | None
    seconds: float
    text: str = ""
    done: bool = False
    dropped: bool = False
    error: str | None = None


def request_body(i: int) -> tuple[str, dict]:
    """Request i of every round: (endpoint path, streaming JSON body)."""
    name, fields = MIX[i % len(MIX)]
    prompt = PROMPTS[i // len(MIX) % len(PROMPTS)]
    sampling = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0.0}
    body = {"max_tokens": 8 + i * 7 % 40, "stream": True, **sampling, **fields}
    if name == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def send(client: httpx.Client, url: str, i: int, drop: bool) -> Result:
    """Stream request i; with drop, hang up after its first chunk."""
    path, body = request_body(i)
    t0 = time.perf_counter()
    text, done = [], False
    try:
        with client.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                r.read()
                return Result(r.status_code, time.perf_counter() - t0, error=r.text[:200])
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if drop:
                    return Result(200, time.perf_counter() - t0, dropped=True)
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(200, time.perf_counter() - t0, "".join(text), error=str(chunk["error"]))
                for c in chunk["choices"]:
                    text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        return Result(200, time.perf_counter() - t0, "".join(text), done)
    except httpx.HTTPError as e:
        return Result(None, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")


def run_round(url: str, requests: int, clients: int, drop_every: int) -> list[Result]:
    """Requests 0..requests-1 from `clients` concurrent clients; every drop_every-th is dropped
    (0: none)."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    with httpx.Client(timeout=httpx.Timeout(600.0, connect=30.0), limits=limits) as client:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            return list(pool.map(lambda i: send(client, url, i, drop_every > 0 and i % drop_every == drop_every - 1),
                                 range(requests)))


def summarize(results: list[Result], first: list[Result] | None) -> dict:
    """A round's counts and latency; mismatches against `first`, the first round's results."""
    served = [r for r in results if not r.dropped]
    seconds = [r.seconds for r in served if r.status == 200]
    ok = [i for i, r in enumerate(results) if r.status == 200 and r.done and r.error is None]
    compared = [i for i in ok if first is not None and first[i].done and first[i].error is None]
    return {"requests": len(results), "completed": len(ok), "dropped": len(results) - len(served),
            "lost": sum(r.status is None for r in results), "5xx": sum((r.status or 0) >= 500 for r in results),
            "4xx": sum(400 <= (r.status or 0) < 500 for r in results),
            "no_done": sum(r.status == 200 and not r.done and r.error is None for r in served),
            "errors": sum(r.error is not None and r.status == 200 for r in served),
            "mismatches": sum(results[i].text != first[i].text for i in compared), "compared": len(compared),
            "p50_s": float(np.percentile(seconds, 50)) if seconds else None,
            "p99_s": float(np.percentile(seconds, 99)) if seconds else None}


def soak(url: str, *, rounds: int, requests: int, clients: int, drop_every: int,
         probe: Callable[[], dict], report: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """`rounds` rounds (`run_round`) against the server at url; each round's `summarize`, its wall
    time and probe()'s readings (taken after the round, e.g. the server's RSS), each also passed
    to report as it completes."""
    rows, first = [], None
    for r in range(rounds):
        t0 = time.perf_counter()
        results = run_round(url, requests, clients, drop_every)
        row = {"round": r + 1, **summarize(results, first), "wall_s": time.perf_counter() - t0, **probe()}
        first = results if first is None else first
        rows.append(row)
        report(row)
    return rows


def rss_mb(pid: int) -> float:
    """Resident memory of process pid in MB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, log) -> tuple[subprocess.Popen, str]:
    """`spec-jax serve` on a free loopback port; returns it and its URL once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "spec_jax.api.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--speculative-config", json.dumps(SPECULATIVE_CONFIG)] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + args.start_timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"the server exited with status {proc.returncode}:\n{log.read()[-3000:]}")
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not answer /health within {args.start_timeout} s")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def print_row(row: dict) -> None:
    p50 = "-" if row["p50_s"] is None else f"{row['p50_s']:.2f}"
    p99 = "-" if row["p99_s"] is None else f"{row['p99_s']:.2f}"
    print(f"round {row['round']:2d}  RSS {row['rss_mb']:7.1f} MB  completed {row['completed']}/{row['requests']} "
          f"(dropped {row['dropped']}, lost {row['lost']}, 5xx {row['5xx']}, no [DONE] {row['no_done']}, "
          f"errors {row['errors']})  mismatches {row['mismatches']}/{row['compared']}  p50 {p50} s  p99 {p99} s  "
          f"wall {row['wall_s']:.1f} s", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default model)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=56, help="requests a round")
    ap.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    ap.add_argument("--drop-every", type=int, default=8, help="drop every N-th request after its first chunk (0: none)")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the server to start")
    ap.add_argument("--out", default=None, help="write the rounds as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.perf_counter()
        proc, url = start_server(args, log)
        print(f"server up at {url} in {time.perf_counter() - t0:.1f} s, RSS {rss_mb(proc.pid):.1f} MB", flush=True)
        try:
            rows = soak(url, rounds=args.rounds, requests=args.requests, clients=args.clients,
                        drop_every=args.drop_every, probe=lambda: {"rss_mb": rss_mb(proc.pid)}, report=print_row)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
