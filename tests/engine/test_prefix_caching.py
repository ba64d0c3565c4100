"""Prefix caching is exact: a prompt resumed from cached blocks gives bitwise the same state (caches,
first token, every proposer's state) and the same tokens as one that found nothing cached, for
plain decoding and every speculative method; the store keys whole prefixes, evicts least
recently used blocks, and reports queries and hits."""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import FIXED_K

from spec_jax import LLM, SamplingParams
from spec_jax.api.scheduler import Scheduler
from spec_jax.api.server import prometheus_text
from spec_jax.engine.prefix_cache import PrefixCache
from spec_jax.engine.prefix_programs import KERNEL_BY_KERNEL
from spec_jax.writing.random_checkpoint import main as write_drafter

BLOCK = 64  # the CPU default
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=1)  # seeded: states compare whole
RNG = np.random.default_rng(5)
A = RNG.integers(0, 500, 150).tolist()
PROMPTS = [
    A,  # blocks 0, 1 and a partial third
    A[:100] + RNG.integers(0, 500, 30).tolist(),  # shares 100 tokens: hits block 0, mid-way through block 1
    A[:128] + [(A[128] + 1) % 500] + A[129:140],  # leaves A one token after its second block
]


@pytest.fixture(scope="module")
def cached_llm(tiny_dir):
    return LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=[4],
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def drafters(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafters")
    for kind in ("dflash", "dspark", "eagle3", "draft_model"):
        layout = ["--layout", "dspark"] if kind == "dspark" else []
        write_drafter([kind, str(d / kind), "--target", str(tiny_dir), *layout])
    return d


SPECS = {  # MTP at the default (adaptive verification), the others at a fixed k: a smaller program each
    "off": None,
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, **FIXED_K},
    "dflash": {"method": "dflash", "num_speculative_tokens": 15, **FIXED_K},
    "dspark": {"method": "dspark", "num_speculative_tokens": 7, **FIXED_K},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 2, **FIXED_K},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, **FIXED_K},
}


def with_method(llm, drafters, name):
    spec = SPECS[name]
    if spec is not None and name not in ("mtp", "ngram"):
        spec = {**spec, "model": str(drafters / name)}
    return llm.with_speculation(spec)


def without_hits(llm):
    """The same engine with a store that keeps nothing: every prompt runs all its blocks."""
    store = llm.engine.prefix_cache
    return PrefixCache("no hits", store.block_size, 0)


def run_both(llm, fn):
    """fn() once with a store that keeps nothing, then twice on a fresh store: filling it (later
    rows of a batch and later calls may hit what earlier ones kept), then hitting. Returns the
    three results and the hit tokens of the last two runs."""
    store = llm.engine.prefix_cache
    llm.engine.prefix_cache = without_hits(llm)
    try:
        cold = fn()
    finally:
        llm.engine.prefix_cache = fresh = PrefixCache("fresh " + str(id(store)), store.block_size, store.budget_bytes)
    filled = fn()
    hits_filling = fresh.hits
    warm = fn()
    return cold, filled, warm, (hits_filling, fresh.hits - hits_filling)


def assert_bitwise(a, b):
    flat_a, flat_b = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
    assert len(flat_a) == len(flat_b)
    for (path, x), y in zip(flat_a, flat_b):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert np.array_equal(np.asarray(x), np.asarray(y)), f"{jax.tree_util.keystr(path)} differs"


@pytest.mark.parametrize("name", list(SPECS))
def test_a_hit_gives_the_same_state_and_tokens_bitwise(cached_llm, drafters, name):
    llm = with_method(cached_llm, drafters, name)
    params = [GREEDY, dataclasses.replace(GREEDY, seed=3, temperature=0.8), GREEDY]
    cold, filled, warm, hits = run_both(llm, lambda: llm.prefill(PROMPTS, params))
    # Filling: the second prompt resumes from A's block 0 (it leaves A mid-way through block 1),
    # the third from A's blocks 0-1 (it leaves A one token later). Then every prompt hits its own.
    assert hits == (BLOCK + 2 * BLOCK, 3 * 2 * BLOCK)
    assert_bitwise(cold, filled)
    assert_bitwise(cold, warm)
    outs = run_both(llm, lambda: [o.outputs[0].token_ids for o in llm.generate(
        prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)])
    assert outs[0] == outs[1] == outs[2]


def test_a_hit_of_three_blocks_restores_a_fresh_run_then_one_in_place(cached_llm):
    """Three cached blocks come back in two restore calls: two into a fresh row made in the first,
    then one in place after them; the state equals the one with nothing cached, bitwise."""
    prompt = A + np.random.default_rng(11).integers(0, 500, 60).tolist()  # 210 tokens: 3 full blocks, a partial 4th
    calls = []

    def counted(name, call):
        calls.append(name)
        return call()

    with cached_llm.engine.runner.watching(counted):
        cold, filled, warm, hits = run_both(cached_llm, lambda: cached_llm.prefill([prompt], GREEDY))
    assert hits == (0, 3 * BLOCK) and calls.count("restore_blocks") == 2
    assert_bitwise(cold, warm)


