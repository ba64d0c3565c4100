"""Gated delta rule over whole chunks of tokens (prefill): the WY / UT-transform formulation.

Within a chunk of C tokens with cumulative log-decay G_i = sum_{j<=i} g_j, the C sequential
delta-rule writes collapse into one unit-lower-triangular solve, after which the chunk reads
and updates the state with matrix products. Chunks are then scanned in order. The result
equals `gdn_recurrent` token for token (up to float32 rounding).

`gdn_chunked` is the dispatcher the model calls. `gdn_chunked_pallas` is the Pallas (Triton)
kernel: one program per (row, value head, block of BV value columns) walks the chunks in order
with its [dk, BV] state tile in float32 registers; within a chunk it forms the strictly lower
matrix A, solves (I + A) [U | W] = [beta v | beta exp(G) k] by forward substitution row by row
(Triton has no scratch memory), and applies the chunk's reads and state update as dots.
It compiles and matches on the H200 but, with the tensor cores idle during the row-by-row
solve, runs 46x slower than XLA's reference at 4k tokens (BENCHMARKS.md), so the dispatcher
runs the reference on every backend until a chunk-parallel design beats it.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn_common import L2_EPS, prepare_qk

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


def _dot(a, b):
    """float32 dot at full precision (Triton would otherwise use TF32)."""
    return jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _forward_substitute(A, rhs):
    """Solve (I + A) X = rhs for strictly lower A [C, C], row by row: X_i = rhs_i - A_i X."""
    C = A.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, rhs.shape, 0)
    a_rows = jax.lax.broadcasted_iota(jnp.int32, A.shape, 0)

    def row(i, x):
        a_i = jnp.sum(jnp.where(a_rows == i, A, 0.0), axis=0)  # A[i, :], zero at and above i
        x_i = jnp.sum(jnp.where(rows == i, x, 0.0), axis=0) - jnp.sum(a_i[:, None] * x, axis=0)
        return jnp.where(rows == i, x_i[None, :], x)

    return jax.lax.fori_loop(1, C, row, rhs)


def _chunked_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, s_ref, *, chunk: int, n_chunks: int):
    """One (row, value head, value block): q/k [Tp, dk], v [Tp, BV], g/beta [Tp], state [dk, BV]."""
    dk = q_ref.shape[-1]
    i = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)

    def one_chunk(n, s):
        at = pl.ds(n * chunk, chunk)
        q = q_ref[at, :].astype(jnp.float32)
        k = k_ref[at, :].astype(jnp.float32)
        q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + L2_EPS) * dk**-0.5
        k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + L2_EPS)
        v, g, beta = v_ref[at, :].astype(jnp.float32), g_ref[at], beta_ref[at]
        G = jnp.cumsum(g)
        decay = jnp.exp(jnp.where(j <= i, G[:, None] - G[None, :], -jnp.inf))
        A = jnp.where(j < i, beta[:, None] * _dot(k, k.T) * decay, 0.0)
        u = _forward_substitute(A, beta[:, None] * v)  # new values
        w = _forward_substitute(A, (beta * jnp.exp(G))[:, None] * k)  # decayed keys reading the old state
        v_new = u - _dot(w, s)
        o = _dot(q * jnp.exp(G)[:, None], s) + _dot(_dot(q, k.T) * decay, v_new)
        o_ref[at, :] = o.astype(o_ref.dtype)
        total = jnp.sum(g)  # G at the chunk's last token
        return s * jnp.exp(total) + _dot((k * jnp.exp(total - G)[:, None]).T, v_new)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, one_chunk, s0_ref[...].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_v", "interpret"))
def gdn_chunked_pallas(q, k, v, g, beta, state, *, block_v: int = 32, interpret: bool = False):
    """The Pallas kernel; same arguments and results as `gdn_chunked_reference`. dk and block_v
    must be powers of two and block_v must divide dv."""
    B, T, nk, dk = q.shape
    nv, dv = v.shape[2], v.shape[3]
    r, Tp = nv // nk, -(-T // CHUNK) * CHUNK
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
    head_major = lambda x: jnp.moveaxis(pad(x), 2, 1)
    q, k, v = head_major(q), head_major(k), head_major(v)
    g, beta = head_major(g.astype(jnp.float32)), head_major(beta.astype(jnp.float32))
    by_key_head = pl.BlockSpec((None, None, Tp, dk), lambda bh, iv: (bh // nv, (bh % nv) // r, 0, 0))
    by_value = pl.BlockSpec((None, None, Tp, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, iv))
    by_head = pl.BlockSpec((None, None, Tp), lambda bh, iv: (bh // nv, bh % nv, 0))
    by_state = pl.BlockSpec((None, None, dk, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, iv))
    o, final = pl.pallas_call(
        functools.partial(_chunked_kernel, chunk=CHUNK, n_chunks=Tp // CHUNK),
        out_shape=[jax.ShapeDtypeStruct((B, nv, Tp, dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, jnp.float32)],
        grid=(B * nv, dv // block_v),
        in_specs=[by_key_head, by_key_head, by_value, by_head, by_head, by_state],
        out_specs=[by_value, by_state],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_chunked",
    )(q, k, v, g, beta, state.astype(jnp.float32))
    return jnp.moveaxis(o, 1, 2)[:, :T], final


def gdn_chunked(q, k, v, g, beta, state):
    """Dispatcher for the chunked gated delta rule (see `gdn_chunked_reference`)."""
    return gdn_chunked_reference(q, k, v, g, beta, state)
