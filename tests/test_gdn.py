"""The gated delta rule: chunked (prefill) against recurrent (decode), float32."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn_chunked import gdn_chunked
from pallas_kernels.gdn_recurrent import gdn_recurrent


def random_inputs(T, *, B=2, nk=2, nv=6, dk=16, dv=24, seed=0, gate_scale=2.0):
    r = np.random.default_rng(seed)
    def f(*s):
        return jnp.asarray(r.normal(size=s), jnp.float32)
    g = -jnp.asarray(r.uniform(0, gate_scale, size=(B, T, nv)), jnp.float32)
    beta = jnp.asarray(r.uniform(size=(B, T, nv)), jnp.float32)
    return f(B, T, nk, dk), f(B, T, nk, dk), f(B, T, nv, dv), g, beta, f(B, nv, dk, dv)


def rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("T", [63, 64, 65, 130])
def test_chunked_equals_recurrent(T):
    q, k, v, g, beta, s0 = random_inputs(T)
    o_r, s_r = gdn_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gdn_chunked(q, k, v, g, beta, s0)
    assert rel(o_c, o_r) < 1e-5
    assert rel(s_c, s_r) < 1e-5


@pytest.mark.parametrize("gate_scale", [1e-4, 30.0])
def test_gates_near_zero_and_very_negative(gate_scale):
    q, k, v, g, beta, s0 = random_inputs(70, gate_scale=gate_scale, seed=1)
    o_r, s_r = gdn_recurrent(q, k, v, g, beta, s0)
    o_c, s_c = gdn_chunked(q, k, v, g, beta, s0)
    assert np.isfinite(np.asarray(o_c)).all()
    assert rel(o_c, o_r) < 1e-5 and rel(s_c, s_r) < 1e-5


def test_padding_tokens_leave_the_state_unchanged():
    q, k, v, g, beta, s0 = random_inputs(66, seed=2)
    pad = jnp.arange(66)[None, :, None] >= 40
    g, beta = jnp.where(pad, 0.0, g), jnp.where(pad, 0.0, beta)
    _, s_full = gdn_chunked(q, k, v, g, beta, s0)
    _, s_prefix = gdn_recurrent(q[:, :40], k[:, :40], v[:, :40], g[:, :40], beta[:, :40], s0)
    assert rel(s_full, s_prefix) < 1e-5


def test_recurrent_keeps_every_intermediate_state():
    q, k, v, g, beta, s0 = random_inputs(5, seed=3)
    _, final, states = gdn_recurrent(q, k, v, g, beta, s0, keep_states=True)
    for t in range(5):
        _, s_t = gdn_recurrent(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], s0)
        np.testing.assert_allclose(states[:, t], s_t, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(states[:, -1], final)


def test_value_heads_read_their_own_key_head():
    """Value head j reads key head j // (nv/nk): permuting key heads must permute outputs by group."""
    q, k, v, g, beta, s0 = random_inputs(8, nk=2, nv=4, seed=4)
    o, _ = gdn_recurrent(q, k, v, g, beta, s0)
    def swap_k(x):
        return x[:, :, ::-1]
    def swap_v(x):
        return jnp.concatenate([x[:, :, 2:], x[:, :, :2]], axis=2)
    o_sw, _ = gdn_recurrent(swap_k(q), swap_k(k), swap_v(v), swap_v(g), swap_v(beta),
                            jnp.concatenate([s0[:, 2:], s0[:, :2]], axis=1))
    np.testing.assert_allclose(swap_v(o), o_sw, rtol=1e-6, atol=1e-6)
