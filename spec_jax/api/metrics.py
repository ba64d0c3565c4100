"""Per-request and aggregate figures, with vLLM's speculation counters."""

from __future__ import annotations

from typing import Sequence


def request_metrics(n_prompt: int, n_gen: int, prefill_s: float, decode_s: float, stats, row: int) -> dict:
    """One request's figures; the speculation counters are vLLM's (mean acceptance length =
    1 + accepted / steps that drafted)."""
    m = {"num_prompt_tokens": n_prompt, "num_generated_tokens": n_gen, "prefill_s": prefill_s, "decode_s": decode_s,
         "tpot_s": decode_s / max(n_gen - 1, 1), "tokens_per_s": n_gen / max(prefill_s + decode_s, 1e-9)}
    if stats is not None:
        drafted, accepted, steps = int(stats.drafted[row]), int(stats.accepted[row]), int(stats.num_drafts[row])
        m.update(num_drafts=steps, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                 acceptance_rate=accepted / drafted if drafted else 0.0,
                 mean_acceptance_length=1 + accepted / steps if steps else 1.0,
                 acceptance_per_position=[int(a) / steps if steps else 0.0 for a in stats.per_position[row]])
    return m


def aggregate_metrics(outputs: Sequence) -> dict:
    """Totals over `RequestOutput`s: tokens, speculation counters, acceptance figures."""
    ms = [o.metrics for o in outputs]
    total = {"num_requests": len(ms), "num_generated_tokens": sum(m["num_generated_tokens"] for m in ms)}
    if ms and "num_drafts" in ms[0]:
        steps = sum(m["num_drafts"] for m in ms)
        drafted = sum(m["num_draft_tokens"] for m in ms)
        accepted = sum(m["num_accepted_tokens"] for m in ms)
        k = len(ms[0]["acceptance_per_position"])
        per_pos = [sum(m["acceptance_per_position"][i] * m["num_drafts"] for m in ms) / steps if steps else 0.0
                   for i in range(k)]
        total.update(num_drafts=steps, num_draft_tokens=drafted, num_accepted_tokens=accepted,
                     acceptance_rate=accepted / drafted if drafted else 0.0,
                     mean_acceptance_length=1 + accepted / steps if steps else 1.0, acceptance_per_position=per_pos)
    return total
