"""Batch-invariant mode: a token's logits are bitwise the same whatever shares its pass (one-token
decode, a verify of k + 1 tokens, a prefill, a prefill block resumed mid-prompt, other rows of a
batch), so greedy speculation reproduces plain decoding down to the logprobs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FIXED_K, check_logits_do_not_depend_on_the_pass, drafter_prompts

from pallas_kernels.batch_invariant import batch_invariant, row_tiled
from spec_jax import LLM, SamplingParams
from spec_jax.api.cli import build_parser
from spec_jax.writing.random_checkpoint import main as write_drafter

L = 128
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def invariant_llm(tiny_dir):
    return LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4, batch_buckets=[4],
               batch_invariant=True)


def test_a_tokens_logits_do_not_depend_on_its_pass(invariant_llm):
    """Positions 20..29 of one sequence: decoded one token at a time, verified four at a time
    (with a replay rollback committing two), prefilled whole beside two other rows, and resumed
    as a block from position 20: the same float32 logits, bit for bit."""
    check_logits_do_not_depend_on_the_pass(invariant_llm.model, others=2, cache_len=L)


@pytest.fixture(scope="module")
def drafters(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("invariant_drafters")
    for kind in ("dflash", "draft_model"):
        write_drafter([kind, str(d / kind), "--target", str(tiny_dir)])
    return d


@pytest.mark.parametrize("name, spec", [
    ("mtp", {"method": "mtp", "num_speculative_tokens": 3}),
    ("dflash", {"method": "dflash", "num_speculative_tokens": 15, **FIXED_K}),  # one verify width: a smaller program
    ("draft_model", {"method": "draft_model", "num_speculative_tokens": 2, **FIXED_K}),
])
def test_greedy_speculation_reproduces_plain_decoding_bitwise(invariant_llm, drafters, name, spec):
    """Tokens and their logprobs (the target's raw log-softmax, from the verify pass with
    speculation on) equal plain decoding's exactly, alone and in a mixed batch."""
    spec = {**spec, "model": str(drafters / name)} if name != "mtp" else spec
    prompts = drafter_prompts()
    params = [GREEDY, dataclasses.replace(GREEDY, speculative=False), GREEDY]

    def run(llm, params):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [[(t, x.logprob) for t, x in e.items()] for e in o.outputs[0].logprobs])
                for o in outs]

    plain = run(invariant_llm, GREEDY)
    speculating = invariant_llm.with_speculation(spec)
    assert run(speculating, GREEDY) == plain
    assert run(speculating, params) == plain
    assert speculating.metrics["num_draft_tokens"] > 0


