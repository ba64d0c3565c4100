"""Gated delta rule over whole chunks of tokens (prefill): the WY / UT-transform formulation.

Within a chunk of C tokens with cumulative log-decay G_i = sum_{j<=i} g_j, the C sequential
delta-rule writes collapse into one unit-lower-triangular solve, after which the chunk reads
and updates the state with matrix products. Chunks are then scanned in order. The result
equals `gdn_recurrent` token for token (up to float32 rounding).

`gdn_chunked` is the dispatcher the model calls. `gdn_chunked_pallas` is the Pallas (Triton)
version in two launches, split as flash-linear-attention splits it: a chunk-parallel kernel
inverts each chunk's (I + A) by forward substitution (the only work that is not a matmul; rows
are picked with masks since Triton has no scratch memory) and forms U and W; then one program
per (row, value head, block of BV value columns) walks the chunks in order with its [dk, BV]
state in float32 registers, each chunk five dots. (A first version did the solve inside the
sequential walk and ran 46x slower than XLA: BENCHMARKS.md.)
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


def _dot(a, b, precision):
    """float32-accumulated dot; `precision` is HIGHEST in interpret mode, TF32x3 on the GPU."""
    return jax.lax.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def _normalise_rows(x):
    """Rows of x [C, d] L2-normalised in float32 (the kernels fuse the q/k norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)


def _decay_matrix(g, chunk: int):
    """Cumulative log-decay G [C] of a chunk's gates g [C], the causal decay exp(G_i - G_j) for
    j <= i else 0 [C, C], and the row/column iotas."""
    G = jnp.cumsum(g)
    i = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    return G, jnp.exp(jnp.where(j <= i, G[:, None] - G[None, :], -jnp.inf)), i, j


def _invert_unit_lower(A):
    """(I + A)^-1 for strictly lower A [C, C], by forward substitution over rows: X_i = e_i - A_i X.
    Rows are selected with masks because Triton has no dynamic indexing of values."""
    C = A.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)

    def row(i, x):
        a_i = jnp.sum(jnp.where(rows == i, A, 0.0), axis=0)  # A[i, :], zero at and above i
        x_i = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (C,), 0) == i, 1.0, 0.0) - jnp.sum(a_i[:, None] * x, axis=0)
        return jnp.where(rows == i, x_i[None, :], x)

    return jax.lax.fori_loop(1, C, row, (rows == cols).astype(jnp.float32))


def _wy_kernel(k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref, *, chunk: int, precision):
    """One (row, value head, chunk), all chunks in parallel: U = (I + A)^-1 beta v [C, dv] and
    W = (I + A)^-1 beta exp(G) k [C, dk], A the strictly lower beta k k^T decay."""
    k = _normalise_rows(k_ref[...])
    G, decay, i, j = _decay_matrix(g_ref[...], chunk)
    beta = beta_ref[...]
    A = jnp.where(j < i, beta[:, None] * _dot(k, k.T, precision) * decay, 0.0)
    T = _invert_unit_lower(A)
    u_ref[...] = _dot(T, beta[:, None] * v_ref[...].astype(jnp.float32), precision)
    w_ref[...] = _dot(T, (beta * jnp.exp(G))[:, None] * k, precision)


