"""The MTP head, loaded from `mtp.*`, against HF's own decoder-layer modules fed the same weights;
its reduced draft vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FIXED_K, HF_FIXTURES, assert_greedy_equals_plain
from flax import nnx

from models.layers import Batch
from models.qwen3_5 import init_cache, init_mtp_cache
from proposers.mtp import DraftVocabHead
from spec_jax import SamplingParams
from spec_jax.loading import load_model


def mtp_logits(model, ids: np.ndarray) -> np.ndarray:
    """Draft row p: token ids[p+1] at position p with the target's post-norm hidden at p. One jitted
    program: eagerly, every op of both networks is compiled and dispatched on its own."""
    T = len(ids)
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, tokens):
        model = nnx.merge(graphdef, params)
        hidden = model(tokens, Batch(jnp.zeros(1, jnp.int32), jnp.asarray([T])),
                       init_cache(model.cfg, 1, T, jnp.float32), kv_len=T).hidden
        h, _ = model.mtp(model.embed(tokens[:, 1:]), hidden[:, :-1],
                         Batch(jnp.zeros(1, jnp.int32), jnp.asarray([T - 1])),
                         init_mtp_cache(model.cfg, 1, T, jnp.float32), kv_len=T - 1)
        return model.logits(h)[0]

    return np.asarray(forward(params, jnp.asarray(ids, jnp.int32)[None]))


@pytest.mark.parametrize("case", ["dense_vl", "dense_text", "moe_vl", "moe_text"])
def test_mtp_head_matches_hf_modules(case):
    ref = np.load(HF_FIXTURES / case / "reference.npz")
    model, cfg = load_model(HF_FIXTURES / case, "float32")
    assert cfg.mtp_num_hidden_layers == 1 and model.mtp is not None
    got = mtp_logits(model, ref["input_ids"])
    want = ref["mtp_logits"]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-4


def test_checkpoint_without_mtp_loads_without_head():
    model, cfg = load_model(HF_FIXTURES / "next", "float32")
    assert model.mtp is None and cfg.mtp_num_hidden_layers == 0


def test_reduced_draft_vocabulary_drafts_low_ids_and_keeps_greedy_output(tiny_llm, plain_greedy):
    """draft_vocab_size n: the head's logits are the full head's over ids < n and -inf past them;
    greedy output is the plain one; every draft is an id < n."""
    n = 200
    llm = tiny_llm.with_speculation({"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_size": n, **FIXED_K})
    head = DraftVocabHead(tiny_llm.model, n)
    hidden = jnp.asarray(np.random.default_rng(1).normal(size=(3, tiny_llm.cfg.hidden_size)), jnp.float32)
    got, full = np.asarray(head(hidden)), np.asarray(tiny_llm.model.logits(hidden))
    np.testing.assert_allclose(got[:, :n], full[:, :n], rtol=1e-6, atol=1e-6)
    assert np.all(got[:, n:] == -np.inf) and got.shape == full.shape
    assert_greedy_equals_plain(llm, plain_greedy)
    state, _, _ = llm.engine.start([[1, 2, 3, 4]], [SamplingParams(max_tokens=8, temperature=0.0)])
    next_logits = llm.engine.plan.proposer.next_logits(tiny_llm.model, head, state.proposer)
    assert int(jnp.argmax(next_logits[0])) < n


@pytest.mark.parametrize("spec,message", [
    ({"method": "dflash", "model": "x", "num_speculative_tokens": 3, "draft_vocab_size": 10}, "applies to method"),
    ({"method": "mtp", "num_speculative_tokens": 1, "draft_vocab_size": 0}, "applies to method"),
    ({"method": "mtp", "num_speculative_tokens": 1, "draft_vocab_size": 100000}, "between 1 and the model"),
])
def test_reduced_draft_vocabulary_is_checked(tiny_llm, spec, message):
    with pytest.raises(ValueError, match=message):
        tiny_llm.with_speculation(spec)
