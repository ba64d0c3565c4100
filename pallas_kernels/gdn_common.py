"""Pieces shared by the gated delta rule ops: q/k normalisation and value-head grouping."""

import jax
import jax.numpy as jnp

from pallas_kernels.batch_invariant import row_tiled

L2_EPS = 1e-6  # the same eps HF and flash-linear-attention use in their l2norm


def inverse_norm(x: jax.Array) -> jax.Array:
    """rsqrt(sum(x^2) + eps) over the last axis of float32 x (the last axis dropped)."""
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1) + L2_EPS)


def l2norm(x: jax.Array) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in float32."""
    return row_tiled(lambda x: x * inverse_norm(x)[..., None], x.astype(jnp.float32))


def prepare_qk(q: jax.Array, k: jax.Array, num_v_heads: int) -> tuple[jax.Array, jax.Array]:
    """L2-normalise q and k, scale q by dk^-1/2, and repeat key heads over their value heads.

    Args:
      q, k: [B, T, nk, dk].
      num_v_heads: nv, a multiple of nk; value head j reads key head j // (nv // nk).
    Returns:
      q, k: [B, T, nv, dk] float32.
    """
    rep = num_v_heads // q.shape[2]
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    return jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)


def as_stored(s: jax.Array, dtype) -> jax.Array:
    """float32 state s as a cache of `dtype` holds it (rounded, still float32): a pass carries its
    state across tokens as it would be read back after each, so verifying a draft gives what
    decoding it alone gives."""
    return s if jnp.dtype(dtype) == jnp.float32 else s.astype(dtype).astype(jnp.float32)
