"""The fused GDN decode kernel in interpret mode against the layer's unfused path
(`GatedDeltaNet.delta_rule`: convolution, gates and recurrence as separate ops), float32, with
every parameter random, grouped value heads, several value blocks and a row that is not valid; the
projections joined as one matmul gives them or as separate ones, and the next conv window."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import TINY, relative_error

from models.gated_deltanet import GatedDeltaNet, conv_window
from pallas_kernels.gdn_decode import BLOCK_V, gdn_decode_pallas, use_decode_kernel

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")


def random_layer(cfg, seed: int) -> GatedDeltaNet:
    layer = GatedDeltaNet(cfg)
    rng = np.random.default_rng(seed)
    for _, param in nnx.iter_graph(layer):
        if isinstance(param, nnx.Param):
            param[...] = jnp.asarray(rng.normal(scale=0.5, size=param[...].shape), jnp.float32)
    return layer


@pytest.mark.parametrize("nk, nv, dk, dv, joined", [(2, 4, 16, 32, True), (1, 3, 32, 64, False),
                                                    (2, 2, 16, 96, True)])
def test_fused_decode_matches_the_unfused_layer(nk, nv, dk, dv, joined):
    """joined: the projections as one matmul gives them, [qkv | z | b | a | padding]; else [qkv | b | a]."""
    cfg = dataclasses.replace(TINY, linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                              linear_value_head_dim=dv)
    layer = random_layer(cfg, seed=nv * dv)
    B, K, C = 3, cfg.linear_conv_kernel_dim, cfg.conv_dim
    rng = np.random.default_rng(1)
    conv = jnp.asarray(rng.normal(size=(3, B, K - 1, C)), jnp.float32)  # 3 repeats; the layer is repeat 1
    mixed = jnp.asarray(rng.normal(size=(B, 1, C)), jnp.float32)
    b, a = (jnp.asarray(rng.normal(scale=2.0, size=(B, 1, nv)), jnp.float32) for _ in range(2))
    valid = jnp.array([[True], [False], [True]])
    states = jnp.asarray(rng.normal(size=(3, B, nv, dk, dv)), jnp.float32)
    state = states[1]

    seq = jnp.concatenate([conv[1], mixed], axis=1)
    o_ref, s_ref, _ = layer.delta_rule(seq, b, a, valid, states, 1, None)
    s_ref = s_ref[1]
    if joined:
        z, pad = (jnp.asarray(rng.normal(size=(B, 1, n)), jnp.float32) for n in (nv * dv, 5))
        proj, gates_at = jnp.concatenate([mixed, z, b, a, pad], -1)[:, 0], (C + nv * dv, C + nv * dv + nv)
    else:
        proj, gates_at = jnp.concatenate([mixed, b, a], -1)[:, 0], (C, C + nv)
    o, s, window = gdn_decode_pallas(proj, conv, layer.conv1d[...][:, 0, :], layer.A_log[...], layer.dt_bias[...],
                                     valid[:, 0], states, jnp.int32(1), num_k_heads=nk, gates_at=gates_at,
                                     interpret=True)
    assert relative_error(o, o_ref[:, 0]) < 1e-5
    assert relative_error(s[1], s_ref) < 1e-5
    np.testing.assert_array_equal(s[1, 1], state[1])  # a row that is not valid keeps its state
    np.testing.assert_array_equal(s[0], states[0])  # the other repeats' states are not touched
    np.testing.assert_array_equal(s[2], states[2])
    np.testing.assert_array_equal(window, conv_window(seq, valid[:, 0].astype(jnp.int32), K))
    np.testing.assert_array_equal(window[1], conv[1, 1])  # ... nor its window


def test_the_kernel_is_chosen_only_for_one_token_on_a_gpu():
    state = jnp.zeros((1, 4, 16, 2 * BLOCK_V))
    assert not use_decode_kernel(1, 4, state, 1)  # this machine has no GPU: the unfused path
    if jax.default_backend() == "gpu":
        assert use_decode_kernel(1, 4, state, 1) and not use_decode_kernel(2, 4, state, 1)
