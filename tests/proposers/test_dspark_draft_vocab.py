"""DSpark drafters with a reduced draft vocabulary (Speculators' `draft_vocab_size` < `vocab_size`, an
`lm_head` of their own and a `d2t` table): they load in both layouts, draft only target ids of the
draft vocabulary (greedy and sampled, with q over the target vocabulary), reproduce plain greedy
decoding, and inconsistent vocabulary tables are refused by name."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import DRAFT_GREEDY as GREEDY
from helpers import TINY, assert_greedy_equals_plain, drafter_spec
from helpers import drafter_prompts as prompts
from flax import nnx
from safetensors.numpy import load_file, save_file

from models.dflash import DFlashConfig
from spec_jax import SamplingParams
from spec_jax.engine.step import drafting_policy
from spec_jax.loading.drafters import load_dflash
from spec_jax.writing.random_checkpoint import main, write_dflash_checkpoint

DRAFT_VOCAB = 128
REDUCED = DFlashConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, target_layer_ids=(1, 4, 6), mask_token_id=510,
                       block_size=4, vocab_size=512, draft_vocab_size=DRAFT_VOCAB, markov_rank=8,
                       sample_from_anchor=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, seed=1, ignore_eos=True)


@pytest.fixture(scope="module", params=["speculators", "dspark"])
def reduced_dir(request, tmp_path_factory):
    return write_dflash_checkpoint(tmp_path_factory.mktemp(request.param), REDUCED, seed=4, layout=request.param)


def spec(d, **kw):
    return drafter_spec("dspark", d, 4, **kw)


def draft_vocab_target_ids(d) -> np.ndarray:
    """The target ids of the draft vocabulary, d + d2t[d], as the checkpoint stores them."""
    return np.arange(DRAFT_VOCAB) + load_file(str(d / "model.safetensors"))["d2t"]


def test_a_reduced_vocabulary_drafter_loads_with_its_own_head_and_d2t(reduced_dir):
    draft, cfg = load_dflash(reduced_dir, TINY)
    assert cfg.reduced_vocab and cfg.draft_vocab_size == DRAFT_VOCAB and cfg.vocab_size == TINY.vocab_size
    tensors = load_file(str(reduced_dir / "model.safetensors"))
    np.testing.assert_array_equal(draft.lm_head.weight[...], tensors["lm_head.weight"])
    np.testing.assert_array_equal(draft.d2t[...], tensors["d2t"])
    assert draft.lm_head.weight.shape == (DRAFT_VOCAB, 64)
    # W1 embeds the previous token, a target id; W2 projects onto the draft vocabulary
    assert draft.markov_head.markov_w1.shape == (TINY.vocab_size, 8)
    assert draft.markov_head.markov_w2.weight.shape == (DRAFT_VOCAB, 8)


def test_both_layouts_load_the_same_reduced_drafter(tmp_path):
    native = load_dflash(write_dflash_checkpoint(tmp_path / "n", REDUCED, seed=5, layout="dspark"), TINY)
    spec_layout = load_dflash(write_dflash_checkpoint(tmp_path / "s", REDUCED, seed=5, layout="speculators"), TINY)
    assert native[1] == spec_layout[1]
    for a, b in zip(jax.tree.leaves(nnx.state(native[0])), jax.tree.leaves(nnx.state(spec_layout[0]))):
        np.testing.assert_array_equal(a, b)


def test_the_command_line_writer_makes_a_reduced_drafter_for_its_target(tiny_dir, tmp_path):
    main(["dspark", str(tmp_path / "d"), "--target", str(tiny_dir), "--layout", "speculators",
          "--draft-vocab-size", "100"])
    draft, cfg = load_dflash(tmp_path / "d", TINY)
    assert cfg.reduced_vocab and cfg.draft_vocab_size == 100 and draft.d2t.shape == (100,)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["draft_vocab_size"] == 100


def test_greedy_equals_plain_alone_and_in_a_mixed_batch(tiny_llm, plain_greedy, reduced_dir):
    llm = tiny_llm.with_speculation(spec(reduced_dir))
    assert_greedy_equals_plain(llm, plain_greedy)
    assert llm.metrics["num_draft_tokens"] > 0


def propose(llm, params, choose_for):
    """One DSpark proposal for the middle prompt: (drafts [k], q [k, V] or None, the step's pieces)."""
    state, do_sample, _ = llm.engine.start(prompts()[1:2], [params], rows=1)  # the state read below: one row
    model, draft = nnx.merge(llm.engine.runner.graphdef, llm.engine.runner.params)
    proposer = llm.engine.plan.proposer
    choose = choose_for(state, do_sample)
    drafts, n, q, _ = proposer.propose(model, draft, state.proposer, state.tokens, state.lengths, choose)
    assert int(n[0]) == 4
    return np.asarray(drafts[0]), None if q is None else np.asarray(q[0]), (state, model, draft)


def draft_space_base_logits(state, model, draft) -> np.ndarray:
    """The backbone's draft-vocabulary logits [k, Vd] for the block after the newest token."""
    L = int(state.lengths[0])
    block = jnp.asarray([[int(state.tokens[0, L - 1])] + [REDUCED.mask_token_id] * 3])
    h = draft.block(model.embed(block), jnp.arange(L - 1, L + 3)[None], state.proposer, state.lengths - 1)
    return np.asarray(draft.lm_head(h))[0]


def test_greedy_drafts_are_draft_vocabulary_ids_chained_through_target_ids(tiny_llm, reduced_dir):
    """Drafts equal d + d2t[d] for d = argmax over the draft vocabulary of base_j + W2 W1[previous
    target id], one position at a time."""
    llm = tiny_llm.with_speculation(spec(reduced_dir))
    def greedy(state, do_sample):
        return lambda logits, pos: (jnp.argmax(logits, -1).astype(jnp.int32), None)
    drafts, _, (state, model, draft) = propose(llm, GREEDY, greedy)
    allowed = draft_vocab_target_ids(reduced_dir)
    assert set(drafts.tolist()) <= set(allowed.tolist())
    base = draft_space_base_logits(state, model, draft)
    w1, w2 = np.asarray(draft.markov_head.markov_w1[...]), np.asarray(draft.markov_head.markov_w2.weight[...])
    prev, want = int(state.tokens[0, int(state.lengths[0]) - 1]), []
    for j in range(4):
        prev = int(allowed[np.argmax(base[j] + w2 @ w1[prev])])
        want.append(prev)
    assert drafts.tolist() == want
    assert allowed[np.argmax(base, -1)].tolist() != want  # the Markov bias matters here


def test_sampled_drafts_carry_their_exact_distribution_over_the_draft_vocabulary(tiny_llm, reduced_dir):
    """A sampled draft's q is softmax(warped scattered logits) given the previous sampled draft:
    zero off the draft vocabulary, positive at the draft, the distribution rejection sampling needs."""
    llm = tiny_llm.with_speculation(spec(reduced_dir, draft_sample_method="probabilistic"))
    def sampled(state, do_sample):
        return drafting_policy(state.sampling, probabilistic=True, do_sample=do_sample)
    drafts, q, (state, model, draft) = propose(llm, SAMPLED, sampled)
    allowed = draft_vocab_target_ids(reduced_dir)
    assert set(drafts.tolist()) <= set(allowed.tolist())
    off_vocab = np.ones(TINY.vocab_size, bool)
    off_vocab[allowed] = False
    assert q.shape == (4, TINY.vocab_size) and np.all(q[:, off_vocab] == 0)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-5)
    assert np.all(q[np.arange(4), drafts] > 0)
    base = draft_space_base_logits(state, model, draft)
    w1, w2 = np.asarray(draft.markov_head.markov_w1[...]), np.asarray(draft.markov_head.markov_w2.weight[...])
    prev = [int(state.tokens[0, int(state.lengths[0]) - 1]), *drafts[:-1].tolist()]
    for j in range(4):
        logits = np.full(TINY.vocab_size, -np.inf)
        logits[allowed] = (base[j] + w2 @ w1[prev[j]]) / SAMPLED.temperature
        np.testing.assert_allclose(q[j], np.asarray(jax.nn.softmax(jnp.asarray(logits))), rtol=1e-4, atol=1e-6)


