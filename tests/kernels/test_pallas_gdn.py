"""The Pallas GDN recurrent kernel in interpret mode against the pure-JAX reference (float32,
~1e-5 relative), at decode and verify lengths, with grouped value heads and extreme gates."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gdn_inputs, relative_error

from pallas_kernels.gdn_recurrent import gdn_recurrent_pallas, gdn_recurrent_reference

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")


def inputs(T, **kw):
    """`helpers.gdn_inputs` at the kernel's power-of-two head sizes by default."""
    return gdn_inputs(T, **{"nv": 4, "dk": 32, "dv": 64, **kw})


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 17])
def test_kernel_matches_reference_with_every_state_kept(T):
    args = inputs(T, seed=T)
    o, s, states = gdn_recurrent_pallas(*args, keep_states=True, interpret=True)
    o_ref, s_ref, states_ref = gdn_recurrent_reference(*args, keep_states=True)
    assert relative_error(o, o_ref) < 1e-5 and relative_error(s, s_ref) < 1e-5
    for t in range(T):  # the state after each token: what rollback to t + 1 tokens selects
        assert relative_error(states[:, t], states_ref[:, t]) < 1e-5


@pytest.mark.parametrize("T", [2, 4])
def test_a_verify_reads_its_repeat_of_the_stacked_states_in_place(T):
    q, k, v, g, beta, s0 = inputs(T, seed=11)
    stacked = jnp.stack([s0 * 0.5, s0, s0 * -2.0])  # [G = 3, B, nv, dk, dv]; the pass runs from repeat 1
    o, final = gdn_recurrent_pallas(q, k, v, g, beta, stacked, jnp.int32(1), final_state=False, interpret=True)
    o_ref, _ = gdn_recurrent_reference(q, k, v, g, beta, s0)
    assert final is None and relative_error(o, o_ref) < 1e-5
    with pytest.raises(ValueError, match="only when the final state is discarded"):
        gdn_recurrent_pallas(q, k, v, g, beta, stacked, jnp.int32(1), interpret=True)


@pytest.mark.parametrize("gate_scale", [1e-4, 40.0])
def test_extreme_gates(gate_scale):
    args = inputs(4, gate_scale=gate_scale, seed=7)
    o, s = gdn_recurrent_pallas(*args, interpret=True)
    o_ref, s_ref = gdn_recurrent_reference(*args)
    assert np.isfinite(np.asarray(o)).all()
    assert relative_error(o, o_ref) < 1e-5 and relative_error(s, s_ref) < 1e-5


def test_three_value_heads_per_key_head_and_bf16_inputs():
    q, k, v, g, beta, s0 = inputs(4, nk=2, nv=6, seed=3)
    def bf(x):
        return x.astype(jnp.bfloat16)
    o, s = gdn_recurrent_pallas(bf(q), bf(k), bf(v), g, beta, s0, interpret=True)
    o_ref, s_ref = gdn_recurrent_reference(bf(q), bf(k), bf(v), g, beta, s0)
    assert relative_error(o, o_ref) < 1e-5 and relative_error(s, s_ref) < 1e-5


