"""The server's /metrics in Prometheus' text format, under vLLM's metric names (`vllm:...`, with
its `model_name` label) so that dashboards and alerts written for vLLM read them. Figures vLLM
has no metric for keep spec_jax's own prefix (`spec_jax_...`)."""

from __future__ import annotations

FINISH_REASONS = ("stop", "length", "abort", "error")


def prometheus_text(stats: dict, model_name: str) -> str:
    """The scheduler's counters (`Scheduler.stats`); speculation counts cover finished requests."""
    drafts, drafted, accepted = (stats.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    model = f'model_name="{escape(model_name)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples):
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{model}{labels}}} {value}" for labels, value in samples)

    metric("vllm:num_requests_running", "gauge", "Requests in a batch slot.", [("", stats["running"])])
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting for a slot.", [("", stats["waiting"])])
    metric("vllm:request_success_total", "counter", "Finished requests by finish reason.",
           [(f',finished_reason="{r}"', stats.get(f"requests_{r}", 0)) for r in FINISH_REASONS])
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", stats.get("prompt_tokens", 0))])
    metric("vllm:generation_tokens_total", "counter", "Tokens generated.", [("", stats.get("generation_tokens", 0))])
    metric("vllm:spec_decode_num_drafts_total", "counter", "Steps that verified at least one draft.", [("", drafts)])
    metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [("", drafted)])
    metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", accepted)])
    metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted drafts by draft position.",
           [(f',position="{i}"', a) for i, a in enumerate(stats["accepted_per_position"])])
    if "prefix_cache_queries" in stats:
        metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [("", stats["prefix_cache_queries"])])
        metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               [("", stats["prefix_cache_hits"])])
    metric("spec_jax_spec_decode_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
           [("", accepted / drafted if drafted else 0.0)])
    metric("spec_jax_spec_decode_mean_acceptance_length", "gauge", "1 + accepted / drafting steps.",
           [("", 1 + accepted / drafts if drafts else 1.0)])
    return "\n".join(lines) + "\n"


def escape(value: str) -> str:
    """A label value as Prometheus' text format writes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
