"""Caches and plain generation: incremental decoding equals a full forward; batches equal rows alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FIXED_K

from models.layers import Batch
from models.qwen3_5 import init_cache
from spec_jax import LLM, SamplingParams
from spec_jax.loading import load_model


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, "float32")[0]


def extend_fn(model, kv_len):
    """Jitted: run T new tokens per row from a cache; returns (logits [B, T, V], cache)."""
    gdef, params = nnx.split(model)

    @jax.jit
    def run(params, tokens, start, n_valid, cache):
        m = nnx.merge(gdef, params)
        out = m(tokens, Batch(start, n_valid), cache, kv_len=kv_len)
        return m.logits(out.hidden), out.cache

    return lambda *a: run(params, *a)


@pytest.mark.parametrize("n, m", [(10, 6), (70, 3)])
def test_prefill_then_decode_equals_full_forward(model, n, m):
    L = 128
    ids = np.random.default_rng(n).integers(0, 500, size=n + m).astype(np.int32)
    run = extend_fn(model, L)
    def padded(x):
        return jnp.pad(jnp.asarray(x)[None], ((0, 0), (0, L - len(x))))
    def empty():
        return init_cache(model.cfg, 1, L, jnp.float32)
    full, _ = run(padded(ids), jnp.zeros(1, jnp.int32), jnp.asarray([n + m]), empty())
    logits, cache = run(padded(ids[:n]), jnp.zeros(1, jnp.int32), jnp.asarray([n]), empty())
    got = [logits[0, n - 1]]
    for i in range(m):
        logits, cache = run(jnp.asarray([[ids[n + i]]]), jnp.asarray([n + i]), jnp.asarray([1]), cache)
        got.append(logits[0, 0])
    np.testing.assert_allclose(np.stack(got), full[0, n - 1 : n + m], rtol=1e-4, atol=1e-4)


def test_batch_rows_equal_rows_alone(tiny_dir, tiny_llm):
    """Rows of a batch equal each row run alone in a one-row program (the default buckets: powers
    of two), and the batch padded to tiny_llm's one bucket of four rows."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 500, size=n).tolist() for n in (5, 17, 70)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    together = tiny_llm.generate(prompt_token_ids=prompts, sampling_params=params)
    one_row = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4)
    assert (one_row.engine.batch_bucket(1), tiny_llm.engine.batch_bucket(1)) == (1, 4)
    for p, out in zip(prompts, together):
        alone = one_row.generate(prompt_token_ids=[p], sampling_params=params)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 12


def test_batch_buckets_pick_the_smallest_that_holds_a_batch(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=64, max_num_seqs=8, batch_buckets=[6, 2, 2])
    assert [llm.engine.batch_bucket(n) for n in (1, 2, 3, 6, 7, 8)] == [2, 2, 6, 6, 8, 8]
    for bad, message in [([0], "a batch bucket=0 must be between 1 and max_num_seqs=8"),
                         ([9], "a batch bucket=9 must be between 1"), ([2.0], "a batch bucket must be an integer"),
                         ("4", "batch_buckets must be a non-empty list"), ([], "batch_buckets must be a non-empty")]:
        with pytest.raises(ValueError, match=message):
            LLM(model=str(tiny_dir), dtype="float32", max_model_len=64, max_num_seqs=8, batch_buckets=bad)


def test_greedy_tokens_are_the_argmax_of_full_logits(tiny_llm):
    prompt = [3, 14, 15, 92, 65, 35]
    out = tiny_llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=10, temperature=0,
                                                                                       ignore_eos=True))[0]
    seq = prompt + out.outputs[0].token_ids
    logits = tiny_llm.logits(seq)
    assert logits.shape == (len(seq), 512)
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == out.outputs[0].token_ids


def test_sampling_is_seeded_and_mixes_with_greedy(tiny_llm):
    prompt = [[1, 2, 3, 4]]
    hot = SamplingParams(max_tokens=16, temperature=1.5, top_k=100, top_p=0.95, seed=3, ignore_eos=True)
    a = tiny_llm.generate(prompt_token_ids=prompt, sampling_params=hot)[0].outputs[0].token_ids
    b = tiny_llm.generate(prompt_token_ids=prompt, sampling_params=hot)[0].outputs[0].token_ids
    assert a == b
    other = tiny_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=16, temperature=1.5, top_k=100, top_p=0.95, seed=4, ignore_eos=True))[0].outputs[0].token_ids
    assert other != a
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    mixed = tiny_llm.generate(prompt_token_ids=prompt * 2, sampling_params=[hot, greedy])
    assert mixed[0].outputs[0].token_ids == a
    alone = tiny_llm.generate(prompt_token_ids=prompt, sampling_params=greedy)[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == alone


def test_top_k_one_is_greedy(tiny_llm):
    prompt = [[9, 8, 7]]
    greedy = tiny_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    top1 = tiny_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=8, temperature=2.0, top_k=1, seed=0, ignore_eos=True))[0].outputs[0].token_ids
    assert top1 == greedy


def test_stop_tokens_and_max_tokens(tiny_llm):
    prompt = [[5, 6, 7, 8]]
    free = tiny_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(free.token_ids) == 10 and free.finish_reason == "length"
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = tiny_llm.generate(prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=10, temperature=0, stop_token_ids=[stop_at], ignore_eos=True))[0].outputs[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_generation_stops_at_max_model_len(tiny_llm):
    prompt = list(range(1, 250))
    out = tiny_llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=None, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(prompt) + len(out.token_ids) == 256 and out.finish_reason == "length"


def test_the_functional_layer_steps_to_what_generate_returns(tiny_llm):
    """`LLM.prefill` then `LLM.decode` one step at a time over the explicit state gives the same
    tokens as `generate`; padding rows of the bucket start done."""
    llm = tiny_llm.with_speculation({"method": "ngram", "num_speculative_tokens": 2, **FIXED_K})
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    state = llm.prefill(prompts, params)
    assert state.tokens.shape[0] == llm.engine.batch_bucket(2) and bool(state.done[2:].all())
    while not bool(state.done[:2].all()):
        state = llm.decode(state, 1)
    got = [state.tokens[i, len(p):int(state.lengths[i])].tolist() for i, p in enumerate(prompts)]
    assert got == want
    with pytest.raises(ValueError, match="prefill takes 1 to max_num_seqs=4"):
        llm.prefill([[1]] * 5, params)