def test_greedy_with_caching_equals_caching_off(tiny_llm, cached_llm):
    """Block-by-block prefill is a different order of the same float32 sums: the same tokens."""
    outs = [[o.outputs[0].token_ids for o in x.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                        use_tqdm=False)] for x in (tiny_llm, cached_llm)]
    assert outs[0] == outs[1]


def test_each_request_says_the_tokens_it_reused_and_reset_forgets_them(tiny_llm, cached_llm):
    """vLLM's RequestOutput.num_cached_tokens per request, and LLM.reset_prefix_cache()."""
    def run(prompts):
        outs = cached_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        return [o.num_cached_tokens for o in outs], [o.outputs[0].token_ids for o in outs]

    assert cached_llm.reset_prefix_cache() is True
    assert run([A])[0] == [0]
    # A resumes from its own two blocks; PROMPTS[1] from A's first; a prompt of one block cannot hit
    cached, tokens = run([A, PROMPTS[1], A[:40]])
    assert cached == [2 * BLOCK, BLOCK, 0]
    queries, hits = cached_llm.engine.prefix_cache.queries, cached_llm.engine.prefix_cache.hits
    assert cached_llm.reset_prefix_cache() is True  # A's blocks now come from its own row, run first
    assert run([A, PROMPTS[1], A[:40]]) == ([0, BLOCK, 0], tokens)
    assert (cached_llm.engine.prefix_cache.queries, cached_llm.engine.prefix_cache.hits) == (queries + 280,
                                                                                               hits + BLOCK)
    assert tiny_llm.reset_prefix_cache() is False
    assert tiny_llm.generate(prompt_token_ids=[A], sampling_params=GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_multi_turn_chat_hits_each_earlier_turn(cached_llm):
    """Each turn's prompt is the last turn's prompt, its answer and a new message: it resumes
    from the blocks the last turn's prefill kept; tokens equal those with nothing cached."""
    llm = cached_llm.with_speculation(SPECS["mtp"])
    params = dataclasses.replace(GREEDY, max_tokens=20)

    def conversation():
        prompt, answers, rng = A[:70], [], np.random.default_rng(9)
        for _ in range(3):
            answer = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
            answers.append(answer.token_ids)
            prompt = prompt + answer.token_ids + rng.integers(0, 500, 25).tolist()
        return answers

    cold, filled, warm, hits = run_both(llm, conversation)
    assert cold == filled == warm
    # Prompts of 70, 115 and 160 tokens: turns 2 and 3 resume from the turn before (1 block, 1
    # block); repeated, each turn hits its own blocks (1, 1, 2).
    assert hits == (2 * BLOCK, 4 * BLOCK)


def test_n_samples_of_one_prompt_share_its_blocks(cached_llm):
    """Four seeded samples of one prompt in one batch: rows after the first resume from its blocks
    and draw what they draw with nothing cached."""
    llm = cached_llm.with_speculation(SPECS["mtp"])
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in range(4)]

    def sample():
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=[A] * 4, sampling_params=params,
                                                             use_tqdm=False)]

    cold, filled, warm, hits = run_both(llm, sample)
    assert cold == filled == warm and len({tuple(t) for t in cold}) > 1
    assert hits == (3 * 2 * BLOCK, 4 * 2 * BLOCK)


def test_eviction_keeps_the_budget_and_parents(cached_llm):
    """A budget of three blocks: a new prefix evicts the deepest blocks of the coldest one first,
    so what stays is always a run from a prefix's start, and a hit after eviction stays exact; a
    prompt longer than the budget keeps its first blocks."""
    llm = cached_llm.with_speculation(None)
    llm.prefill([A[:130]], [GREEDY])  # fills blocks 0-1 of A
    store = llm.engine.prefix_cache
    size = store.bytes // 2
    llm.engine.prefix_cache = small = PrefixCache("small", BLOCK, 3 * size)
    B = RNG.integers(0, 500, 200).tolist()
    llm.prefill([A[:130]], [GREEDY])
    llm.prefill([B], [GREEDY])  # three blocks of B: A's block 1 (deepest, coldest) goes, then A's block 0
    assert small.bytes <= small.budget_bytes and len(small.blocks) == 3
    assert [len(small.lookup(x)) for x in (A[:130], B)] == [0, 3]
    got = llm.prefill([B[:150]], [GREEDY])
    llm.engine.prefix_cache = PrefixCache("none", BLOCK, 0)
    assert_bitwise(got, llm.prefill([B[:150]], [GREEDY]))
    llm.engine.prefix_cache = smaller = PrefixCache("smaller", BLOCK, 2 * size)
    long = RNG.integers(0, 500, 3 * BLOCK + 10).tolist()
    llm.prefill([long], [GREEDY])  # three full blocks, a budget of two: it keeps its first two
    assert len(smaller.lookup(long)) == 2 and smaller.bytes <= smaller.budget_bytes