def gdn_inputs(B, T):
    """Gated-delta-rule inputs of shapes the Pallas kernel takes (q, k, v, g, beta, state): the
    first B rows and T tokens of one random draw, so smaller passes hold the same values."""
    rng = np.random.default_rng(1)
    nk, nv, d, rows, tokens = 2, 4, 32, 3, 40
    q, k = (jnp.asarray(rng.normal(size=(rows, tokens, nk, d)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(rows, tokens, nv, d)), jnp.float32)
    g = -jnp.asarray(rng.uniform(size=(rows, tokens, nv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(size=(rows, tokens, nv)), jnp.float32)
    state = jnp.asarray(rng.normal(size=(rows, nv, d, d)), jnp.float32)
    return tuple(x[:B, :T] for x in (q, k, v, g, beta)) + (state[:B],)


def test_on_a_gpu_the_mode_runs_every_gdn_token_through_one_kernel_program(monkeypatch):
    """The GPU's dispatcher picks the Pallas kernel or XLA's unrolled steps by pass length, which
    round differently; in the mode every pass, of any length, goes through the kernel (here in
    interpret mode: on the CPU a real kernel launch would fail)."""
    from pallas_kernels import gdn_recurrent as gdn

    calls, kernel = [], gdn.gdn_recurrent_fixed_order

    def fixed_order(*args, **kwargs):
        calls.append(args[0].shape[1])
        return kernel(*args, **kwargs, interpret=True)

    monkeypatch.setattr(gdn, "gdn_recurrent_fixed_order", fixed_order)
    monkeypatch.setattr(gdn.jax, "default_backend", lambda: "gpu")
    with batch_invariant(8):
        for T in (1, 4, 40):
            o, final = gdn.gdn_recurrent(*gdn_inputs(2, T))
            want_o, want_final = gdn.gdn_recurrent_reference(*gdn_inputs(2, T))
            np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=1e-5)
    assert calls == [1, 4, 40]


def test_on_a_gpu_a_projection_hands_all_its_rows_to_the_fixed_order_kernel(monkeypatch):
    """The kernel tiles the rows itself, so the mode passes a projection's rows as they are (no
    padded tiles, no loop over them), and a token's output is the same bit for bit alone, in a
    verify-sized pass and in a pass of more rows than a tile (kernel in interpret mode)."""
    from models import layers

    shapes, kernel = [], layers.fixed_order_matmul_pallas

    def fixed_order(x, w, **kwargs):
        shapes.append(x.shape)
        return kernel(x, w, **kwargs, interpret=True)

    monkeypatch.setattr(layers, "fixed_order_matmul_pallas", fixed_order)
    monkeypatch.setattr(layers, "use_fixed_order_matmul", lambda: True)
    rng = np.random.default_rng(9)
    linear = layers.Linear(128, 64, bias=True)
    linear.weight[...] = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)
    linear.bias[...] = jnp.asarray(rng.standard_normal(64), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 70, 128)), jnp.float32)
    with batch_invariant(8):
        alone, verify, long = linear(x[:1, :1]), linear(x[:1, :4]), linear(x)
    assert shapes == [(1, 1, 128), (1, 4, 128), (2, 70, 128)]
    np.testing.assert_array_equal(np.asarray(verify[0, 0]), np.asarray(alone[0, 0]))
    np.testing.assert_array_equal(np.asarray(long[0, :4]), np.asarray(verify[0]))
    np.testing.assert_allclose(np.asarray(long), np.asarray(x @ linear.weight[...].T + linear.bias[...]),
                               rtol=1e-5, atol=1e-4)


