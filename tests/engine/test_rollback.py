"""Rollback is exact: after verifying k+1 tokens and keeping j+1 of them, every cache equals the one
reached by decoding those j+1 tokens one at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import relative_error

from models.layers import Batch, KVCache
from models.gated_deltanet import GDNCache
from models.qwen3_5 import init_cache
from spec_jax.loading import load_model

L, N_PROMPT, K = 128, 11, 3


@pytest.fixture(scope="module")
def setup(tiny_dir):
    model = load_model(tiny_dir, "float32")[0]
    gdef, params = nnx.split(model)

    @jax.jit
    def extend(params, tokens, start, n_valid, cache):
        return nnx.merge(gdef, params)(tokens, Batch(start, n_valid), cache, kv_len=L).cache

    def verify_commit(rollback):
        @jax.jit
        def run(params, tokens, start, n_used, cache):
            m = nnx.merge(gdef, params)
            n_valid = jnp.full_like(start, tokens.shape[1])
            out = m(tokens, Batch(start, n_valid), cache, kv_len=L, rollback=rollback)
            return m.commit(out.cache, out.pending, n_used)
        return lambda *a: run(params, *a)

    rng = np.random.default_rng(0)
    prompt = jnp.pad(jnp.asarray(rng.integers(0, 500, (2, N_PROMPT)), jnp.int32), ((0, 0), (0, 64 - N_PROMPT)))
    cache = extend(params, prompt, jnp.zeros(2, jnp.int32), jnp.full(2, N_PROMPT),
                   init_cache(model.cfg, 2, L, jnp.float32))
    verify = jnp.asarray(rng.integers(0, 500, (2, K + 1)), jnp.int32)
    return params, extend, verify_commit, cache, verify


def assert_caches_equal(got, want, length, tol):
    """Every cache within `tol` relative (norm) error; attention slots compared up to `length`."""
    errors = []
    for g, w in zip(got, want):
        if isinstance(g, KVCache):
            errors += [relative_error(g.k[:, :, :length], w.k[:, :, :length]),
                       relative_error(g.v[:, :, :length], w.v[:, :, :length])]
        else:
            assert isinstance(g, GDNCache)
            errors += [relative_error(g.conv, w.conv), relative_error(g.state, w.state)]
    assert max(errors) < tol, errors


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
@pytest.mark.parametrize("accepted", range(K + 1))
@pytest.mark.parametrize("reference_width, tol", [(K + 1, 1e-6), (1, 1e-5)])
def test_commit_equals_one_at_a_time(setup, rollback, accepted, reference_width, tol):
    """The reference feeds one real token per call. With reference_width K+1 each call is padded
    to the verify pass's shape, so its matmuls round exactly alike and the bound is 1e-6; with
    width 1 (plain decode) batched-vs-single float32 rounding across 8 layers adds ~2e-6."""
    params, extend, verify_commit, cache, verify = setup
    start = jnp.full(2, N_PROMPT, jnp.int32)
    n_used = jnp.asarray([accepted + 1, K + 1 - accepted], jnp.int32)  # rows keep different prefixes
    got = verify_commit(rollback)(verify, start, n_used, jax.tree.map(jnp.copy, cache))
    for row in range(2):
        want = jax.tree.map(lambda x: x[:, row : row + 1], cache)
        for t in range(int(n_used[row])):
            one = jnp.pad(verify[row : row + 1, t : t + 1], ((0, 0), (0, reference_width - 1)))
            want = extend(params, one, jnp.asarray([N_PROMPT + t]), jnp.ones(1, jnp.int32), want)
        assert_caches_equal(jax.tree.map(lambda x: x[:, row : row + 1], got), want, N_PROMPT + int(n_used[row]), tol)


def test_committing_the_wrong_prefix_is_caught(setup):
    """The comparison above can fail: keeping one token too many is far outside its bound."""
    params, extend, verify_commit, cache, verify = setup
    start = jnp.full(2, N_PROMPT, jnp.int32)
    got = verify_commit("checkpoint")(verify, start, jnp.asarray([3, 3], jnp.int32), jax.tree.map(jnp.copy, cache))
    want = cache
    for t in range(2):
        want = extend(params, verify[:, t : t + 1], start + t, jnp.ones(2, jnp.int32), want)
    with pytest.raises(AssertionError):
        assert_caches_equal(got, want, N_PROMPT + 2, 1e-2)
