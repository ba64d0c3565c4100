"""The batch-invariant mode's fixed-order Pallas matmul in interpret mode: XLA's product, each row
summed alone, and the dispatch that sends the mode's GPU tiles (only those) to it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fixed_order_matmul as fom
from pallas_kernels.batch_invariant import batch_invariant


@pytest.mark.parametrize("R,K,N", [(16, 96, 80), (64, 128, 256), (32, 48, 48), (1, 64, 32), (100, 48, 48),
                                   (5, 384, 4), (3, 100, 250)])
def test_the_kernel_computes_x_times_w_transposed(R, K, N):
    rng = np.random.default_rng(R + K + N)
    x = jnp.asarray(rng.standard_normal((R, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((N, K)), jnp.float32)
    got = fom.fixed_order_matmul_pallas(x, w, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w.T), rtol=1e-5, atol=1e-4)
    assert got.dtype == w.dtype
    assert fom.fixed_order_matmul_pallas(x, w.astype(jnp.bfloat16), interpret=True).dtype == jnp.bfloat16
    assert fom.fixed_order_matmul_pallas(x, w, out_dtype=jnp.float32, interpret=True).dtype == jnp.float32


def test_a_rows_result_does_not_depend_on_the_other_rows():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
    other = x.copy()
    other[1:] = rng.standard_normal((15, 64))
    a = fom.fixed_order_matmul_pallas(jnp.asarray(x, jnp.bfloat16), w, interpret=True)
    b = fom.fixed_order_matmul_pallas(jnp.asarray(other, jnp.bfloat16), w, interpret=True)
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
    assert not np.array_equal(np.asarray(a[1], np.float32), np.asarray(b[1], np.float32))


def test_a_row_comes_out_the_same_in_a_partial_tile_as_in_a_whole_one():
    """The kernel tiles the rows itself, `ROWS` a program: a token alone, one of a few, or in a
    second tile of a long pass is summed by the same products, bit for bit; leading axes are
    kept."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((fom.ROWS + 9, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
    run = lambda x: np.asarray(fom.fixed_order_matmul_pallas(x, w, interpret=True), np.float32)  # noqa: E731
    whole = run(x)
    np.testing.assert_array_equal(run(x[:1])[0], whole[0])
    np.testing.assert_array_equal(run(x[:7])[6], whole[6])
    np.testing.assert_array_equal(run(x[fom.ROWS:])[3], whole[fom.ROWS + 3])
    assert run(x[:6].reshape(2, 3, 128)).shape == (2, 3, 64)
    np.testing.assert_array_equal(run(x[:6].reshape(2, 3, 128))[1, 2], whole[5])


def test_a_projection_padded_to_whole_blocks_keeps_each_rows_result_its_own():
    """N = 4 outputs and K = 100 (the default model's beta/decay projections are 4 wide): zero
    padding to whole blocks, and a row alone equals the same row among others, bit for bit."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((fom.ROWS + 3, 100)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 100)), jnp.bfloat16)
    run = lambda x: np.asarray(fom.fixed_order_matmul_pallas(x, w, interpret=True), np.float32)  # noqa: E731
    whole = run(x)
    assert whole.shape == (fom.ROWS + 3, 4)
    for alone, at in ((run(x[:1])[0], 0), (run(x[:4])[3], 3), (run(x[fom.ROWS:])[1], fom.ROWS + 1)):
        np.testing.assert_array_equal(alone, whole[at])


def test_only_the_modes_gpu_passes_run_the_kernel(monkeypatch):
    """Whatever a projection's shape (a K or N of no whole block is padded to one)."""
    with batch_invariant(64):
        assert not fom.use_fixed_order_matmul()  # this CPU
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        assert fom.use_fixed_order_matmul()
    assert not fom.use_fixed_order_matmul()  # outside the mode: XLA's dot


def test_a_split_of_k_sums_its_ranges_to_the_product():
    """Four ranges of K, each summed apart and then added in order: XLA's product, and a row's
    result still its own."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((32, 256)), jnp.float32)
    blocks = fom.Plan(block_n=16, block_k=32, splits=4, num_stages=3)
    got = fom.fixed_order_matmul_pallas(x, w, blocks=blocks, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w.T), rtol=1e-5, atol=1e-4)
    other = fom.fixed_order_matmul_pallas(x.at[1:].set(0.0), w, blocks=blocks, interpret=True)
    np.testing.assert_array_equal(np.asarray(other[0]), np.asarray(got[0]))


def test_the_plan_splits_k_where_few_column_blocks_would_idle_sms_or_one_program_walk_far():
    """The lm_head (1940 column blocks) and 27B's gate_up (272: two waves) do not split; its out
    projection (40 blocks, K 6,144) splits to a wave; its down projection (40 blocks, K 17,408)
    further, until no program walks more than LONG_RANGE of K."""
    assert fom.plan(5120, 248320).splits == 1 and fom.plan(5120, 34816).splits == 1
    down, out = fom.plan(17408, 5120), fom.plan(6144, 5120)
    assert out.splits == 4 and down.splits == 8 and 17408 // down.splits <= fom.LONG_RANGE
    for p, K in ((down, 17408), (out, 6144)):
        assert (5120 // p.block_n) * p.splits >= fom.WAVE and K % (p.splits * p.block_k) == 0