# Tolerances: float32 operands agree to rounding; bfloat16 operands (the GPU's fast path, as in
# flash-linear-attention) round every dot input and stored intermediate, 2e-3 to 6e-3 measured.
CHUNKED_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@pytest.mark.parametrize("operands", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("T", [63, 64, 65, 130])
def test_chunked_kernel_matches_reference_across_chunk_boundaries(T, operands):
    from pallas_kernels.gdn_chunked import gdn_chunked_pallas, gdn_chunked_reference

    args = inputs(T, B=1, nk=1, nv=2, dk=16, dv=32, seed=T)
    o, s = gdn_chunked_pallas(*args, operands=operands, interpret=True)
    o_ref, s_ref = gdn_chunked_reference(*args)
    assert relative_error(o, o_ref) < CHUNKED_TOL[operands] and relative_error(s, s_ref) < CHUNKED_TOL[operands]


@pytest.mark.parametrize("operands", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gate_scale", [1e-4, 40.0])
def test_chunked_kernel_extreme_gates_grouped_heads_and_split_value_columns(gate_scale, operands):
    """Three value heads per key head, the state walked in two blocks of value columns."""
    from pallas_kernels.gdn_chunked import gdn_chunked_pallas, gdn_chunked_reference

    args = inputs(100, B=2, nk=2, nv=6, dk=32, dv=32, gate_scale=gate_scale, seed=5)
    o, s = gdn_chunked_pallas(*args, operands=operands, block_v=16, interpret=True)
    o_ref, s_ref = gdn_chunked_reference(*args)
    assert np.isfinite(np.asarray(o)).all()
    assert relative_error(o, o_ref) < CHUNKED_TOL[operands] and relative_error(s, s_ref) < CHUNKED_TOL[operands]


def test_chunked_kernel_ragged_rows_leave_padding_out_of_the_state():
    from pallas_kernels.gdn_chunked import gdn_chunked_pallas
    from pallas_kernels.gdn_recurrent import gdn_recurrent_reference

    q, k, v, g, beta, s0 = inputs(70, B=2, nk=1, nv=2, dk=16, dv=32, seed=9)
    lengths = jnp.asarray([70, 37])
    valid = (jnp.arange(70)[None, :] < lengths[:, None])[..., None]
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
    _, s = gdn_chunked_pallas(q, k, v, g, beta, s0, interpret=True)
    _, s_short = gdn_recurrent_reference(q[1:, :37], k[1:, :37], v[1:, :37], g[1:, :37], beta[1:, :37], s0[1:])
    assert relative_error(s[1:], s_short) < 1e-5


def test_chunked_kernel_shapes_the_dispatcher_sends_it():
    from pallas_kernels.gdn_chunked import kernel_fits

    def fits(dk, dv):
        return kernel_fits(jnp.zeros((1, 64, 2, dk)), jnp.zeros((1, 64, 4, dv)))
    assert fits(128, 128) and fits(16, 32)
    assert not fits(16, 24) and not fits(8, 32) and not fits(96, 128)


def test_chunked_kernel_refuses_value_blocks_that_do_not_divide_dv():
    from pallas_kernels.gdn_chunked import gdn_chunked_pallas

    with pytest.raises(ValueError, match="block_v=16 must divide the value head dim 24"):
        gdn_chunked_pallas(*inputs(64, B=1, nk=1, nv=2, dk=16, dv=24), block_v=16, interpret=True)


def strictly_lower_system(r, C: int, corr: float) -> np.ndarray:
    """A chunk's A = beta k k^T below the diagonal (no decay), for C unit keys `corr` alike."""
    k = corr * r.normal(size=(1, 128)) + (1 - corr) * r.normal(size=(C, 128))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    return np.tril(r.uniform(0.5, 1.0, size=(C, 1)) * (k @ k.T), -1)


@pytest.mark.parametrize("corr", [0.0, 0.95])
@pytest.mark.parametrize("C", [64, 32, 16])
def test_triangular_inverse_by_products_equals_substitution(C, corr):
    """The WY kernel's (I + A)^-1 by level products against a triangular solve, also with keys
    95% alike (A's entries near beta), where an unblocked Neumann series would lose everything."""
    from pallas_kernels.gdn_chunked import _invert_unit_lower

    A = jnp.asarray(strictly_lower_system(np.random.default_rng(C), C, corr), jnp.float32)
    def dot(a, b):
        return jnp.dot(a, b, precision="highest")
    got = _invert_unit_lower(A, dot)
    want = jax.scipy.linalg.solve_triangular(jnp.eye(C) + A, jnp.eye(C), lower=True, unit_diagonal=True)
    assert relative_error(got, want) < 1e-5


def test_chunked_kernel_writes_outputs_in_the_asked_dtype_and_the_dispatcher_in_vs():
    from pallas_kernels.gdn_chunked import gdn_chunked, gdn_chunked_pallas, gdn_chunked_reference

    q, k, v, g, beta, s0 = inputs(64, B=1, nk=1, nv=2, dk=16, dv=32, seed=4)
    def bf(x):
        return x.astype(jnp.bfloat16)
    o, _ = gdn_chunked_pallas(bf(q), bf(k), bf(v), g, beta, s0, operands=jnp.bfloat16, out_dtype=jnp.bfloat16,
                              interpret=True)
    o_ref, _ = gdn_chunked_reference(bf(q), bf(k), bf(v), g, beta, s0)
    assert o.dtype == jnp.bfloat16 and relative_error(o.astype(jnp.float32), o_ref) < CHUNKED_TOL[jnp.bfloat16]
    assert gdn_chunked(bf(q), bf(k), bf(v), g, beta, s0)[0].dtype == jnp.bfloat16
    assert gdn_chunked(q, k, v, g, beta, s0)[0].dtype == jnp.float32


def test_triangular_inverse_keeps_tf32_rounding_under_bf16s():
    """The bf16 path runs the inverse's products at one TF32 pass (10-bit mantissa operands):
    emulated here, X v stays within 2e-3 of the exact inverse's for keys 0-99% alike, under the
    4e-3 that bf16 storage of U and W costs anyway."""
    from pallas_kernels.gdn_chunked import _invert_unit_lower

    def tf32(x):  # round float32 operands to TF32's 10 mantissa bits, to nearest
        bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
        return jax.lax.bitcast_convert_type((bits + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000), jnp.float32)

    def dot(a, b):
        return jnp.dot(tf32(a), tf32(b), precision="highest")
    r = np.random.default_rng(1)
    for corr in (0.0, 0.5, 0.9, 0.99):
        A = strictly_lower_system(r, 64, corr)
        v = r.normal(size=(64, 128))
        got = _invert_unit_lower(jnp.asarray(A, jnp.float32), dot) @ v
        assert relative_error(got, np.linalg.solve(np.eye(64) + A, v)) < 2e-3
