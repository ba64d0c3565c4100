"""DSpark: the DFlash backbone plus the Markov head sampled left to right in a lax.scan, in both
published layouts; greedy output equals plain decoding; bad drafters and k are refused."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DRAFT_GREEDY as GREEDY
from helpers import DSPARK, assert_greedy_equals_plain, drafter_spec
from helpers import drafter_prompts as prompts
from flax import nnx

from spec_jax import LLM, SamplingParams
from spec_jax.writing.random_checkpoint import write_dflash_checkpoint

@pytest.fixture(scope="module", params=["dspark", "speculators"])
def dspark_dir(request, tmp_path_factory):
    return write_dflash_checkpoint(tmp_path_factory.mktemp(request.param), DSPARK, seed=2, layout=request.param)


def spec(d, k=4, **kw):
    return drafter_spec("dspark", d, k, **kw)


def test_greedy_equals_plain_alone_and_in_a_mixed_batch(tiny_llm, plain_greedy, dspark_dir):
    llm = tiny_llm.with_speculation(spec(dspark_dir))
    assert_greedy_equals_plain(llm, plain_greedy)
    assert llm.metrics["num_draft_tokens"] > 0 and len(llm.metrics["acceptance_per_position"]) == 4


def test_both_layouts_load_the_same_drafter(tmp_path):
    from models.qwen3_5 import Qwen3_5Config
    from spec_jax.loading.drafters import load_dflash

    target = Qwen3_5Config(vocab_size=512, hidden_size=64, num_hidden_layers=8)
    native = load_dflash(write_dflash_checkpoint(tmp_path / "n", DSPARK, seed=5, layout="dspark"), target)
    spec_layout = load_dflash(write_dflash_checkpoint(tmp_path / "s", DSPARK, seed=5, layout="speculators"), target)
    def same(c):
        return dataclasses.replace(c, draft_vocab_size=None)  # Speculators spell the vocabulary out
    assert same(native[1]) == same(spec_layout[1])  # and count aux ids as the layer ids + 1
    for a, b in zip(jax_leaves(native[0]), jax_leaves(spec_layout[0])):
        np.testing.assert_array_equal(a, b)


def jax_leaves(model):
    import jax

    return jax.tree.leaves(nnx.state(model))


def test_the_markov_chain_matches_a_step_by_step_reference(tiny_llm, dspark_dir):
    """Drafts equal argmax(base_j + W2 W1[previous draft]) taken one position at a time."""
    llm = tiny_llm.with_speculation(spec(dspark_dir))
    state, _, _ = llm.engine.start(prompts()[1:2], [GREEDY], rows=1)  # the state read below: one row
    model, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    proposer = llm.engine.plan.proposer
    def choose(logits, pos):
        return (jnp.argmax(logits, -1).astype(jnp.int32), None)
    drafts, n, _, _ = proposer.propose(model, draft, state.proposer, state.tokens, state.lengths, choose)
    L = int(state.lengths[0])
    block = jnp.asarray([[int(state.tokens[0, L - 1])] + [DSPARK.mask_token_id] * 3])
    h = draft.block(model.embed(block), jnp.arange(L - 1, L + 3)[None], state.proposer, state.lengths - 1)
    base = np.asarray(model.logits(h))[0]
    w1, w2 = np.asarray(draft.markov_head.markov_w1[...]), np.asarray(draft.markov_head.markov_w2.weight[...])
    prev, want = int(state.tokens[0, L - 1]), []
    for j in range(4):
        prev = int(np.argmax(base[j] + w2 @ w1[prev]))
        want.append(prev)
    assert np.asarray(drafts[0]).tolist() == want and int(n[0]) == 4
    fewer, n_fewer, _, _ = proposer.with_drafts(2).propose(model, draft, state.proposer, state.tokens, state.lengths,
                                                           choose)
    assert np.asarray(fewer[0]).tolist() == want[:2] and int(n_fewer[0]) == 2  # the same block's first drafts
    # the Markov bias matters: without it the drafts differ
    assert np.argmax(base, -1).tolist() != want


def test_probabilistic_drafting_runs_at_temperature(tiny_llm, dspark_dir):
    llm = tiny_llm.with_speculation(spec(dspark_dir, draft_sample_method="probabilistic"))
    out = llm.generate(prompt_token_ids=prompts()[:2], sampling_params=SamplingParams(
        max_tokens=12, temperature=0.9, seed=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)


def test_k_below_the_block_is_refused(tiny_llm, dspark_dir):
    with pytest.raises(ValueError, match="num_speculative_tokens=3 is below the DSpark drafter's block_size 4"):
        tiny_llm.with_speculation(spec(dspark_dir, 3))


def test_method_must_match_the_checkpoint(tiny_llm, dspark_dir):
    with pytest.raises(ValueError, match="is a dspark drafter, not dflash"):
        tiny_llm.with_speculation({"method": "dflash", "model": str(dspark_dir), "num_speculative_tokens": 3})


@pytest.mark.parametrize("change, message", [
    ({"markov_head_type": "gated"}, "markov_head_type 'gated' is not supported"),
    ({"draft_vocab_size": 256}, "no 'lm_head.weight' or 'd2t'; a reduced-vocabulary drafter needs its own lm_head"),
])
def test_unsupported_dspark_configs(tiny_llm, tmp_path, change, message):
    d = write_dflash_checkpoint(tmp_path / "d", DSPARK, layout="dspark")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message):
        tiny_llm.with_speculation(spec(d))


def test_a_gguf_target_is_refused_for_dspark(tmp_path, dspark_dir):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="'dspark' needs a safetensors target, not the GGUF file"):
        LLM(model=str(gguf), speculative_config=spec(dspark_dir))
