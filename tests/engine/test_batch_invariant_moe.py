"""Batch-invariant mode on a target that routes experts: a token's logits are bitwise the same
whatever shares its pass (alone, beside other rows, in a verify of k + 1 tokens, in a prefill), in
the rolled layout and in the decode layout (shared expert folded in as routed expert E), so greedy
MTP and n-gram speculation reproduce plain decoding down to the logprobs; and the pieces of the
MoE block the mode changes (routing on fixed tiles, per-pair experts, the GPU's per-pair kernels
in interpret mode) give a token the same bits in any pass."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FIXED_K, TINY, check_logits_do_not_depend_on_the_pass, relative_error

from bench.oracle import KnownSequences, oracle_config
from bench.scale import always_drafting
from pallas_kernels.expert_route import route
from pallas_kernels.batch_invariant import batch_invariant
from pallas_kernels.expert_matmul import GEMV_MAX_PAIRS, expert_swiglu, expert_swiglu_invariant, expert_swiglu_reference
from spec_jax import LLM, SamplingParams
from spec_jax.writing.random_checkpoint import write_checkpoint

L = 128
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
# 8 experts, 2 a token; a shared expert of the routed experts' size folds into the decode layout's
# expert stacks, one of another size stays an MLP of its own.
MOE = dataclasses.replace(TINY, num_hidden_layers=4, layer_types=(), num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=16, shared_expert_intermediate_size=16)
LAYOUTS = {"rolled": dataclasses.replace(MOE, shared_expert_intermediate_size=24), "decode": MOE}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def invariant_moe(request, tmp_path_factory):
    layout = request.param
    d = write_checkpoint(tmp_path_factory.mktemp(f"moe_{layout}"), LAYOUTS[layout], seed=2)
    return LLM(model=str(d), dtype="float32", max_model_len=L, max_num_seqs=4, batch_buckets=[4],
               batch_invariant=True, layout=layout)


def test_the_shared_expert_is_folded_in_the_decode_layout_only(invariant_moe):
    model = invariant_moe.model
    mlp = model.layers[0].mlp if model.groups is None else model.groups[0][0].mlp
    folded = invariant_moe.engine.config.layout == "decode"
    assert (mlp.shared_expert is None) == folded
    assert mlp.experts.gate_up_proj.shape[-3] == MOE.num_experts + folded


def test_a_tokens_logits_do_not_depend_on_its_pass(invariant_moe):
    """Positions 20..29 of one sequence: decoded one token at a time, verified four at a time
    (a replay rollback committing two), prefilled whole beside three other rows, and resumed as a
    block from position 20: the same float32 logits, bit for bit."""
    check_logits_do_not_depend_on_the_pass(invariant_moe.model, others=3, cache_len=L)


def moe_prompts() -> list[list[int]]:
    """Three prompts of 6, 17 and 33 tokens, the last two repeating a phrase (n-gram drafts)."""
    rng = np.random.default_rng(4)
    phrase = rng.integers(0, 500, 5).tolist()
    return [rng.integers(0, 500, 6).tolist(), phrase * 3 + [7, 8], rng.integers(0, 500, 8).tolist() + phrase * 5]


@pytest.fixture(scope="module")
def plain_outputs(invariant_moe):
    """Each prompt decoded alone without speculation: its generate output."""
    return [invariant_moe.generate(prompt_token_ids=[p], sampling_params=GREEDY, use_tqdm=False)[0]
            for p in moe_prompts()]


SPECS = {"mtp": {"method": "mtp", "num_speculative_tokens": 3, **FIXED_K},
         "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   **FIXED_K},
         "oracle": None}  # the plain run's own continuation, a third of the drafts corrupted


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_speculation_reproduces_plain_decoding_bitwise(invariant_moe, plain_outputs, name):
    """Tokens and their logprobs equal plain decoding's exactly, at batch 1 and in a batch of 3
    whose middle row opts out of speculation: every step verifies k + 1 tokens. The random model
    refuses nearly every MTP and n-gram draft; the oracle's are accepted in part, so verify passes
    commit some of their tokens."""
    prompts = moe_prompts()
    mixed = [GREEDY, dataclasses.replace(GREEDY, speculative=False), GREEDY]
    spec = SPECS[name] or oracle_config(KnownSequences.of_outputs(plain_outputs), 3, MOE.vocab_size, 0.3,
                                          **FIXED_K)
    if name == "ngram":  # a random model never repeats itself: where the lookup finds nothing, copies
        spec = {**spec, "proposer": always_drafting(spec)}

    def run(llm, prompts, params):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [tokens_and_logprobs(o) for o in outs]

    plain = [tokens_and_logprobs(o) for o in plain_outputs]
    speculating = invariant_moe.with_speculation(spec)
    assert [run(speculating, [p], GREEDY)[0] for p in prompts] == plain
    assert run(speculating, prompts, mixed) == plain
    assert speculating.metrics["num_draft_tokens"] > 0
    if name == "oracle":
        assert 0 < speculating.metrics["num_accepted_tokens"] < speculating.metrics["num_draft_tokens"]


def tokens_and_logprobs(output) -> tuple[list[int], list[list[tuple[int, float]]]]:
    out = output.outputs[0]
    return out.token_ids, [[(t, x.logprob) for t, x in e.items()] for e in out.logprobs]


def random_experts(N: int, k: int, *, E=6, H=64, inner=16, seed=0):
    """Tokens, expert stacks, and routing with experts repeated across tokens."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(N, H)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(E, 2 * inner, H)) / np.sqrt(H), jnp.float32)
    down = jnp.asarray(rng.normal(size=(E, H, inner)) / np.sqrt(inner), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
    weights = jnp.asarray(rng.dirichlet(np.ones(k), size=N), jnp.float32)
    return x, gate_up, down, ids, weights


def assert_token_zero_is_the_same_in_every_pass(experts, N: int, k: int):
    """Token 0's output alone, beside 3 tokens (a verify's pairs) and beside N - 1 (more pairs than
    GEMV_MAX_PAIRS: a prefill's), bit for bit; every pass close to the gathering reference."""
    x, gate_up, down, ids, weights = random_experts(N, k)
    outs = {}
    for n in (1, 4, N):
        args = (x[:n], gate_up, down, ids[:n], weights[:n])
        outs[n] = np.asarray(experts(*args))
        assert relative_error(outs[n], expert_swiglu_reference(*args)) < 1e-5
    np.testing.assert_array_equal(outs[4][0], outs[1][0])
    np.testing.assert_array_equal(outs[N][0], outs[1][0])
    np.testing.assert_array_equal(outs[N][:4], outs[4])


def test_the_modes_gpu_expert_kernels_give_a_token_the_same_output_in_any_pass():
    """The per-pair kernels in interpret mode, fed in pair order up to GEMV_MAX_PAIRS pairs and in
    expert order past it."""
    N, k = 70, 2
    assert N * k > GEMV_MAX_PAIRS >= 4 * k
    assert_token_zero_is_the_same_in_every_pass(lambda *a: expert_swiglu_invariant(*a, interpret=True), N, k)


def test_the_modes_cpu_experts_give_a_token_the_same_output_in_any_pass():
    with batch_invariant(8):
        assert_token_zero_is_the_same_in_every_pass(jax.jit(expert_swiglu), 70, 2)


def test_a_gpu_refuses_expert_sizes_its_per_pair_kernel_cannot_take():
    x, gate_up, down, ids, weights = random_experts(2, 2, H=48)
    with pytest.raises(ValueError, match="per-pair kernel.*hidden 48, inner 16"):
        expert_swiglu_invariant(x, gate_up, down, ids, weights, interpret=True)


def test_routing_breaks_ties_and_weighs_a_token_the_same_in_any_pass():
    """Logits with exact ties between experts: a token's experts and weights alone, in 3 rows and
    in 40 (five tiles) are the same bits, ties going to the lower expert id as outside the mode."""
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.integers(-3, 3, (40, 8)) / 2, jnp.float32)  # 6 values over 8 experts
    with batch_invariant(8):
        routed = {n: jax.jit(route, static_argnums=(1, 2, 3))(logits[:n], 3, True, 8) for n in (1, 3, 40)}
    for n in (3, 40):
        for got, alone in zip(routed[n], routed[1]):
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(alone[0]))
    weights, ids = routed[40]
    want_weights, want_ids = route(logits, 3, True, 8)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6)
    np.testing.assert_array_equal(ids[0], np.argsort(-np.asarray(logits[0]), stable=True)[:3])


