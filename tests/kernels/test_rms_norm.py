"""The fixed-order RMS norm kernel in interpret mode: the norms' own formulas, the residual add
joined to it, each row summed alone, and the dispatch that sends the mode's GPU norms and the
residual stream's few-row GPU norms to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.layers import PlainRMSNorm
from models.gated_deltanet import GatedRMSNorm
from models.qwen3_5 import RMSNorm
from pallas_kernels import rms_norm as rn
from pallas_kernels.batch_invariant import batch_invariant


def _random_norm(cls, W, seed):
    norm = cls(W, 1e-6)
    norm.weight[...] = jnp.asarray(np.random.default_rng(seed).standard_normal(W), jnp.float32)
    return norm


@pytest.mark.parametrize("shape", [(3, 5120), (2, 7, 4, 256), (1, 128), (130, 96)])
def test_the_kernel_computes_each_norm(shape):
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    W = shape[-1]
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),  # noqa: E731
                                                     rtol=1e-2, atol=1e-2)
    zero_centred, plain, gated = (_random_norm(c, W, i) for i, c in enumerate((RMSNorm, PlainRMSNorm, GatedRMSNorm)))
    got = rn.rms_norm_pallas(x, 1.0 + zero_centred.weight[...], 1e-6, interpret=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    close(got, zero_centred.apply(x))
    close(rn.rms_norm_pallas(x, plain.weight[...], 1e-6, interpret=True), plain.apply(x))
    want = jax.vmap(lambda o, z: gated(o, z, jnp.float32))(x.reshape(-1, W), z.reshape(-1, W)).reshape(shape)
    out = rn.rms_norm_pallas(x, gated.weight[...], 1e-6, z, out_dtype=jnp.float32, interpret=True)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_a_row_comes_out_the_same_alone_among_a_few_and_in_a_later_tile():
    """The kernel tiles the rows itself: a token alone, one of a few, or in the second tile of a
    long pass is summed the same way, bit for bit, whatever the other rows hold."""
    W = 2048
    R = rn.rows_per_program(W)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((R + 5, W)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal(W), jnp.float32)
    run = lambda x: np.asarray(rn.rms_norm_pallas(x, scale, 1e-6, interpret=True))  # noqa: E731
    whole = run(x)
    np.testing.assert_array_equal(run(x[:1])[0], whole[0])
    np.testing.assert_array_equal(run(x[:3])[2], whole[2])
    np.testing.assert_array_equal(run(x[R:])[4], whole[R + 4])
    np.testing.assert_array_equal(run(x.at[1:].set(7.0))[0], whole[0])


def test_the_tile_is_a_function_of_the_width_alone():
    assert rn.chunk(5120) == 1024 and rn.rows_per_program(5120) == 1
    assert rn.chunk(256) == 256 and rn.rows_per_program(256) == 32
    assert rn.chunk(96) == 32 and rn.rows_per_program(96) == 64
    assert not rn.kernel_fits(jnp.zeros((2, 100)))  # a piece of 4 elements


def test_only_the_modes_gpu_norms_run_the_kernel(monkeypatch):
    x = jnp.zeros((3, 256))
    with batch_invariant(64):
        assert not rn.use_rms_norm_kernel(x)  # this CPU
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert rn.use_rms_norm_kernel(x)
        assert not rn.use_rms_norm_kernel(jnp.zeros((3, 100)))
    assert not rn.use_rms_norm_kernel(x)  # outside the mode: XLA's norm
    assert rn.use_rms_norm_kernel(x, few_rows=True)  # ... but for the residual stream's few rows
    assert not rn.use_rms_norm_kernel(jnp.zeros((rn.FEW_ROWS + 1, 256)), few_rows=True)


@pytest.mark.parametrize("shape", [(1, 2048), (3, 5, 256)])
def test_the_residual_add_joins_the_norm(shape):
    """(x + h, norm(x + h)) from one kernel equals the add in x's dtype then the norm, and the
    decoder layer's call gives it."""
    rng = np.random.default_rng(len(shape))
    x, h = (jnp.asarray(rng.standard_normal(shape) * 3, jnp.bfloat16) for _ in range(2))
    norm = _random_norm(RMSNorm, shape[-1], 4)
    total, normed = rn.rms_norm_pallas(x, norm.scale(), 1e-6, added=h, interpret=True)
    np.testing.assert_array_equal(np.asarray(total, np.float32), np.asarray(x + h, np.float32))
    assert total.dtype == normed.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(normed, np.float32), np.asarray(norm.apply(x + h), np.float32),
                               rtol=1e-2, atol=1e-2)
    want_total, want_normed = norm.add_and_norm(x, h)  # this CPU: the add, then XLA's norm
    np.testing.assert_array_equal(np.asarray(want_total, np.float32), np.asarray(total, np.float32))
    np.testing.assert_array_equal(np.asarray(want_normed, np.float32), np.asarray(norm.apply(x + h), np.float32))
