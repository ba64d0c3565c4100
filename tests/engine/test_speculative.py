"""The speculative step: greedy spec-on equals spec-off, mixed batches, metrics, streaming, the
MTP head's state after rollbacks, and a proposer of one's own (the benchmarks' oracle) handed over
in the speculative config."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FIXED_K, HF_FIXTURES

from bench.oracle import KnownSequences, oracle_config
from models.layers import Batch
from models.qwen3_5 import init_cache, init_mtp_cache
from spec_jax import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def prompts(n_rows=3, vocab=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in (5, 17, 40)[:n_rows]]


def echo_llm(model_dir, spec):
    """The model in one batch bucket of four: a lone prompt and a batch of three share its programs."""
    return LLM(model=str(model_dir), dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=[4],
               speculative_config=spec)


def run(llm, ids, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_echo(echo_dir):
    ids, llm = prompts(), echo_llm(echo_dir, None)
    return ids, run(llm, ids), run(llm, ids[:1])


MTP_ADAPTIVE = {"method": "mtp", "num_speculative_tokens": 3}
SPECS = [  # one config per method at the default (adaptive verification), the others at a fixed k
    {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **FIXED_K},
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "ngram", "num_speculative_tokens": 5, **FIXED_K},
    {"method": "mtp", "num_speculative_tokens": 1, **FIXED_K},
    {"method": "mtp", "num_speculative_tokens": 2, **FIXED_K},
    MTP_ADAPTIVE,
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s['method']}-k{s['num_speculative_tokens']}")
def test_greedy_spec_equals_plain_alone_and_in_a_mixed_batch(echo_dir, plain_echo, spec):
    ids, plain, plain_alone = plain_echo
    llm = echo_llm(echo_dir, spec)
    assert run(llm, ids[:1]) == plain_alone
    # Mixed batch: the second request opts out of drafting and shares every step.
    params = [GREEDY, dataclasses.replace(GREEDY, speculative=False), GREEDY]
    assert run(llm, ids, params) == plain
    m = llm.metrics
    assert m["num_draft_tokens"] > 0 and 0 <= m["num_accepted_tokens"] <= m["num_draft_tokens"]


@pytest.fixture(scope="module")
def dense_plain():
    """A non-degenerate model's plain LLM, its two prompts and their plain greedy RequestOutputs."""
    d = HF_FIXTURES / "dense_vl"
    ref = np.load(d / "reference.npz")
    ids = [ref["prompt_ids"].tolist(), ref["prompt_ids_b"].tolist()]
    llm = LLM(model=str(d), dtype="float32", max_model_len=128, max_num_seqs=4, batch_buckets=[4])
    outs = llm.generate(prompt_token_ids=ids, sampling_params=ORACLE_PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref["greedy_ids"].tolist(), ref["greedy_ids_b"].tolist()]
    return llm, ids, outs


ORACLE_PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("rollback, rate", [("checkpoint", 0.0), ("replay", 0.0), ("checkpoint", 0.3),
                                            ("replay", 0.3), ("replay", 1.0)])
def test_bench_oracle_drafts_on_a_non_degenerate_model(dense_plain, rollback, rate):
    """The benchmarks' oracle (a proposer of one's own, handed over in the config) drafts the
    plain run's continuation with a share of tokens corrupted: at 0 every draft is accepted, at 1
    none, between them every accepted count occurs; output is plain decoding's throughout."""
    llm, ids, plain = dense_plain
    config = oracle_config(KnownSequences.of_outputs(plain), 3, llm.cfg.vocab_size, rate)
    spec = llm.with_speculation(config, rollback=rollback)
    outs = spec.generate(prompt_token_ids=ids, sampling_params=ORACLE_PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    m = spec.metrics
    assert m["num_draft_tokens"] > 0
    if rate == 0:
        assert m["num_accepted_tokens"] == m["num_draft_tokens"]
    elif rate == 1:
        assert m["num_accepted_tokens"] == 0
    else:
        per_pos = m["acceptance_per_position"]
        assert 0.2 < m["acceptance_rate"] < 0.9 and per_pos[0] >= per_pos[1] >= per_pos[2]
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["num_accepted_tokens"] / m["num_drafts"])


def test_bench_oracle_finds_each_row_by_its_prompt(dense_plain):
    """Rows in another order than the known sequences, and a prompt the oracle does not know
    (its drafts are then refused, its output still plain decoding's)."""
    llm, ids, plain = dense_plain
    spec = llm.with_speculation(oracle_config(KnownSequences.of_outputs(plain[:1]), 3, llm.cfg.vocab_size))
    outs = spec.generate(prompt_token_ids=ids[::-1], sampling_params=ORACLE_PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain[::-1]]
    known, unknown = outs[1].metrics, outs[0].metrics
    assert known["num_accepted_tokens"] == known["num_draft_tokens"] > 0
    assert unknown["num_accepted_tokens"] < unknown["num_draft_tokens"] / 2


def test_known_sequences_key_programs_by_content():
    """Two oracles over the same sequences are the same proposer (so they share compiled programs)."""
    a, b = KnownSequences([([1, 2], [3, 4])]), KnownSequences([([1, 2], [3, 4])])
    assert a == b and hash(a) == hash(b) and oracle_config(a, 2, 8)["proposer"] == oracle_config(b, 2, 8)["proposer"]
    assert a != KnownSequences([([1, 2, 3], [4])])  # the same tokens, another prompt
    with pytest.raises(ValueError, match="corruption_rate must be in \\[0, 1\\], got 1.5"):
        oracle_config(a, 2, 8, 1.5)


