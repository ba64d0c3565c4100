"""Suffix decoding on device against a plain-Python statement of vLLM's suffix-tree rule, its
cache of finished outputs, its config, and greedy equality with speculation off in the engine."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import DRAFT_GREEDY, assert_greedy_equals_plain, drafter_prompts
from proposers.registry import build_proposer
from spec_jax.engine.adaptive import StepTimes
from proposers.suffix import SEPARATOR, OutputCache, SuffixProposer, suffix_drafts
from spec_jax import LLM, SamplingParams
from spec_jax.engine.spec_config import parse_speculative_config

f32 = np.float32


def walk_reference(seqs, occurrences, m, max_tokens, min_prob, rank):
    """vLLM's path walk from the node of the m-token match whose occurrences are (seq, end) pairs:
    the most frequent next token (ties: the one whose best-ranked occurrence ranks highest), its
    probability the running product of count / survivors, stopping under min_prob."""
    prob, drafts, score, alive = f32(1.0), [], f32(0.0), list(occurrences)
    while len(drafts) < max_tokens:
        i = len(drafts)
        groups = {}
        for s, e in alive:
            if e + 1 + i < len(seqs[s]):
                groups.setdefault(seqs[s][e + 1 + i], []).append((s, e))
        if not groups:
            break
        token = max(groups, key=lambda t: (len(groups[t]), max(rank(s, e) for s, e in groups[t])))
        prob = f32(prob * f32(f32(len(groups[token])) / f32(len(alive))))
        if prob < min_prob:
            break
        drafts.append(token)
        score = f32(score + prob)
        alive = groups[token]
    return drafts, score


def tree_reference(seqs, pattern, *, k, depth, factor, min_prob, rank):
    """vLLM's SuffixTree.speculate over `seqs` (one tree), as (drafts, score): every match length
    m < len(pattern) whose string occurs, each walked, the best score kept (the longer m on a tie)."""
    best = ([], f32(0.0))
    for m in range(1, len(pattern)):
        tail = pattern[-m:]
        occ = [(s, e) for s, seq in enumerate(seqs) for e in range(m - 1, len(seq)) if seq[e - m + 1:e + 1] == tail]
        if not occ:
            break
        max_tokens = min(k, int(m * factor + 1e-6), depth - m)  # the tree holds paths of depth tokens
        drafts, score = walk_reference(seqs, occ, m, max_tokens, min_prob, rank)
        if score >= best[1]:
            best = (drafts, score)
    return best


def match_rank(seq, e, row, cap):
    """How far seq ending at e matches the end of row (at most cap tokens)."""
    n = 0
    while n < cap and e - n >= 0 and seq[e - n] == row[len(row) - 1 - n]:
        n += 1
    return n


def reference(row, cached, *, k, depth, factor, min_prob):
    """The draft for one row: its own tree (the row itself) and the cache's (the outputs `cached`,
    oldest first), the cache's only where it scores strictly higher."""
    pattern = row[-depth:]
    cap = min(depth, len(row)) - 1
    own = tree_reference([row], pattern, k=k, depth=depth, factor=factor, min_prob=min_prob,
                         rank=lambda s, e: (match_rank(row, e, row, cap), e))
    if not cached:
        return own[0]
    glob = tree_reference(cached, pattern, k=k, depth=depth, factor=factor, min_prob=min_prob,
                          rank=lambda s, e: (match_rank(cached[s], e, row, cap), s, e))
    return glob[0] if glob[1] > own[1] else own[0]


def ring_of(outputs, slots):
    cache = OutputCache.empty(slots)
    L = max(len(o) for o in outputs) + 1
    for out in outputs:
        buf = np.zeros((1, L), np.int32)
        buf[0, :len(out)] = out
        cache = cache.add(jnp.asarray(buf), jnp.asarray([0]), jnp.asarray([len(out)]), jnp.asarray([True]))
    return cache


