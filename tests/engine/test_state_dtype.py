"""vLLM's `mamba_ssm_cache_dtype` through the engine: the GDN state cached in 16 bits, greedy
speculation still equal to plain decoding with it (both rollbacks, drafts accepted at every
count), "auto" taking the checkpoint's `mamba_ssm_dtype`, and a bad value named."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FIXED_K, TINY

from models.gated_deltanet import GDNCache
from spec_jax import LLM, SamplingParams
from spec_jax.loading import load_model
from spec_jax.writing.random_checkpoint import write_checkpoint

PROMPTS = [[5, 9, 14, 3, 7], [11, 2, 30], [8, 8, 1]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
ARGS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=[4])


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


def state_dtypes(llm: LLM) -> set:
    state = llm.prefill(PROMPTS[:1], GREEDY)
    return {c.state.dtype for c in state.cache if isinstance(c, GDNCache)}


@pytest.fixture(scope="module")
def bf16_llm(echo_dir):
    return LLM(model=str(echo_dir), mamba_ssm_cache_dtype="bfloat16", **ARGS)


def test_the_caches_hold_the_state_in_the_asked_dtype(bf16_llm):
    assert state_dtypes(bf16_llm) == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("rollback", ["replay", "checkpoint"])
def test_greedy_speculation_equals_plain_with_a_16_bit_state(bf16_llm, rollback):
    plain = tokens(bf16_llm)
    spec = bf16_llm.with_speculation({"method": "mtp", "num_speculative_tokens": 3, **FIXED_K}, rollback=rollback)
    assert tokens(spec) == plain
    m = spec.metrics
    assert 0 < m["num_accepted_tokens"] < m["num_draft_tokens"]  # rollbacks of every kind ran


def test_auto_takes_the_checkpoints_dtype_and_a_bad_value_is_named(tmp_path):
    d = write_checkpoint(tmp_path, dataclasses.replace(TINY, mamba_ssm_dtype="float16"), seed=2)
    assert state_dtypes(LLM(model=str(d), **ARGS)) == {jnp.dtype(jnp.float16)}
    with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype='int8'; expected one of auto, float32, bfloat16"):
        LLM(model=str(d), mamba_ssm_cache_dtype="int8", **ARGS)


def test_a_prefix_cache_hit_gives_the_same_state_with_a_16_bit_state(tiny_dir):
    """Prefilled block by block, a prompt's state is rounded where each block ends whether the
    blocks were run or restored: a hit leaves the caches bitwise as the run that stored them."""
    llm = LLM(model=str(tiny_dir), enable_prefix_caching=True, mamba_ssm_cache_dtype="bfloat16",
              **{**ARGS, "max_model_len": 256})
    prompt = [list(range(3, 150))]  # two whole 64-token blocks and a partial third
    cold, warm = (llm.prefill(prompt, GREEDY) for _ in range(2))
    assert llm.engine.prefix_cache.hits == 2 * 64
    for a, b in zip(cold.cache, warm.cache):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_one_engines_choice_does_not_carry_to_the_next_over_the_same_model(tiny_dir):
    model, _ = load_model(tiny_dir, "float32")
    assert state_dtypes(LLM(model, mamba_ssm_cache_dtype="bfloat16", **ARGS)) == {jnp.dtype(jnp.bfloat16)}
    assert state_dtypes(LLM(model, **ARGS)) == {jnp.dtype(jnp.float32)}  # "auto": the checkpoint's again
    assert model.cfg.mamba_ssm_dtype == "float32"
