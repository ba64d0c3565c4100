"""Rejection sampling keeps the target's distribution: on a toy target/draft pair (chi-square,
fixed seeds, jitted), and end to end for the first token a speculative step emits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from spec_jax import LLM, SamplingParams
from spec_jax.engine.adaptive import StepTimes
from spec_jax.engine.sampling import RowSampling, TokenHistory, accept_drafts, process_logits, warp_logits

N, V, K = 40000, 6, 2
P_VALUE = 1e-3  # fixed seeds make each test deterministic; this only sizes the bound


def toy(temperature=1.0, top_k=0, top_p=1.0, seed=0):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(np.broadcast_to(rng.normal(size=(K + 1, V)) * 1.5, (N, K + 1, V)), jnp.float32)
    q = rng.dirichlet(np.ones(V), size=K)  # the draft's distribution at each position
    drafts = np.stack([rng.choice(V, size=N, p=q[i]) for i in range(K)], 1).astype(np.int32)
    params = RowSampling(jnp.full(N, temperature, jnp.float32), jnp.full(N, top_k, jnp.int32),
                         jnp.full(N, top_p, jnp.float32), jax.random.split(jax.random.key(seed), N))
    return logits, jnp.asarray(drafts), jnp.asarray(np.broadcast_to(q, (N, K, V)), jnp.float32), params


def target_p(logits, params):
    return np.asarray(jax.nn.softmax(warp_logits(logits[:1, 0], jax.tree.map(lambda x: x[:1], params)))[0])


def chisquare(counts, p):
    p = np.asarray(p, np.float64)
    return stats.chisquare(counts, counts.sum() * p / p.sum()).pvalue


def assert_distribution(samples, p):
    counts = np.bincount(np.asarray(samples), minlength=len(p))
    support = p > 0
    assert counts[~support].sum() == 0, "sampled a token the target excludes"
    assert chisquare(counts[support], p[support]) > P_VALUE


accept = jax.jit(accept_drafts, static_argnames="do_sample")


@pytest.mark.parametrize("with_q", [True, False], ids=["probabilistic-q", "one-hot-q"])
def test_first_emitted_token_follows_the_target(with_q):
    logits, drafts, q, params = toy()
    n_acc, emitted = accept(logits, drafts, jnp.full(N, K), q if with_q else None, params, jnp.zeros(N, jnp.int32),
                            do_sample=True)
    assert_distribution(emitted[:, 0], target_p(logits, params))
    assert 0 < float(jnp.mean(n_acc)) < K


def test_second_token_given_the_first_accepted_follows_the_target():
    logits, drafts, q, params = toy(seed=1)
    n_acc, emitted = accept(logits, drafts, jnp.full(N, K), q, params, jnp.zeros(N, jnp.int32), do_sample=True)
    first_ok = np.asarray(n_acc >= 1)
    # Rows whose first draft was accepted emitted d1 first; their second token follows p_2.
    d = np.asarray(drafts[:, 0])
    top = np.bincount(d[first_ok]).argmax()
    rows = first_ok & (d == top)
    p2 = np.asarray(jax.nn.softmax(logits[0, 1]))
    counts = np.bincount(np.asarray(emitted[rows, 1]), minlength=V)
    assert chisquare(counts, p2) > P_VALUE


def test_filters_shape_the_verified_distribution():
    logits, drafts, q, params = toy(temperature=0.7, top_k=4, top_p=0.9, seed=2)
    _, emitted = accept(logits, drafts, jnp.full(N, K), q, params, jnp.zeros(N, jnp.int32), do_sample=True)
    assert_distribution(emitted[:, 0], target_p(logits, params))


def test_min_p_logit_bias_and_min_tokens_shape_the_verified_distribution():
    """The processors vLLM applies before sampling (a bias with a banned token, min_tokens' ban on
    a stop id) and min_p after temperature: verified tokens follow the processed target."""
    logits, drafts, q, params = toy(temperature=0.8, seed=4)
    bias = jnp.broadcast_to(jnp.asarray([0.0, 2.0, -jnp.inf, 0.0, -1.0, 0.0], jnp.float32), (N, V))
    min_tokens = (jnp.full(N, 5, jnp.int32), jnp.full((N, 1), 3, jnp.int32))  # token 3 banned below position 5
    params = dataclasses.replace(params, min_p=jnp.full(N, 0.05, jnp.float32), bias=bias, min_tokens=min_tokens)
    positions = jnp.zeros(N, jnp.int32)
    processed = process_logits(logits, params, positions[:, None] + jnp.arange(K + 1)[None, :])
    _, emitted = accept(processed, drafts, jnp.full(N, K), q, params, positions, do_sample=True)
    p = target_p(processed, params)
    assert p[2] == p[3] == 0 and p[1] > 0
    assert_distribution(emitted[:, 0], p)


def test_penalties_see_the_drafts_before_each_position():
    """Presence, frequency and repetition penalties at verify position j count the drafts before
    j as generated tokens, as a plain run that had emitted them would: the first emitted token
    follows the penalized target, the second (after an accepted first draft d) the target
    penalized with d counted once more."""
    logits, drafts, q, params = toy(temperature=0.9, seed=5)
    rng = np.random.default_rng(5)
    counts = jnp.asarray(np.broadcast_to(rng.integers(0, 3, V), (N, V)), jnp.int32)
    in_prompt = jnp.asarray(np.broadcast_to(rng.random(V) < 0.5, (N, V)))
    history = TokenHistory(counts, in_prompt)
    penalties = tuple(jnp.full(N, x, jnp.float32) for x in (0.4, 0.3, 1.5))
    params = dataclasses.replace(params, penalties=penalties)
    positions = jnp.zeros(N, jnp.int32)
    processed = process_logits(logits, params, positions[:, None] + jnp.arange(K + 1)[None, :], history,
                               history.through(drafts))
    n_acc, emitted = accept(processed, drafts, jnp.full(N, K), q, params, positions, do_sample=True)
    one = lambda x: x[:1]  # noqa: E731
    first = process_logits(logits[:1, 0], jax.tree.map(one, params), positions[:1], jax.tree.map(one, history))
    assert_distribution(emitted[:, 0], target_p(first[:, None], params))
    d = int(np.bincount(np.asarray(drafts[:, 0])).argmax())
    rows = np.asarray((n_acc >= 1) & (drafts[:, 0] == d))
    after_d = TokenHistory(counts[:1].at[0, d].add(1), in_prompt[:1])
    second = process_logits(logits[:1, 1], jax.tree.map(one, params), positions[:1], after_d)
    counts2 = np.bincount(np.asarray(emitted[rows, 1]), minlength=V)
    assert chisquare(counts2, target_p(second[:, None], params)) > P_VALUE


def test_rows_without_drafts_sample_the_target():
    logits, drafts, q, params = toy(seed=3)
    n_acc, emitted = accept(logits, drafts, jnp.zeros(N, jnp.int32), q, params, jnp.zeros(N, jnp.int32),
                            do_sample=True)
    assert int(jnp.max(n_acc)) == 0
    assert_distribution(emitted[:, 0], target_p(logits, params))


def test_greedy_rows_take_the_longest_matching_prefix():
    logits, _, q, params = toy(seed=4)
    argmax = np.asarray(jnp.argmax(logits[0], -1))
    drafts = np.tile(argmax[:K], (N, 1))
    drafts[1, 1] = (argmax[1] + 1) % V  # row 1 rejects its second draft
    drafts[2, 0] = (argmax[0] + 1) % V  # row 2 rejects its first
    greedy = dataclasses.replace(params, temperature=jnp.zeros(N, jnp.float32))
    n_acc, emitted = accept(logits, jnp.asarray(drafts), jnp.full(N, K), None, greedy, jnp.zeros(N, jnp.int32),
                            do_sample=True)
    assert n_acc[:3].tolist() == [K, 1, 0]
    assert np.asarray(emitted[0]).tolist() == argmax.tolist()


N_REQUESTS = 2048  # per side of the two-sample test


# Thousands of requests run through these programs: XLA's full CPU optimisation (the suite's default
# is its cheapest, for programs that compile longer than they run) pays for itself here.
RUNS_LONGER_THAN_IT_COMPILES = {"xla_backend_optimization_level": 2}


PENALTIES = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.5)


def second_tokens(model_dir, spec, seeds, temperature=1.0, step_times=None, width=None):
    """The first two sampled tokens per seed, with penalties: the second token's distribution
    depends on the first through them (and on the prompt's 5 and 9 through the repetition penalty).
    A speculating run has room for k = 2 drafts after the first token, so its second token is the
    first of its first step, drawn by rejection sampling. step_times: an adaptive plan's cost model,
    given; width: the drafts its first step must then verify."""
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64, max_num_seqs=256, speculative_config=spec,
              compiler_options=RUNS_LONGER_THAN_IT_COMPILES)
    if step_times is not None:
        llm.engine.step_times[llm.engine.batch_bucket(len(seeds))] = StepTimes.measured(step_times)
    tokens = 2 if spec is None else 4
    params = [SamplingParams(max_tokens=tokens, temperature=temperature, seed=int(s), ignore_eos=True, **PENALTIES)
              for s in seeds]
    outs = llm.generate(prompt_token_ids=[[5, 9, 5, 9, 5]] * len(seeds), sampling_params=params, use_tqdm=False)
    if width is not None:  # every request's first step verified `width` drafts
        assert all(o.metrics["num_steps_per_verify_length"][width] >= 1 for o in outs)
    return np.asarray([o.outputs[0].token_ids[:2] for o in outs])


@pytest.fixture(scope="module")
def plain_two_tokens(shallow_echo_dir) -> np.ndarray:
    """The plain side of the two-sample test: the same draw for every speculative config, as it
    does not depend on one, so it is sampled once."""
    return second_tokens(shallow_echo_dir, None, range(N_REQUESTS))


# How the first speculative step verifies its k = 2 drafts: every draft at a fixed k, or under
# adaptive verification at the width (1: a prefix of the drafts) a given cost model makes best.
VERIFY = {"fixed k": (False, None, 2), "adaptive, 1 of 2": (True, [1.0, 1.0001, 100.0], 1),
          "adaptive, 2 of 2": (True, [1.0, 1.0, 1.0], 2)}


@pytest.mark.parametrize("draft_sample_method,draft_vocab_size,verify",
                         [("greedy", None, "fixed k"), ("probabilistic", None, "fixed k"),
                          ("probabilistic", 24, "fixed k"), ("probabilistic", None, "adaptive, 1 of 2"),
                          ("greedy", None, "adaptive, 2 of 2")])
def test_end_to_end_first_speculative_token_matches_plain(shallow_echo_dir, plain_two_tokens, draft_sample_method,
                                                          draft_vocab_size, verify):
    """Two tokens per request, sampled with penalties: the first comes from prefill, the second
    from one speculative step (or one plain step). Their joint distributions must agree
    (two-sample chi-square), also when the MTP head drafts from a reduced vocabulary (its q is zero
    past it) and when only a prefix of the drafts is verified."""
    adaptive, step_times, width = VERIFY[verify]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": draft_sample_method,
            "draft_vocab_size": draft_vocab_size, "enable_adaptive_verification": adaptive}
    plain = plain_two_tokens
    spec_on = second_tokens(shallow_echo_dir, spec, range(N_REQUESTS, 2 * N_REQUESTS), step_times=step_times,
                            width=width)
    def joint(t):
        return t[:, 0] * 64 + t[:, 1]
    keys = np.union1d(joint(plain), joint(spec_on))
    table = np.stack([[np.sum(joint(t) == key) for key in keys] for t in (plain, spec_on)])
    table = table[:, table.sum(0) >= 10]  # chi-square needs populated cells
    assert stats.chi2_contingency(table).pvalue > P_VALUE
