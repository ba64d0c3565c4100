"""The GDN state cached in 16 bits (`mamba_ssm_cache_dtype`): every op reads the state in its
cache's dtype, computes in float32 and rounds the state it carries after each token, so a verify
pass gives, token for token, what decoding those tokens one at a time gives; the kernels (interpret
mode) agree with the reference; and the result stays near the float32 state's."""

import dataclasses
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY, gdn_inputs, relative_error

from models.gated_deltanet import GatedDeltaNet
from models.qwen3_5 import Qwen3_5Config, init_cache
from pallas_kernels.gdn_chunked import gdn_chunked_reference
from pallas_kernels.gdn_decode import gdn_decode_pallas
from pallas_kernels.gdn_recurrent import gdn_recurrent_pallas, gdn_recurrent_reference

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")

DTYPES = [jnp.bfloat16, jnp.float16]


def inputs(T, dtype, **kw):
    """`helpers.gdn_inputs` at power-of-two head sizes, the state in `dtype`."""
    *rest, state = gdn_inputs(T, **{"nv": 4, "dk": 32, "dv": 64, **kw})
    return (*rest, state.astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_verify_pass_equals_decoding_its_tokens_one_at_a_time(dtype):
    q, k, v, g, beta, s0 = inputs(5, dtype, seed=1)
    o, final, states = gdn_recurrent_reference(q, k, v, g, beta, s0, keep_states=True)
    s = s0
    for t in range(5):
        o_t, s = gdn_recurrent_reference(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                         beta[:, t:t + 1], s)
        np.testing.assert_array_equal(o[:, t], o_t[:, 0])
        np.testing.assert_array_equal(states[:, t], s)  # what a rollback to t + 1 tokens keeps
    assert final.dtype == states.dtype == dtype
    np.testing.assert_array_equal(final, s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_state_is_rounded_after_every_token_not_only_at_the_end(dtype):
    """Without the per-token rounding the pass would hold float32 across its tokens: its outputs
    past the first would differ from the stepwise ones this test equals."""
    q, k, v, g, beta, s0 = inputs(4, dtype, seed=2)
    o, _ = gdn_recurrent_reference(q, k, v, g, beta, s0)
    o_carried_in_f32, _ = gdn_recurrent_reference(q, k, v, g, beta, s0.astype(jnp.float32))
    np.testing.assert_array_equal(o[:, 0], o_carried_in_f32[:, 0])  # the first token reads s0 alike
    assert not np.array_equal(o[:, 1:], o_carried_in_f32[:, 1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 4])
def test_recurrent_kernel_matches_the_reference(dtype, T):
    args = inputs(T, dtype, seed=T)
    o, s, states = gdn_recurrent_pallas(*args, keep_states=True, interpret=True)
    o_ref, s_ref, states_ref = gdn_recurrent_reference(*args, keep_states=True)
    assert s.dtype == states.dtype == dtype
    assert relative_error(o, o_ref) < 1e-5
    # One 16-bit rounding apart at most where float32 sums ordered differently straddle a tie.
    assert relative_error(s, s_ref) < 1e-3 and relative_error(states, states_ref) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_verify_kernel_reads_a_16_bit_stack_in_place(dtype):
    q, k, v, g, beta, s0 = inputs(4, dtype, seed=5)
    stacked = jnp.stack([s0 * 2, s0, -s0])
    o, final = gdn_recurrent_pallas(q, k, v, g, beta, stacked, jnp.int32(1), final_state=False, interpret=True)
    assert final is None and relative_error(o, gdn_recurrent_reference(q, k, v, g, beta, s0)[0]) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_kernel_matches_the_reference_in_16_bits(dtype):
    cfg = dataclasses.replace(TINY, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                              linear_value_head_dim=32)
    layer = GatedDeltaNet(cfg)
    rng = np.random.default_rng(0)
    for _, param in nnx.iter_graph(layer):
        if isinstance(param, nnx.Param):
            param[...] = jnp.asarray(rng.normal(scale=0.5, size=param[...].shape), jnp.float32)
    B, K, nv, dk, dv = 3, cfg.linear_conv_kernel_dim, 4, 16, 32
    C = cfg.conv_dim
    seq = jnp.asarray(rng.normal(size=(B, K, C)), jnp.float32)
    b, a = (jnp.asarray(rng.normal(scale=2.0, size=(B, 1, nv)), jnp.float32) for _ in range(2))
    valid = jnp.array([[True], [False], [True]])
    states = jnp.asarray(rng.normal(size=(2, B, nv, dk, dv)), dtype)
    o_ref, s_ref, _ = layer.delta_rule(seq, b, a, valid, states, 1, None)
    proj = jnp.concatenate([seq[:, -1], b[:, 0], a[:, 0]], axis=-1)
    conv = jnp.stack([jnp.zeros_like(seq[:, 1:]), seq[:, :-1]])  # the layer is repeat 1
    o, s, _ = gdn_decode_pallas(proj, conv, layer.conv1d[...][:, 0, :], layer.A_log[...], layer.dt_bias[...],
                                valid[:, 0], states, jnp.int32(1), num_k_heads=2, gates_at=(C, C + nv),
                                interpret=True)
    assert s.dtype == s_ref.dtype == dtype
    assert relative_error(o, o_ref[:, 0]) < 1e-5 and relative_error(s[1], s_ref[1]) < 1e-3
    np.testing.assert_array_equal(s[1, 1], states[1, 1])  # a row that is not valid keeps its state
    np.testing.assert_array_equal(s[0], states[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_prefill_returns_the_state_in_its_dtype_near_float32s(dtype):
    q, k, v, g, beta, s0 = inputs(80, dtype, seed=3, gate_scale=0.3)
    o, final = gdn_chunked_reference(q, k, v, g, beta, s0)
    o32, final32 = gdn_chunked_reference(q, k, v, g, beta, s0.astype(jnp.float32))
    assert final.dtype == dtype
    np.testing.assert_array_equal(o, o32)  # the walk carries float32 across chunks; only the end is rounded
    np.testing.assert_array_equal(final, final32.astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_16_bit_state_stays_near_the_float32_one_over_many_tokens(dtype):
    q, k, v, g, beta, s0 = inputs(48, jnp.float32, seed=4, gate_scale=0.3)
    o32, s32 = gdn_recurrent_reference(q, k, v, g, beta, s0)
    o16, s16 = gdn_recurrent_reference(q, k, v, g, beta, s0.astype(dtype))
    assert relative_error(o16, o32) < 2e-2 and relative_error(s16, s32) < 2e-2


def test_caches_hold_the_configs_state_dtype_and_bad_names_are_refused():
    cfg = dataclasses.replace(TINY, mamba_ssm_dtype="bfloat16")
    gdn = next(c for c in init_cache(cfg, 2, 64, jnp.float32) if hasattr(c, "state"))
    assert gdn.state.dtype == jnp.bfloat16 and gdn.conv.dtype == jnp.float32
    with pytest.raises(ValueError, match=r"mamba_ssm_dtype='int8'; expected one of float32, bfloat16, float16"):
        Qwen3_5Config(**{**dataclasses.asdict(TINY), "mamba_ssm_dtype": "int8"})
    assert jnp.dtype(TINY.mamba_ssm_dtype) == jnp.float32