def test_probabilistic_drafting_runs_at_temperature(tiny_llm, reduced_dir):
    llm = tiny_llm.with_speculation(spec(reduced_dir, draft_sample_method="probabilistic"))
    out = llm.generate(prompt_token_ids=prompts()[:2], sampling_params=SAMPLED)
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    assert llm.metrics["num_draft_tokens"] > 0


def rewrite_tensors(d, change):
    tensors = load_file(str(d / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def collide(tensors):
    d2t = tensors["d2t"]
    d2t[1] = d2t[0] - 1  # draft id 1 onto draft id 0's target id


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update(d2t=t["d2t"][:-1]), r"'d2t' has shape \(127,\), but draft_vocab_size 128"),
    (lambda t: t["d2t"].__setitem__(-1, 1000), r"draft id 127 to target id 1127, outside the target's vocab"),
    (collide, "maps draft ids 0 and 1 both to target id"),
    (lambda t: t.pop("d2t"), "no 'd2t'; a reduced-vocabulary drafter needs its own lm_head"),
    (lambda t: t.pop("lm_head.weight"), "no 'lm_head.weight'; a reduced-vocabulary drafter needs its own lm_head"),
])
def test_an_inconsistent_vocabulary_table_is_refused(tiny_llm, tmp_path, change, message):
    d = write_dflash_checkpoint(tmp_path / "d", REDUCED, layout="speculators")
    rewrite_tensors(d, change)
    with pytest.raises(ValueError, match=message):
        tiny_llm.with_speculation(spec(d))


def test_a_drafter_for_another_vocabulary_is_refused(tiny_llm, tmp_path):
    d = write_dflash_checkpoint(tmp_path / "d", dataclasses.replace(REDUCED, vocab_size=1024), layout="dspark")
    with pytest.raises(ValueError, match="has vocab_size 1024 but the target has 512"):
        tiny_llm.with_speculation(spec(d))


def test_draft_vocab_size_without_vocab_size_is_refused(tmp_path):
    d = write_dflash_checkpoint(tmp_path / "d", REDUCED, layout="dspark")
    config = json.loads((d / "config.json").read_text())
    del config["vocab_size"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="draft_vocab_size 128 needs vocab_size"):
        load_dflash(d, TINY)