def _state_kernel(q_ref, k_ref, u_ref, w_ref, g_ref, s0_ref, o_ref, s_ref, *, chunk: int, n_chunks: int, precision):
    """One (row, value head, block of BV value columns) walks the chunks in order with its
    [dk, BV] state in registers: every chunk is five dots on the tensor cores."""

    def one_chunk(n, s):
        at = pl.ds(n * chunk, chunk)
        q = _normalise_rows(q_ref[at, :]) * q_ref.shape[-1] ** -0.5
        k = _normalise_rows(k_ref[at, :])
        G, decay, _, _ = _decay_matrix(g_ref[at], chunk)
        v_new = u_ref[at, :] - _dot(w_ref[at, :], s, precision)  # the chunk's values after the old state's reads
        o = _dot(q * jnp.exp(G)[:, None], s, precision) + _dot(_dot(q, k.T, precision) * decay, v_new, precision)
        o_ref[at, :] = o.astype(o_ref.dtype)
        total = jnp.sum(g_ref[at])  # G at the chunk's last token
        return s * jnp.exp(total) + _dot((k * jnp.exp(total - G)[:, None]).T, v_new, precision)

    s_ref[...] = jax.lax.fori_loop(0, n_chunks, one_chunk, s0_ref[...].astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_v", "interpret"))
def gdn_chunked_pallas(q, k, v, g, beta, state, *, block_v: int = 32, interpret: bool = False):
    """The Pallas kernels; same arguments and results as `gdn_chunked_reference`. dk, dv and
    block_v must be powers of two (>= 16 on the GPU) and block_v must divide dv.

    Two launches, split the way flash-linear-attention splits it: a chunk-parallel kernel does
    each chunk's triangular solve (the only non-matmul work), then a sequential kernel carries
    the state across chunks with dots alone.
    """
    B, T, nk, dk = q.shape
    nv, dv = v.shape[2], v.shape[3]
    r, Tp = nv // nk, -(-T // CHUNK) * CHUNK
    n = Tp // CHUNK
    precision = jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
    head_major = lambda x: jnp.moveaxis(pad(x), 2, 1)  # [B, heads, Tp, ...]
    q, k, v = head_major(q), head_major(k), head_major(v)
    g, beta = head_major(g.astype(jnp.float32)), head_major(beta.astype(jnp.float32))
    params = plt.CompilerParams(num_warps=4, num_stages=1)

    chunk_of = lambda d, by_key: pl.BlockSpec(
        (None, None, CHUNK, d), lambda bh, c: (bh // nv, (bh % nv) // r if by_key else bh % nv, c, 0))
    gate_chunk = pl.BlockSpec((None, None, CHUNK), lambda bh, c: (bh // nv, bh % nv, c))
    u, w = pl.pallas_call(
        functools.partial(_wy_kernel, chunk=CHUNK, precision=precision),
        out_shape=[jax.ShapeDtypeStruct((B, nv, Tp, dv), jnp.float32), jax.ShapeDtypeStruct((B, nv, Tp, dk), jnp.float32)],
        grid=(B * nv, n),
        in_specs=[chunk_of(dk, True), chunk_of(dv, False), gate_chunk, gate_chunk],
        out_specs=[chunk_of(dv, False), chunk_of(dk, False)],
        compiler_params=params, interpret=interpret, name="gdn_chunked_wy",
    )(k, v, g, beta)

    whole = lambda d, by_key, cols=None: pl.BlockSpec(
        (None, None, Tp, cols or d),
        lambda bh, iv: (bh // nv, (bh % nv) // r if by_key else bh % nv, 0, iv if cols else 0))
    by_state = pl.BlockSpec((None, None, dk, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, iv))
    by_head = pl.BlockSpec((None, None, Tp), lambda bh, iv: (bh // nv, bh % nv, 0))
    o, final = pl.pallas_call(
        functools.partial(_state_kernel, chunk=CHUNK, n_chunks=n, precision=precision),
        out_shape=[jax.ShapeDtypeStruct((B, nv, Tp, dv), jnp.float32), jax.ShapeDtypeStruct(state.shape, jnp.float32)],
        grid=(B * nv, dv // block_v),
        in_specs=[whole(dk, True), whole(dk, True), whole(dv, False, block_v), whole(dk, False), by_head, by_state],
        out_specs=[whole(dv, False, block_v), by_state],
        compiler_params=params, interpret=interpret, name="gdn_chunked_state",
    )(q, k, u, w, g, state.astype(jnp.float32))
    return jnp.moveaxis(o, 1, 2)[:, :T], final


def gdn_chunked(q, k, v, g, beta, state):
    """Dispatcher for the chunked gated delta rule (see `gdn_chunked_reference`)."""
    return gdn_chunked_reference(q, k, v, g, beta, state)
