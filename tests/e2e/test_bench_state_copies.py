"""bench.state_copies on the CPU: the adaptive speculative step, which runs one of its verify
widths a step, copies no cache the plain decode loop does not: no attention K/V, no GDN state, no
proposer cache (each width is a loop of at most one trip, whose caches update in place; a
conditional would copy every cache its branches write). The conv windows, a few KB a row, are
left out: copies are matched by shape, and theirs is shared by other arrays of the step."""

from bench.state_copies import program_copies
from spec_jax import LLM


def test_the_adaptive_step_copies_no_cache_beyond_the_plain_loops(echo_dir):
    plain = LLM(model=str(echo_dir), dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=[4])
    adaptive = plain.with_speculation({"method": "mtp", "num_speculative_tokens": 3})
    assert adaptive.engine.plan.adaptive
    plain_copies = {r["leaf"]: r["copies"] for r in program_copies(plain, 4, 16)}
    rows = program_copies(adaptive, 4, 16)
    big = [r for r in rows if r["leaf"].endswith((".k", ".v", ".state"))]
    assert {r["leaf"] for r in big} >= {"proposer.cache.k", "proposer.cache.v", "cache[0].state", "cache[3].k"}
    for r in big:
        assert r["copies"] <= plain_copies.get(r["leaf"], 0), r