def run(rows, *, k, depth, factor=1.0, min_prob=0.1, cached=(), L=None, candidates=None, max_requests=10000,
        slots=64):
    L = L or max(len(r) for r in rows)
    rng = np.random.default_rng(len(rows))
    tokens = rng.integers(0, 4, (len(rows), L)).astype(np.int32)  # garbage past each row, never read
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    cache = ring_of(list(cached), slots) if cached else None
    fn = functools.partial(suffix_drafts, k=k, depth=depth, spec_factor=factor, min_prob=min_prob,
                           max_requests=max_requests, candidates=candidates or 64)
    drafts, n, _ = jax.jit(fn)(jnp.asarray(tokens), jnp.asarray([len(r) for r in rows], jnp.int32), cache)
    drafts, n = np.asarray(drafts), np.asarray(n)
    assert drafts.shape == (len(rows), k) and (drafts[np.arange(k)[None, :] >= n[:, None]] == 0).all()
    return [drafts[b, :n[b]].tolist() for b in range(len(rows))]


def test_a_repeated_phrase_is_drafted_with_the_probability_its_tree_gives():
    row = [1, 2, 3, 4, 1, 2, 3]
    # [1, 2, 3] occurs twice (once here at the end): 4 at probability 1/2, then the edge's tokens
    assert reference(row, [], k=8, depth=24, factor=1.0, min_prob=0.1) == [4, 1, 2]
    assert run([row], k=8, depth=24) == [[4, 1, 2]]
    assert run([row], k=8, depth=24, factor=2.0) == [[4, 1, 2, 3]]  # then the earlier occurrence ends
    assert run([row], k=2, depth=24) == [[4, 1]]
    # depth 4: a 3-token match drafts 1 (3 + 1 <= 4), a 2-token one drafts 2 and scores higher
    assert reference(row, [], k=8, depth=4, factor=1.0, min_prob=0.1) == run([row], k=8, depth=4)[0] == [4, 1]
    assert run([row], k=8, depth=24, min_prob=0.6) == [[]]


def test_no_match_and_short_rows():
    assert run([[5], [5, 6], [1, 2, 3, 4]], k=4, depth=24) == [[], [], []]
    assert run([[7, 7]], k=4, depth=24) == [[7]]


def test_the_cache_drafts_where_it_scores_higher():
    row = [9, 1, 2, 3]
    assert run([row], k=8, depth=24) == [[]]
    assert run([row], k=8, depth=24, cached=[[5, 1, 2, 3, 4, 5, 6]]) == [[4, 5, 6]]
    # evicted (only the last request is kept): no draft
    assert run([row], k=8, depth=24, cached=[[5, 1, 2, 3, 4, 5, 6], [8, 8]], max_requests=1) == [[]]


@pytest.mark.parametrize("k,depth,factor,min_prob", [(4, 24, 1.0, 0.1), (8, 6, 2.0, 0.1), (3, 24, 0.5, 0.3),
                                                     (16, 10, 4.0, 0.0), (5, 24, 1.0, 1.0)])
def test_random_against_reference(k, depth, factor, min_prob):
    rng = np.random.default_rng(int(100 * factor) + k + depth)
    rows = [rng.integers(0, 3, int(n)).tolist() for n in rng.integers(1, 30, 24)]
    cached = [rng.integers(0, 3, int(n)).tolist() for n in rng.integers(1, 12, 4)]
    for cache in ([], cached):
        got = run(rows, k=k, depth=depth, factor=factor, min_prob=min_prob, cached=cache, L=32)
        want = [reference(r, cache, k=k, depth=depth, factor=factor, min_prob=min_prob) for r in rows]
        assert got == want
    assert sum(map(len, want)) > 0


def test_few_candidates_draft_a_frequent_continuation_conservatively():
    row = [1, 2, 3] * 20
    exact = run([row], k=6, depth=24, factor=2.0)[0]
    assert exact == [1, 2, 3, 1, 2, 3]
    assert run([row], k=6, depth=24, factor=2.0, candidates=4) == [exact]


