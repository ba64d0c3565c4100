"""draft_model: a separate model drafts; greedy output equals plain decoding, the draft's own
caches end at the accepted prefix, and a draft with another vocabulary is refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DRAFT_GREEDY as GREEDY
from helpers import FIXED_K, HF_FIXTURES, TINY, drafter_spec
from helpers import drafter_prompts as prompts
from flax import nnx
from safetensors.numpy import load_file, save_file

from models.layers import Batch
from spec_jax.writing.random_checkpoint import write_checkpoint


@pytest.fixture(scope="module")
def near_copy(tiny_dir, tmp_path_factory):
    """The target with noise on its lm_head: agrees with it often but not always."""
    d = tmp_path_factory.mktemp("near")
    t = load_file(str(tiny_dir / "model.safetensors"))
    rng = np.random.default_rng(0)
    t["lm_head.weight"] = t["lm_head.weight"] + 0.05 * rng.normal(size=t["lm_head.weight"].shape).astype(np.float32)
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text((tiny_dir / "config.json").read_text())
    return d


def spec(draft, k, **fields):
    return drafter_spec("draft_model", draft, k, **fields)


def test_target_as_its_own_draft_accepts_everything(tiny_llm, tiny_dir, plain_greedy):
    llm = tiny_llm.with_speculation(spec(tiny_dir, 3, enable_adaptive_verification=False))
    outs = llm.generate(prompt_token_ids=prompts()[:1], sampling_params=GREEDY)
    assert outs[0].outputs[0].token_ids == plain_greedy[0]
    assert llm.metrics["acceptance_rate"] == 1.0 and llm.metrics["mean_acceptance_length"] == 4.0


@pytest.mark.parametrize("k", [1, 3])
def test_partial_acceptance_in_a_mixed_batch(tiny_llm, near_copy, plain_greedy, k):
    llm = tiny_llm.with_speculation(spec(near_copy, k))
    params = [GREEDY, dataclasses.replace(GREEDY, speculative=False), GREEDY]
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=params)
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    assert 0.2 < llm.metrics["acceptance_rate"] < 0.95
    assert outs[1].metrics["num_draft_tokens"] == 0


def assert_draft_cache_is_a_prefill(llm, draft_state, tokens, upto: int) -> None:
    """Row 0 of the draft's caches equals a fresh prefill of its first `upto` tokens (KV compared
    at those slots only: attention reads no further)."""
    _, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    fresh = draft.init_cache(1, llm.engine.config.cache_len)
    fresh = draft(tokens[:1, :upto], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([upto])), fresh,
                  kv_len=upto).cache
    for g, w in zip(jax.tree.leaves(draft_state.cache), jax.tree.leaves(fresh)):
        if g.ndim == 5 and g.shape[2] == llm.engine.config.cache_len:
            g, w = g[:, :1, :upto], w[:, :, :upto]
        assert float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < 1e-5


def test_the_drafts_caches_end_at_the_accepted_prefix(tiny_llm, near_copy):
    """A draft with GDN layers keeps the caches of its first pass: every committed token but the newest."""
    llm = tiny_llm.with_speculation(spec(near_copy, 3, enable_adaptive_verification=False))
    state, do_sample, _ = llm.engine.start(prompts()[2:], [GREEDY], rows=1)  # the state read below: one row
    state = llm.engine.decode(state, 5, do_sample)
    assert 0 < int(state.stats.accepted[0]) < 15
    n = int(state.lengths[0])
    assert int(state.proposer.fed[0]) == n - 1
    assert_draft_cache_is_a_prefill(llm, state.proposer, state.tokens, n - 1)


def test_an_attention_only_draft_keeps_its_drafting_cache(tiny_llm):
    """A Qwen3 draft keeps the KV it wrote while drafting: below `fed` it equals a fresh prefill
    of the committed tokens, and fed trails the length by one token, or two after a step that
    accepted all k drafts (the last draft was never fed). Synthetic acceptance makes steps of
    every kind; greedy exactness with this draft is `test_a_plain_qwen3_draft`'s."""
    k = 3
    llm = tiny_llm.with_speculation({**spec(HF_FIXTURES.parent / "qwen3", k, enable_adaptive_verification=False),
                                     "rejection_sample_method": "synthetic",
                                     "synthetic_acceptance_rates": [0.8, 0.6, 0.4]})
    state, do_sample, _ = llm.engine.start(prompts()[2:], [GREEDY], rows=1)
    trailing = set()
    for _ in range(8):
        state = llm.engine.decode(state, 1, do_sample)
        draft_state = state.proposer
        n, fed = int(state.lengths[0]), int(draft_state.fed[0])
        trailing.add(n - fed)
        assert_draft_cache_is_a_prefill(llm, draft_state, state.tokens, fed)
    assert trailing == {1, 2}


def test_a_draft_with_another_vocabulary_is_refused(tiny_llm, tmp_path):
    other = write_checkpoint(tmp_path / "other", dataclasses.replace(TINY, vocab_size=256), seed=2)
    with pytest.raises(ValueError, match="vocab_size 256 but the target has 512"):
        tiny_llm.with_speculation(spec(other, 2))


@pytest.mark.parametrize("kind, method", [("dflash", "dflash"), ("dspark", "dspark"), ("eagle3", "eagle3")])
def test_a_drafter_checkpoint_is_not_a_draft_model(tiny_llm, tiny_dir, tmp_path, kind, method):
    from spec_jax.writing.random_checkpoint import main as write

    write([kind, str(tmp_path / kind), "--target", str(tiny_dir), "--layers", "1"])
    with pytest.raises(ValueError, match=f"is a {method} drafter .*; set method to '{method}'"):
        tiny_llm.with_speculation(spec(tmp_path / kind, 2))


def test_a_plain_qwen3_draft(tiny_llm, plain_greedy):
    """A Qwen3 (attention-only) checkpoint drafts for the Qwen3.5 target; its vocabulary matches."""
    llm = tiny_llm.with_speculation(spec(HF_FIXTURES.parent / "qwen3", 2, **FIXED_K))
    outs = llm.generate(prompt_token_ids=prompts(), sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    assert llm.metrics["num_draft_tokens"] > 0
