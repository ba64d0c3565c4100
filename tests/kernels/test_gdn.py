"""The gated delta rule: chunked (prefill) against recurrent (decode), float32."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gdn_inputs, relative_error

from pallas_kernels.gdn_chunked import gdn_chunked
from pallas_kernels.gdn_recurrent import gdn_recurrent


@pytest.mark.parametrize("T", [63, 64, 65, 130])
def test_chunked_equals_recurrent(T):
    q, k, v, g, beta, s0 = gdn_inputs(T)
    o_r, s_r = gdn_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gdn_chunked(q, k, v, g, beta, s0)
    assert relative_error(o_c, o_r) < 1e-5
    assert relative_error(s_c, s_r) < 1e-5


@pytest.mark.parametrize("gate_scale", [1e-4, 30.0])
def test_gates_near_zero_and_very_negative(gate_scale):
    q, k, v, g, beta, s0 = gdn_inputs(70, gate_scale=gate_scale, seed=1)
    o_r, s_r = gdn_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gdn_chunked(q, k, v, g, beta, s0)
    assert np.isfinite(np.asarray(o_c)).all()
    assert relative_error(o_c, o_r) < 1e-5 and relative_error(s_c, s_r) < 1e-5


def test_padding_tokens_leave_the_state_unchanged():
    q, k, v, g, beta, s0 = gdn_inputs(66, seed=2)
    pad = jnp.arange(66)[None, :, None] >= 40
    g, beta = jnp.where(pad, 0.0, g), jnp.where(pad, 0.0, beta)
    _, s_full = gdn_chunked(q, k, v, g, beta, s0)
    _, s_prefix = gdn_recurrent(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], s0)
    assert relative_error(s_full, s_prefix) < 1e-5


def test_recurrent_keeps_every_intermediate_state():
    q, k, v, g, beta, s0 = gdn_inputs(5, seed=3)
    _, final, states = gdn_recurrent(q, k, v, g, beta, s0, keep_states=True)
    for t in range(5):
        _, s_t = gdn_recurrent(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], s0)
        np.testing.assert_allclose(states[:, t], s_t, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(states[:, -1], final)


def test_value_heads_read_their_own_key_head():
    """Value head j reads key head j // (nv/nk): permuting key heads must permute outputs by group."""
    q, k, v, g, beta, s0 = gdn_inputs(8, nk=2, nv=4, seed=4)
    o, _ = gdn_recurrent(q, k, v, g, beta, s0)
    def swap_k(x):
        return x[:, :, ::-1]
    def swap_v(x):
        return jnp.concatenate([x[:, :, 2:], x[:, :, :2]], axis=2)
    o_sw, _ = gdn_recurrent(swap_k(q), swap_k(k), swap_v(v), swap_v(g), swap_v(beta),
                            jnp.concatenate([s0[:, 2:], s0[:, :2]], axis=1))
    np.testing.assert_allclose(swap_v(o), o_sw, rtol=1e-6, atol=1e-6)