def test_cache_ring_keeps_the_latest_outputs():
    cache = ring_of([[1, 2, 3], [4, 5]], 8)
    assert np.asarray(cache.tokens).tolist() == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR, SEPARATOR]
    assert int(cache.written) == 2 and int(cache.head) == 7
    assert np.asarray(cache.live_tokens(1)).tolist() == [SEPARATOR] * 4 + [4, 5, SEPARATOR, SEPARATOR]
    cache = ring_of([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11, 12, 13, 14]], 8)  # the last keeps its last 7
    assert np.asarray(cache.tokens).tolist()[7:] + np.asarray(cache.tokens).tolist()[:7] == \
        [8, 9, 10, 11, 12, 13, 14, SEPARATOR]


def test_retire_adds_the_finished_rows_outputs_in_row_order():
    tokens = jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 0], [8, 9, 0, 0]], jnp.int32)
    cache = SuffixProposer.retire(OutputCache.empty(10), tokens, jnp.asarray([1, 1, 1]), jnp.asarray([4, 3, 2]),
                                  jnp.asarray([True, False, True]))
    assert np.asarray(cache.tokens).tolist() == [2, 3, 4, SEPARATOR, 9, SEPARATOR] + [SEPARATOR] * 4
    assert np.asarray(cache.entry).tolist()[:6] == [0, 0, 0, 0, 1, 1] and int(cache.written) == 2
    assert SuffixProposer.retire(None, tokens, *tokens[:, :3].T) is None


# ----------------------------------------------------------------------------- config

def parse(spec):
    return parse_speculative_config(spec, target_has_mtp=True)


def test_vllm_fields_and_defaults():
    spec = parse({"method": "suffix"})
    assert spec.num_speculative_tokens == 24  # vLLM: the tree's depth, read as a maximum
    proposer = build_proposer(spec, 512, 256)
    assert proposer == SuffixProposer(24, 24, 1.0, 0.1, 10000, 32768)
    spec = parse({"method": "suffix", "suffix_decoding_max_tree_depth": 12, "suffix_decoding_max_spec_factor": 2,
                  "suffix_decoding_min_token_prob": 0.3, "suffix_decoding_max_cached_requests": 0,
                  "num_speculative_tokens": 5})
    assert build_proposer(spec, 512, 256) == SuffixProposer(5, 12, 2.0, 0.3, 0, 32768)
    assert build_proposer(spec, 512, 256).init_state(None, None, None, None, None, None) is None


@pytest.mark.parametrize("field,value,rule", [
    ("max_tree_depth", 0, ">= 1"), ("max_cached_requests", -1, ">= 0"), ("max_spec_factor", -0.5, ">= 0"),
    ("min_token_prob", 1.5, "in \\[0, 1\\]"), ("cache_tokens", 1, ">= 2")])
def test_bad_values_are_refused_by_name(field, value, rule):
    with pytest.raises(ValueError, match=f"suffix_decoding_{field}={value} must be {rule}"):
        parse({"method": "suffix", "num_speculative_tokens": 4, f"suffix_decoding_{field}": value})


def test_suffix_fields_do_not_warn_for_suffix(recwarn):
    parse({"method": "suffix", "suffix_decoding_max_spec_factor": 2.0})
    assert not [w for w in recwarn if "ignored" in str(w.message)]


# ----------------------------------------------------------------------------- engine

SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}


@pytest.mark.parametrize("adaptive", [True, False])
def test_greedy_equals_plain(tiny_llm, plain_greedy, adaptive):
    llm = tiny_llm.with_speculation({**SUFFIX, "enable_adaptive_verification": adaptive})
    assert_greedy_equals_plain(llm, plain_greedy)