class NoUpdate:
    """A drafter missing the protocol's `update`."""
    k = 2

    def init_state(self, *args):
        return None

    def propose(self, *args):
        return None


def test_a_proposer_missing_a_protocol_method_is_refused(dense_plain):
    llm = dense_plain[0]
    with pytest.raises(ValueError, match="proposer NoUpdate does not meet the Proposer protocol .*: it lacks update"):
        llm.with_speculation({"method": "custom_class", "num_speculative_tokens": 2, "proposer": NoUpdate()})


def test_metrics_per_request(echo_dir, plain_echo):
    ids = plain_echo[0]
    llm = LLM(model=str(echo_dir), dtype="float32", max_model_len=128, max_num_seqs=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2, "enable_adaptive_verification": False})
    outs = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
    for o in outs:
        m = o.metrics
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_rate",
                    "mean_acceptance_length", "acceptance_per_position", "tpot_s", "tokens_per_s"):
            assert key in m
        assert len(m["acceptance_per_position"]) == 2
        # Prefill emits 1 token and every step (at a fixed k) accepted + 1; only the last step, with
        # no room left under max_tokens, drafts nothing.
        assert m["num_generated_tokens"] in (1 + m["num_drafts"] + m["num_accepted_tokens"] + extra for extra in (0, 1))
    assert llm.metrics["num_requests"] == 3 and llm.metrics["tokens_per_s"] > 0


def test_speculation_off_is_the_plain_path(echo_dir):
    llm = echo_llm(echo_dir, None)  # plain_echo's programs
    assert llm.engine.plan is None and llm.speculative_config is None
    out = llm.generate(prompt_token_ids=prompts(1), sampling_params=GREEDY, use_tqdm=False)[0]
    assert "num_drafts" not in out.metrics


def test_streaming_yields_the_same_tokens(echo_dir, plain_echo):
    ids, _, plain_alone = plain_echo
    llm = echo_llm(echo_dir, MTP_ADAPTIVE)  # the programs of its greedy test above
    chunks = list(llm.generate_stream(prompt_token_ids=ids[0], sampling_params=GREEDY))
    assert sum(chunks, []) == plain_alone[0]
    assert len(chunks) < len(plain_alone[0])  # accepted drafts arrive several per chunk


def test_mtp_state_after_rollbacks_matches_a_full_forward(echo_dir):
    """After a run with rejections, the MTP head's next draft and hidden state equal those of a
    fresh MTP pass over the whole sequence: its KV cache was rewritten correctly."""
    from spec_jax.engine.state import DecodeState  # noqa: F401  (the state the LLM runs)

    llm = LLM(model=str(echo_dir), dtype="float32", max_model_len=128, max_num_seqs=1,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "enable_adaptive_verification": False})
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    state, do_sample, _ = llm.engine.start(prompts(1), [params])
    state = llm.engine.decode(state, 6, do_sample)
    assert int(state.stats.num_drafts[0]) == 6 and 0 < int(state.stats.accepted[0]) < 18
    n = int(state.lengths[0])
    seq = jnp.asarray(state.tokens[:, :n])
    model = llm.model
    graphdef, weights = nnx.split(model)

    @jax.jit  # one program, not one per operation
    def full_forward(weights, seq):
        model = nnx.merge(graphdef, weights)
        hidden = model(seq[:, :-1], Batch(jnp.zeros(1, jnp.int32), jnp.asarray([n - 1])),
                       init_cache(model.cfg, 1, n, jnp.float32), kv_len=n - 1).hidden
        h, _ = model.mtp(model.embed(seq[:, 1:]), hidden, Batch(jnp.zeros(1, jnp.int32), jnp.asarray([n - 1])),
                         init_mtp_cache(model.cfg, 1, n, jnp.float32), kv_len=n - 1)
        return h[0, -1], model.logits(h[0, -1])

    h, logits = full_forward(weights, seq)
    np.testing.assert_allclose(state.proposer.hidden[0], h, rtol=1e-4, atol=1e-4)
    next_logits = llm.engine.plan.proposer.next_logits(model, None, state.proposer)
    assert int(jnp.argmax(next_logits[0])) == int(jnp.argmax(logits))


def test_mtp_refused_on_a_checkpoint_without_mtp():
    with pytest.raises(ValueError, match="no mtp"):
        LLM(model=str(HF_FIXTURES / "next"), dtype="float32", speculative_config={"method": "mtp"})


@pytest.mark.parametrize("bad, field", [('{"method": "ngram"}', "num_speculative_tokens"),
                                        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                                        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,'
                                         ' "prompt_lookup_max": 2}', "prompt_lookup_min"),
                                        ('{"method": "medusa", "num_speculative_tokens": 2}', "not implemented"),
                                        ('{"method": "eagle3", "num_speculative_tokens": 2}', "needs 'model'"),
                                        ('{"method": "mtp", ', "not valid JSON")])
def test_bad_configs_fail_at_load(tiny_dir, bad, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tiny_dir), speculative_config=bad)
