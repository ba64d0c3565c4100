"""`attend_masked` with a head-major context cache against the same attention over the context and
the new keys concatenated (float64 NumPy), at a short pass, past QUERY_BLOCK queries, and in
batch-invariant mode, where a row's output must also not depend on the rows beside it."""

import jax.numpy as jnp
import numpy as np
import pytest

from models.layers import QUERY_BLOCK, attend_masked
from pallas_kernels.batch_invariant import batch_invariant


def case(T, *, B=2, nq=4, nkv=2, d=16, C=11, seed=0):
    """q [B, T, nq, d]; new keys k, v [B, T, nkv, d]; context (ctx_k, ctx_v) [B, nkv, C, d];
    a random mask [B, T, C + T] that leaves every query at least one key."""
    rng = np.random.default_rng(seed)
    def f(*s):
        return rng.normal(size=s).astype(np.float32)
    visible = rng.random((B, T, C + T)) < 0.6
    visible[:, :, C] = True
    return f(B, T, nq, d), f(B, T, nkv, d), f(B, T, nkv, d), (f(B, nkv, C, d), f(B, nkv, C, d)), visible


def reference(q, k, v, context, visible):
    """Softmax over the context's keys then the new ones, concatenated, in float64."""
    keys = np.concatenate([np.swapaxes(context[0], 1, 2), k], axis=1).astype(np.float64)  # [B, C+T, nkv, d]
    values = np.concatenate([np.swapaxes(context[1], 1, 2), v], axis=1).astype(np.float64)
    B, T, nq, d = q.shape
    group = nq // k.shape[2]
    keys, values = np.repeat(keys, group, axis=2), np.repeat(values, group, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q.astype(np.float64), keys) / np.sqrt(d)
    scores = np.where(visible[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", probs, values)


def run(q, k, v, context, visible):
    return np.asarray(attend_masked(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(visible),
                                    context=tuple(jnp.asarray(c) for c in context)))


@pytest.mark.parametrize("T", [1, 5, 2 * QUERY_BLOCK])
def test_a_context_cache_attends_as_if_concatenated(T):
    q, k, v, context, visible = case(T, B=1 if T > QUERY_BLOCK else 2, seed=T)
    np.testing.assert_allclose(run(q, k, v, context, visible), reference(q, k, v, context, visible),
                               rtol=2e-5, atol=2e-5)


def test_batch_invariant_mode_keeps_a_rows_output_whatever_rows_are_beside_it():
    q, k, v, context, visible = case(5, B=3, seed=7)
    with batch_invariant(4):
        together = run(q, k, v, context, visible)
        alone = run(q[1:2], k[1:2], v[1:2], tuple(c[1:2] for c in context), visible[1:2])
    np.testing.assert_array_equal(together[1], alone[0])
    np.testing.assert_allclose(together, reference(q, k, v, context, visible), rtol=2e-5, atol=2e-5)
