"""Suffix decoding beside a model drafter (`enable_suffix_decoding`): the per-row choice, the
config, and greedy equality with speculation off."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_greedy_equals_plain
from proposers.combined import CombinedProposer
from proposers.mtp import MTPProposer
from proposers.registry import build_proposer
from proposers.suffix import OutputCache, SuffixProposer
from spec_jax.engine.config import EngineConfig
from spec_jax.engine.spec_config import parse_speculative_config


@dataclasses.dataclass(frozen=True)
class CountingDrafter:
    """A model drafter's stand-in: drafts 100, 101, ... (k of them), q one-hot when asked; its state
    counts the tokens it was updated with, so the test sees it follow every row."""

    k: int
    with_q: bool = False

    def init_state(self, model, draft, tokens, lengths, target, choose):
        return jnp.zeros_like(lengths)

    def propose(self, model, draft, state, tokens, lengths, choose):
        drafts = jnp.broadcast_to(100 + jnp.arange(self.k), (lengths.shape[0], self.k)).astype(jnp.int32)
        q = jnp.full((*drafts.shape, 128), 1 / 128) if self.with_q else None
        return drafts, jnp.full_like(lengths, self.k), q, state

    def update(self, model, draft, state, target, emitted, n_acc, lengths, choose):
        return state + n_acc + 1


def test_a_row_takes_the_suffix_draft_where_it_expects_k_tokens():
    rows = np.zeros((3, 40), np.int32)
    rows[0, :30] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3  # a long repeat: suffix
    rows[1, :12] = np.arange(20, 32)  # no repeat: the model
    rows[2, :9] = [1, 2, 3, 4, 9, 1, 2, 3, 4]  # one short repeat at probability 1/2: below k = 3
    lengths = jnp.asarray([30, 12, 9])
    combined = CombinedProposer(CountingDrafter(3), SuffixProposer(24))
    assert combined.k == 24
    # Each method compiled whole, as the engine's step runs it (an op at a time: hundreds of compiles)
    state = jax.jit(combined.init_state)(None, None, jnp.asarray(rows), lengths, None, None)
    drafts, n, q, state = jax.jit(combined.propose)(None, None, state, jnp.asarray(rows), lengths, None)
    assert q is None and drafts.shape == (3, 24)
    # row 0: its 10-token match occurs twice before (probability 2/3 a token, score 6.7)
    assert np.asarray(n).tolist() == [10, 3, 3]
    assert np.asarray(drafts[0, :10]).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert np.asarray(drafts[1:, :3]).tolist() == [[100, 101, 102]] * 2
    state = jax.jit(combined.update)(None, None, state, None, drafts, jnp.asarray([5, 0, 1]), lengths, None)
    assert np.asarray(state[0]).tolist() == [6, 1, 2]  # the model drafter follows every row
    assert isinstance(state[1], OutputCache)


def test_draft_probabilities_are_one_hot_on_suffix_rows():
    rows = jnp.asarray([[1, 2, 3, 4, 5, 6, 7, 8] * 3, list(range(30, 54))], jnp.int32)
    combined = CombinedProposer(CountingDrafter(2, with_q=True), SuffixProposer(8))
    state = jax.jit(combined.init_state)(None, None, rows, jnp.asarray([24, 24]), None, None)
    drafts, n, q, _ = jax.jit(combined.propose)(None, None, state, rows, jnp.asarray([24, 24]), None)
    assert q.shape == (2, 8, 128) and int(n[0]) > 2
    assert np.allclose(q[0, 0], np.eye(128)[int(drafts[0, 0])]) and np.allclose(q[1, 0], 1 / 128)


def test_config():
    spec = parse_speculative_config({"method": "mtp", "num_speculative_tokens": 2, "enable_suffix_decoding": True,
                                     "suffix_decoding_max_tree_depth": 16})
    proposer = build_proposer(spec, 512, 256)
    assert proposer == CombinedProposer(MTPProposer(2), SuffixProposer(16, 16))
    assert EngineConfig(speculative=spec).k == 16 == proposer.k
    with pytest.raises(ValueError, match="enable_suffix_decoding combines suffix decoding with a model drafter"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "enable_suffix_decoding": True})
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob=2.0 must be in"):
        parse_speculative_config({"method": "mtp", "enable_suffix_decoding": True,
                                  "suffix_decoding_min_token_prob": 2.0})


def test_greedy_equals_plain_with_mtp(tiny_llm, plain_greedy):
    spec = {"method": "mtp", "num_speculative_tokens": 2, "enable_suffix_decoding": True,
            "suffix_decoding_max_tree_depth": 8}
    assert_greedy_equals_plain(tiny_llm.with_speculation(spec), plain_greedy)
