"""The routing kernel in interpret mode against the model's formula: the same experts in the same
order (ties broken toward the lower index, as `jax.lax.top_k`), the same weights, with and without
renormalisation and the folded shared expert's slot, in bf16 logits too."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.expert_route import kernel_fits, route_pallas, route_reference

warnings.filterwarnings("ignore", message=".*Triton backend is deprecated.*")


def random_logits(N: int, E: int, *, seed: int, ties: bool, dtype=jnp.float32) -> jax.Array:
    """Logits at random; with ties, drawn from a few values so most rows hold equal ones."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-4, 4, (N, E)) / 2 if ties else rng.normal(size=(N, E)) * 3
    return jnp.asarray(values, dtype)


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_matches_the_reference(renormalise, shared, ties):
    """The router's output as one matmul gives it: 16 logits, the shared gate, padding."""
    logits, rest = random_logits(5, 16, seed=3 + ties, ties=ties), random_logits(5, 7, seed=4, ties=False)
    router = jnp.concatenate([logits, rest], axis=1)
    shared_at = 16 if shared else None
    got_weights, got_ids = route_pallas(router, 4, renormalise, 16, shared_at, interpret=True)
    want_weights, want_ids = route_reference(router, 4, renormalise, 16, shared_at)
    assert got_ids.shape == want_ids.shape == (5, 4 + shared) and got_ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(got_weights), np.asarray(want_weights), rtol=1e-6, atol=1e-7)
    if shared:
        assert (np.asarray(got_ids)[:, -1] == 16).all()
        np.testing.assert_allclose(np.asarray(got_weights)[:, -1], jax.nn.sigmoid(router[:, 16]), rtol=1e-6)


def test_bf16_logits_and_one_expert_a_token():
    logits = random_logits(3, 8, seed=7, ties=False, dtype=jnp.bfloat16)
    for k in (1, 8):
        got = route_pallas(logits, k, True, 8, interpret=True)
        want = route_reference(logits, k, True, 8)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)


def test_kernel_shapes():
    assert kernel_fits(256)
    assert not kernel_fits(96)  # a Triton block holds a power of two