def test_blocks_the_device_evicts_come_back_from_host_memory(cached_llm):
    """A one-block device budget with a host tier: A's first block moves to host memory when its
    second arrives; a hit copies it back (which sends the second to the host, then brings it back
    too), and the state still equals the no-hit one bitwise."""
    llm = cached_llm.with_speculation(SPECS["mtp"])
    probe = PrefixCache("probe", BLOCK, 10**12)
    llm.engine.prefix_cache = probe
    llm.prefill([A[:70]], [GREEDY])
    one = probe.bytes
    llm.engine.prefix_cache = tiered = PrefixCache("tiered", BLOCK, one, host_budget_bytes=4 * one)
    llm.prefill([A[:140]], [GREEDY])  # blocks 0 and 1: block 0 goes to the host
    assert (len(tiered.blocks), len(tiered.host.blocks)) == (1, 1)
    got = llm.prefill([A[:140]], [GREEDY])
    assert tiered.host_hits == tiered.hits == 2 * BLOCK
    llm.engine.prefix_cache = PrefixCache("none", BLOCK, 0)
    assert_bitwise(got, llm.prefill([A[:140]], [GREEDY]))


def test_a_hits_programs_take_only_the_weights_they_read(cached_llm):
    """Each argument of a program costs host time at every call: a restore takes no weights and
    start_decode without a proposer few; a block pass, which reads most, takes them all (one trace
    at compile time, not two)."""
    llm = cached_llm.with_speculation(None)
    for _ in range(2):  # a miss, then a hit
        llm.prefill([A], [GREEDY])
    engine = llm.engine
    taken = {key[0]: len(params) for key, (_, params) in engine.runner.executables.items()}
    assert taken["restore_blocks"] == 0
    assert taken["start_decode"] <= len(engine.runner.param_leaves) // 2
    assert taken["prefill_block"] == len(engine.runner.param_leaves)


def test_a_block_pass_launches_kernel_by_kernel_unless_the_user_says_otherwise(tiny_dir, monkeypatch):
    """A block pass compiles without XLA's command buffers (its caches move between calls); the
    other programs keep the defaults, and an engine's own compiler_options win over the pass's."""
    seen = []
    compile_ = jax.stages.Lowered.compile

    def recording(self, compiler_options=None):
        seen.append(compiler_options)
        return compile_(self, compiler_options)

    monkeypatch.setattr(jax.stages.Lowered, "compile", recording)
    for user in (None, {"xla_gpu_enable_command_buffer": "FUSION"}):
        llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=1, enable_prefix_caching=True,
                  compiler_options=user)
        seen.clear()
        llm.prefill([A], [GREEDY])  # compiles empty_row, prefill_block and start_decode
        if user is None:
            assert seen.count(KERNEL_BY_KERNEL) == 1 and seen.count(None) == len(seen) - 1
        else:
            assert seen == [user] * len(seen)


def test_keys_cover_the_whole_prefix():
    """Two prompts with the same second block after different first blocks share no key."""
    store = PrefixCache("root", BLOCK, 10**9)
    x, y = list(range(128)), [7] * 64 + list(range(64, 128))
    kx, ky = store.keys(x), store.keys(y)
    assert len(kx) == len(ky) == 2 and not set(kx) & set(ky)
    assert PrefixCache("another model", BLOCK, 10**9).keys(x) != kx


def test_the_scheduler_reuses_a_slot_with_a_hit_and_reports_it(tiny_dir):
    """Through the server's scheduler (one slot, so the second request takes the first's slot):
    the second request resumes from the first's blocks, its tokens equal a no-hit run, and the
    counters reach /metrics."""
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=1, enable_prefix_caching=True)
    second = A[:130] + [1, 2, 3]
    want = llm.with_speculation(None).generate(prompt_token_ids=[second], sampling_params=GREEDY,
                                               use_tqdm=False)[0].outputs[0].token_ids
    scheduler = Scheduler(llm.engine, steps_per_chunk=4).start()
    try:
        list(scheduler.stream(A[:130], GREEDY))
        got = sum((u.token_ids for u in scheduler.stream(second, GREEDY)), [])
        stats = scheduler.stats()
    finally:
        scheduler.shutdown()
    assert got == want
    assert stats["prefix_cache_hits"] == 2 * BLOCK and stats["prefix_cache_queries"] == 130 + 133
    text = prometheus_text(stats, "tiny")
    assert 'vllm:prefix_cache_hits_total{model_name="tiny"} 128' in text
    assert 'vllm:prefix_cache_queries_total{model_name="tiny"} 263' in text
    names = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert names["vllm:prefix_cache_hits"] == 128


@pytest.mark.parametrize("kwargs, message", [
    ({"enable_prefix_caching": True, "prefix_block_size": 100},
     "prefix_block_size=100 must be a positive multiple of 64"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching='yes' must be True or False"),
    ({"enable_prefix_caching": True, "prefix_cache_gb": -1}, "prefix_cache_gb=-1 must be a positive number"),
])
def test_bad_settings_are_refused(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_dir), dtype="float32", max_model_len=128, **kwargs)


def test_block_size_sets_the_cache_length(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=200, enable_prefix_caching=True,
              prefix_block_size=128)
    assert llm.engine.config.cache_len == 256 and llm.engine.prefix_cache.block_size == 128
