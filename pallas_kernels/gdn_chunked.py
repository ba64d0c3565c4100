"""Gated delta rule over whole chunks of tokens (prefill): the WY / UT-transform formulation.

Within a chunk of C tokens with cumulative log-decay G_i = sum_{j<=i} g_j, the C sequential
delta-rule writes collapse into one unit-lower-triangular solve, after which the chunk reads
and updates the state with matrix products. Chunks are then scanned in order. The result
equals `gdn_recurrent` token for token (up to float32 rounding).

`gdn_chunked` is the dispatcher the model calls. A Pallas GPU kernel will sit beside the
reference here; until then every backend runs the reference.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_common import prepare_qk

CHUNK = 64


def gdn_chunked_reference(q, k, v, g, beta, state, *, chunk: int = CHUNK):
    """Pure-JAX chunked gated delta rule.

    Args:
      q, k: [B, T, nk, dk] (raw, before L2 norm). T need not be a multiple of `chunk`.
      v: [B, T, nv, dv].
      g: [B, T, nv] float32 log-decay (<= 0). beta: [B, T, nv] float32. A padded token has
        g = 0 and beta = 0, which leaves the state unchanged.
      state: [B, nv, dk, dv] float32, the state before the first token.
    Returns:
      o: [B, T, nv, dv] float32 and the final state [B, nv, dk, dv] float32.
    """
    B, T, nv, dv = v.shape
    q, k = prepare_qk(q, k, nv)
    pad = (-T) % chunk
    n = (T + pad) // chunk

    def to_chunks(x):  # [B, T, nv, ...] -> [B, nv, n, C, ...]
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(B, n, chunk, *x.shape[2:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = map(to_chunks, (q, k, v, g, beta))
    G = jnp.cumsum(g, axis=-1)  # [B, nv, n, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    # exp(G_i - G_j) for j <= i; masked before exp so the upper triangle cannot overflow.
    decay = jnp.exp(jnp.where(causal, G[..., :, None] - G[..., None, :], -jnp.inf))

    k_beta = k * beta[..., None]
    strictly_lower = (k_beta @ jnp.swapaxes(k, -1, -2)) * decay * ~jnp.eye(chunk, dtype=bool)
    system = jnp.eye(chunk) + strictly_lower  # (I + A), unit lower triangular
    solve = lambda rhs: jax.scipy.linalg.solve_triangular(system, rhs, lower=True, unit_diagonal=True)
    new_values = solve(v * beta[..., None])  # U = (I + A)^-1 (beta v)
    state_keys = solve(k_beta * jnp.exp(G)[..., None])  # W = (I + A)^-1 (beta k exp(G))
    intra = (q @ jnp.swapaxes(k, -1, -2)) * decay  # causal q.k within the chunk, diagonal included
    q_decayed = q * jnp.exp(G)[..., None]
    k_to_end = k * jnp.exp(G[..., -1:] - G)[..., None]
    chunk_decay = jnp.exp(G[..., -1])[..., None, None]

    def step(s, xs):  # s: [B, nv, dk, dv]
        u, w, qd, kd, a, cd = xs
        v_new = u - w @ s
        o = qd @ s + a @ v_new
        s = s * cd + jnp.swapaxes(kd, -1, -2) @ v_new
        return s, o

    per_chunk = [jnp.moveaxis(x, 2, 0) for x in (new_values, state_keys, q_decayed, k_to_end, intra, chunk_decay)]
    final, o = jax.lax.scan(step, state.astype(jnp.float32), per_chunk)
    o = jnp.moveaxis(o, 0, 2)  # [B, nv, n, C, dv]
    o = jnp.moveaxis(o.reshape(B, nv, n * chunk, dv), 1, 2)[:, :T]
    return o, final


def gdn_chunked(q, k, v, g, beta, state):
    """Dispatcher for the chunked gated delta rule (see `gdn_chunked_reference`)."""
    return gdn_chunked_reference(q, k, v, g, beta, state)
