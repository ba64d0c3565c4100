"""Gated delta rule, one token at a time: decode (T = 1) and speculative verify (T = k + 1).

Per value head, with state S [dk, dv] in float32:
    S = exp(g_t) * S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
q and k are L2-normalised (q also scaled by dk^-1/2) inside the op.

`gdn_recurrent` is the dispatcher the model calls. A Pallas GPU kernel will sit beside the
reference here; until then every backend runs the reference.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.gdn_common import prepare_qk

MAX_UNROLL = 16


def gdn_recurrent_reference(q, k, v, g, beta, state, *, keep_states: bool = False):
    """Pure-JAX recurrent gated delta rule.

    Args:
      q, k: [B, T, nk, dk] (raw, before L2 norm).
      v: [B, T, nv, dv].
      g: [B, T, nv] float32 log-decay (<= 0). beta: [B, T, nv] float32 write strength.
        A padded token has g = 0 and beta = 0, which leaves the state unchanged.
      state: [B, nv, dk, dv] float32, the state before the first token.
      keep_states: also return the state after every token (what speculative rollback selects).
    Returns:
      o: [B, T, nv, dv] float32; the final state [B, nv, dk, dv]; and, with keep_states,
      the per-token states [B, T, nv, dk, dv].
    """
    q, k = prepare_qk(q, k, v.shape[2])
    v = v.astype(jnp.float32)

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, nv, d*], [B, nv]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta)
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t)
        return s, (o_t, s) if keep_states else (o_t, None)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    # Decode and verify run a handful of tokens: unrolled, XLA fuses the steps instead of
    # launching a loop iteration's kernels per token.
    unroll = q.shape[1] <= MAX_UNROLL
    final, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), time_major, unroll=unroll)
    o = jnp.moveaxis(o, 0, 1)
    if keep_states:
        return o, final, jnp.moveaxis(states, 0, 1)
    return o, final


def gdn_recurrent(q, k, v, g, beta, state, *, keep_states: bool = False):
    """Dispatcher for the recurrent gated delta rule (see `gdn_recurrent_reference`)."""
    return gdn_recurrent_reference(q, k, v, g, beta, state, keep_states=keep_states)