@pytest.mark.parametrize("fold", [False, True], ids=["shared MLP", "shared expert folded"])
def test_on_a_gpu_the_moe_block_gives_a_token_the_same_output_in_any_pass(monkeypatch, fold):
    """The whole MoE block as the mode runs it on a GPU (kernels in interpret mode): the router
    through the fixed-order matmul, the routing kernel, the per-pair expert kernels, the
    shared expert as an MLP or folded in as expert E. Token 0 alone, beside 3 tokens and beside
    69 (more pairs than GEMV_MAX_PAIRS): the same bits, and close to the default path."""
    from models import layers
    from models.moe import SparseMoE
    from pallas_kernels import expert_matmul, expert_route

    rng = np.random.default_rng(6)
    moe = SparseMoE(MOE)
    draw = lambda w: jnp.asarray(rng.normal(size=w.shape) / np.sqrt(w.shape[-1]), jnp.float32)  # noqa: E731
    nnx.update(moe, jax.tree.map(draw, nnx.state(moe, nnx.Param)))
    x = jnp.asarray(rng.normal(size=(70, MOE.hidden_size)), jnp.float32)
    want = moe(x)  # the default path, before the GPU is pretended
    if fold:
        moe.join_router_and_shared_expert()
        assert moe.shared_expert is None
    matmul, pairs, calls = layers.fixed_order_matmul_pallas, expert_matmul._pair_outputs_pallas, []

    def fixed_order(x, w, **kw):
        calls.append(("matmul", w.shape[0]))
        return matmul(x, w, **kw, interpret=True)

    def per_pair(x, *a, **kw):
        calls.append(("pairs", x.shape[0]))
        return pairs(x, *a, **{**kw, "interpret": True})

    monkeypatch.setattr(layers, "fixed_order_matmul_pallas", fixed_order)
    monkeypatch.setattr(expert_matmul, "_pair_outputs_pallas", per_pair)
    routing = expert_route.route_pallas
    monkeypatch.setattr(expert_route, "route_pallas", lambda *a: routing(*a, interpret=True))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with batch_invariant(8):
        outs = {n: np.asarray(moe(x[:n])) for n in (1, 4, 70)}
    k = MOE.num_experts_per_tok + fold
    assert 70 * k > GEMV_MAX_PAIRS
    assert [n for kind, n in calls if kind == "pairs"] == [1 * k, 4 * k, 70 * k]
    assert len([c for c in calls if c[0] == "matmul"]) == 3 * (1 if fold else 5)  # router and shared gate (+ MLP)
    np.testing.assert_array_equal(outs[4][0], outs[1][0])
    np.testing.assert_array_equal(outs[70][:4], outs[4])
    assert relative_error(outs[70], want) < 1e-5
