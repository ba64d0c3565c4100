"""Per-request and aggregate figures, with vLLM's speculation counters; `LLM.get_metrics()`'s
lifetime counters under vLLM's metric names."""

from __future__ import annotations

import dataclasses
from typing import Sequence


def request_metrics(n_prompt: int, n_gen: int, prefill_s: float, decode_s: float, stats, row: int) -> dict:
    """One request's figures; the speculation counters are vLLM's (mean acceptance length =
    1 + accepted / steps that drafted), with ours of adaptive verification: num_steps_per_verify_length
    (how many of the row's steps verified 0..k drafts) and mean_verify_length."""
    m = {"num_prompt_tokens": n_prompt, "num_generated_tokens": n_gen, "prefill_s": prefill_s, "decode_s": decode_s,
         "tpot_s": decode_s / max(n_gen - 1, 1), "tokens_per_s": n_gen / max(prefill_s + decode_s, 1e-9)}
    if stats is not None:
        drafted, accepted, steps = int(stats.drafted[row]), int(stats.accepted[row]), int(stats.num_drafts[row])
        m.update(num_drafts=steps, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                 acceptance_rate=accepted / drafted if drafted else 0.0,
                 mean_acceptance_length=1 + accepted / steps if steps else 1.0,
                 acceptance_per_position=[int(a) / steps if steps else 0.0 for a in stats.per_position[row]],
                 num_accepted_per_position=[int(a) for a in stats.per_position[row]])
        m.update(verify_length_metrics([int(c) for c in stats.verify_lengths[row]]))
    return m


def verify_length_metrics(counts: list[int]) -> dict:
    """counts [k+1]: steps that verified 0..k drafts -> those counts and their mean length."""
    steps = sum(counts)
    return {"num_steps_per_verify_length": counts,
            "mean_verify_length": sum(n * c for n, c in enumerate(counts)) / steps if steps else 0.0}


def aggregate_metrics(outputs: Sequence) -> dict:
    """Totals over `RequestOutput`s: tokens, speculation counters, acceptance figures."""
    return {"num_requests": len(outputs), **merge_metrics([o.metrics for o in outputs])}


def merge_metrics(ms: Sequence[dict]) -> dict:
    """Generated tokens and speculation counters summed over metrics (a request's n rows, or many
    requests), acceptance figures recomputed from the sums."""
    total = {"num_generated_tokens": sum(m["num_generated_tokens"] for m in ms)}
    if ms and "num_drafts" in ms[0]:
        steps = sum(m["num_drafts"] for m in ms)
        drafted = sum(m["num_draft_tokens"] for m in ms)
        accepted = sum(m["num_accepted_tokens"] for m in ms)
        counts = [sum(pos) for pos in zip(*(m["num_accepted_per_position"] for m in ms))]
        total.update(num_drafts=steps, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                     acceptance_rate=accepted / drafted if drafted else 0.0,
                     mean_acceptance_length=1 + accepted / steps if steps else 1.0,
                     acceptance_per_position=[c / steps if steps else 0.0 for c in counts],
                     num_accepted_per_position=counts)
        total.update(verify_length_metrics([sum(n) for n in zip(*(m["num_steps_per_verify_length"] for m in ms))]))
    return total


@dataclasses.dataclass
class Counter:
    """A monotonically growing total (vLLM's `vllm.v1.metrics.reader.Counter`)."""

    name: str
    value: int
    labels: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Vector:
    """Counters indexed by position (vLLM's `vllm.v1.metrics.reader.Vector`)."""

    name: str
    values: list[int]
    labels: dict = dataclasses.field(default_factory=dict)


class LifetimeCounters:
    """Totals over every request an LLM has completed, read back as vLLM's metrics."""

    def __init__(self):
        self.requests = self.prompt_tokens = self.generation_tokens = 0
        self.drafts = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def add(self, outputs: Sequence) -> None:
        for o in outputs:
            m = o.metrics
            self.requests += 1
            self.prompt_tokens += len(o.prompt_token_ids)
            self.generation_tokens += m["num_generated_tokens"]
            if "num_drafts" in m:
                self.drafts += m["num_drafts"]
                self.draft_tokens += m["num_draft_tokens"]
                self.accepted_tokens += m["num_accepted_tokens"]
                counts = m["num_accepted_per_position"]
                self.accepted_per_pos = [a + b for a, b in zip(self.accepted_per_pos or [0] * len(counts), counts)]

    def metrics(self, prefix_cache: tuple[int, int] | None = None) -> list:
        """prefix_cache: the store's (queries, hits) in prompt tokens, when prefix caching is on."""
        out = [Counter("vllm:request_success", self.requests), Counter("vllm:prompt_tokens", self.prompt_tokens),
               Counter("vllm:generation_tokens", self.generation_tokens)]
        if prefix_cache is not None:
            out += [Counter("vllm:prefix_cache_queries", prefix_cache[0]),
                    Counter("vllm:prefix_cache_hits", prefix_cache[1])]
        if self.accepted_per_pos:
            out += [Counter("vllm:spec_decode_num_drafts", self.drafts),
                    Counter("vllm:spec_decode_num_draft_tokens", self.draft_tokens),
                    Counter("vllm:spec_decode_num_accepted_tokens", self.accepted_tokens),
                    Vector("vllm:spec_decode_num_accepted_tokens_per_pos", list(self.accepted_per_pos))]
        return out