def test_the_modes_gdn_kernel_gives_a_token_the_same_output_in_any_pass():
    """Token 0 of row 0: alone, first of a 4-token pass, beside two other rows and first of a
    40-token pass (two chunks): bit for bit; keep_states returns the state after each token,
    across chunks too."""
    from pallas_kernels.gdn_recurrent import gdn_recurrent_fixed_order, gdn_recurrent_reference

    run = lambda B, T, **kw: gdn_recurrent_fixed_order(*gdn_inputs(B, T), interpret=True, **kw)  # noqa: E731
    alone, _ = run(1, 1)
    in_verify, _, states = run(1, 4, keep_states=True)
    in_batch, _ = run(3, 1)
    in_prefill, final, long_states = run(1, 40, keep_states=True)
    for other in (in_verify, in_batch, in_prefill):
        np.testing.assert_array_equal(other[0, 0], alone[0, 0])
    _, _, want_states = gdn_recurrent_reference(*gdn_inputs(1, 4), keep_states=True)
    np.testing.assert_allclose(states, want_states, rtol=1e-5, atol=1e-5)
    want_o, want_final, want_states = gdn_recurrent_reference(*gdn_inputs(1, 40), keep_states=True)
    np.testing.assert_allclose(in_prefill, want_o, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(final, want_final, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(long_states, want_states, rtol=1e-4, atol=1e-4)


def test_the_modes_flash_attention_gives_a_query_the_same_output_in_any_pass():
    """The mode's attention on a GPU (the flash kernel, whole query blocks, one key range): a
    query's output is the same bit for bit alone, in a verify pass and beside another row, and
    close to XLA's masked softmax."""
    from models.layers import attend_masked
    from pallas_kernels import flash_attention as fa

    rng = np.random.default_rng(3)
    B, T, nq, nkv, d, S = 2, 5, 4, 2, 32, 96
    q = jnp.asarray(rng.normal(size=(B, T, nq, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, S, nkv, d)), jnp.float32) for _ in range(2))
    pos = jnp.asarray([[40, 41, 42, 43, 44], [70, 71, 72, 73, 74]], jnp.int32)
    run = lambda q, k, v, p: fa.flash_attention_fixed_order(q, k, v, p, interpret=True)  # noqa: E731
    alone = run(q[:1, :1], k[:1], v[:1], pos[:1, :1])
    in_verify = run(q[:1], k[:1], v[:1], pos[:1])
    beside = run(q[:, :1], k, v, pos[:, :1])
    np.testing.assert_array_equal(in_verify[0, 0], alone[0, 0])
    np.testing.assert_array_equal(beside[0, 0], alone[0, 0])
    want = attend_masked(q, k, v, jnp.arange(S)[None, None, :] <= pos[:, :, None])
    np.testing.assert_allclose(run(q, k, v, pos), want, rtol=2e-5, atol=2e-5)


def test_narrow_rows_come_more_to_a_tile_by_their_width_alone():
    """A tile holds `rows` rows of a full-width op and a power of two more of a narrow one (per-head
    norms), so a verify pass loops over few tiles; the count depends on the width, never on the
    pass. Projections keep `rows` (`fixed_rows`)."""
    from pallas_kernels.batch_invariant import tile_rows, tile_width

    with batch_invariant(8):
        assert tile_width() == 512  # the CPU
        assert [tile_rows(w) for w in (4096, 512, 384, 100, 64, 16)] == [8, 8, 8, 32, 64, 256]
        seen = []
        x = jnp.arange(3 * 5 * 16.0).reshape(3, 5, 16)
        row_tiled(lambda t: seen.append(t.shape) or t, x)
        row_tiled(lambda t: seen.append(t.shape) or t, x, fixed_rows=True)
    assert seen == [(256, 16), (8, 16)]


def test_row_tiled_is_the_plain_call_outside_the_mode():
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(row_tiled(lambda t: t * 2, x), x * 2)
    with batch_invariant(2):
        np.testing.assert_array_equal(jax.jit(lambda x: row_tiled(lambda t: t * 2, x))(x), x * 2)


def test_elementwise_ops_are_tiled_on_the_cpu_only(monkeypatch):
    """An op of each element alone runs on tiles in the mode on the CPU (whose exp and log code
    depends on the loop's shape) and on the rows as they are on the GPU."""
    from pallas_kernels.batch_invariant import elementwise

    seen = []
    x = jnp.arange(3 * 5 * 16.0).reshape(3, 5, 16)
    with batch_invariant(8):
        np.testing.assert_array_equal(elementwise(lambda t: seen.append(t.shape) or t * 2, x, lead=1), x * 2)
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        elementwise(lambda t: seen.append(t.shape) or t, x, lead=1)
    assert seen == [(32, 5, 16), (3, 5, 16)]


def test_bad_values_are_refused(tiny_dir):
    with pytest.raises(ValueError, match="batch_invariant='yes' must be True or False"):
        LLM(str(tiny_dir), dtype="float32", max_model_len=64, batch_invariant="yes")
    assert build_parser().parse_args(["serve", "--batch-invariant"]).batch_invariant is True


def test_with_prefix_caching_a_hit_and_speculation_change_nothing(tiny_dir):
    """The mode and prefix caching together: greedy MTP from a cache hit gives plain decoding's
    tokens and logprobs exactly."""
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=1, batch_invariant=True,
              enable_prefix_caching=True)
    prompt = np.random.default_rng(3).integers(0, 500, 150).tolist()

    def run(llm):
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [[(t, x.logprob) for t, x in e.items()] for e in out.logprobs]

    plain = run(llm)
    speculating = llm.with_speculation({"method": "mtp", "num_speculative_tokens": 3, **FIXED_K})
    assert run(speculating) == plain  # a miss: the store is the speculating engine's own
    assert run(speculating) == plain and speculating.engine.prefix_cache.hits == 128