def test_adaptive_verification_takes_the_cost_models_width(tiny_llm, plain_greedy):
    """Width 1 cheap, wider dear: no step verifies more than one draft, and some verify one."""
    llm = tiny_llm.with_speculation(SUFFIX)
    llm.engine.step_times[4] = StepTimes.measured([1.0, 1.01, 100.0, 100.0])  # widths 0, 1, 3, 6
    outs = llm.generate(prompt_token_ids=drafter_prompts(), sampling_params=DRAFT_GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    lengths = llm.metrics["num_steps_per_verify_length"]
    assert lengths[1] > 0 and sum(lengths[2:]) == 0


def test_finished_outputs_feed_later_requests(tiny_llm, plain_greedy):
    """The second batch drafts from the first one's outputs (the cache goes from batch to batch),
    and still emits the plain tokens."""
    llm = tiny_llm.with_speculation({**SUFFIX, "enable_adaptive_verification": False})
    prompt = [drafter_prompts()[2]]
    first = llm.generate(prompt_token_ids=prompt, sampling_params=DRAFT_GREEDY)[0]
    again = llm.generate(prompt_token_ids=prompt, sampling_params=DRAFT_GREEDY)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == plain_greedy[2]
    assert again.metrics["num_accepted_tokens"] > first.metrics["num_accepted_tokens"]
    assert again.metrics["num_accepted_tokens"] >= len(plain_greedy[2]) // 2


def test_an_inserted_row_keeps_the_batchs_cache(tiny_llm):
    core = tiny_llm.with_speculation(SUFFIX).engine
    batch, _, _ = core.start([[1, 2, 3]] * 4, [dataclasses.replace(DRAFT_GREEDY, max_tokens=4)] * 4)
    batch = core.decode(batch, 20, False)
    ring = np.asarray(batch.proposer.tokens)
    assert int(batch.proposer.written) == 4 and (ring != SEPARATOR).sum() == 16
    row, _, _ = core.start([[4, 5]], [DRAFT_GREEDY], rows=1)
    inserted = core.insert(batch, 1, row)
    assert np.asarray(inserted.proposer.tokens).tolist() == ring.tolist()


def test_the_servers_scheduler_keeps_the_cache_across_requests(tiny_llm, plain_greedy):
    """Requests through the continuous batch's slots: the plain tokens, and a request repeated
    after the first finished drafts from its output."""
    from spec_jax.api.scheduler import Scheduler

    llm = tiny_llm.with_speculation({**SUFFIX, "enable_adaptive_verification": False})
    scheduler = Scheduler(llm.engine, steps_per_chunk=2).start()
    try:
        runs = []
        for _ in range(2):
            updates = list(scheduler.stream(drafter_prompts()[2], DRAFT_GREEDY))
            runs.append((sum((u.token_ids for u in updates), []), updates[-1].metrics["num_accepted_tokens"]))
    finally:
        scheduler.shutdown()
    assert runs[0][0] == runs[1][0] == plain_greedy[2]
    assert runs[1][1] > runs[0][1]


def test_sampling_stays_the_targets(shallow_echo_dir):
    """Two sampled tokens a request, penalties on, the second from one speculative step of suffix
    drafts (adaptive, verifying both): its joint distribution with the first equals plain decoding's
    (two-sample chi-square)."""
    from scipy import stats

    def two_tokens(spec, seeds):
        llm = LLM(model=str(shallow_echo_dir), dtype="float32", max_model_len=64, max_num_seqs=64,
                  speculative_config=spec)
        if spec is not None:
            llm.engine.step_times[64] = StepTimes.measured([1.0, 1.0, 1.0])
        params = [SamplingParams(max_tokens=2 if spec is None else 4, temperature=1.0, seed=int(s), ignore_eos=True,
                                 presence_penalty=0.8, repetition_penalty=1.5) for s in seeds]
        outs = llm.generate(prompt_token_ids=[[5, 9, 5, 9, 5]] * len(seeds), sampling_params=params, use_tqdm=False)
        drafted = sum(o.metrics.get("num_draft_tokens", 0) for o in outs)
        return np.asarray([o.outputs[0].token_ids[:2] for o in outs]), drafted

    n = 384
    plain, _ = two_tokens(None, range(n))
    spec = {"method": "suffix", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8,
            "suffix_decoding_cache_tokens": 256}
    spec_on, drafted = two_tokens(spec, range(n, 2 * n))
    assert drafted > n // 4
    joint = [t[:, 0] * 64 + t[:, 1] for t in (plain, spec_on)]
    keys = np.union1d(*joint)
    table = np.stack([[np.sum(j == key) for key in keys] for j in joint])
    assert stats.chi2_contingency(table[:, table.sum(0) >= 10]).pvalue > 1e-3
