"""Gated delta rule over whole chunks of tokens (prefill): the WY / UT-transform formulation.

Within a chunk of C tokens with cumulative log-decay G_i = sum_{j<=i} g_j, the C sequential
delta-rule writes collapse into one unit-lower-triangular solve, after which the chunk reads
and updates the state with matrix products. Chunks are then scanned in order. The reference
equals `gdn_recurrent` token for token up to float32 rounding (the kernels too with float32
operands; bfloat16 operands round to ~4e-3).

`gdn_chunked` is the dispatcher the model calls. `gdn_chunked_pallas` is the Pallas (Triton)
version in three launches, split as flash-linear-attention splits the work:
  1. chunk-parallel WY: invert each chunk's (I + A) in 16-row blocks (forward substitution on the
     diagonal blocks, rows picked with masks since Triton cannot index values; block substitution
     by matmuls below them) and form U, W and the keys decayed to the chunk's end;
  2. sequential state walk: one program per (row, value head, block of BV value columns) carries
     its [dk, BV] state in float32 registers across the chunks, two dots a chunk, and writes the
     state each chunk starts from and the chunk's corrected values v_new;
  3. chunk-parallel outputs from those.
Dot operands are float32 or, on the GPU's fast path, bfloat16 (float32 accumulation either way).
Earlier versions, and why they were slower, are in BENCHMARKS.md.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.gdn_common import L2_EPS, prepare_qk
from pallas_kernels.gdn_recurrent import next_pow2

CHUNK = 64
SUB = 16  # block size of the WY kernel's blocked triangular inverse (Triton's smallest dot)


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


def _dot(a, b, dt, precision):
    """a @ b with float32 accumulation, operands cast to dt: bfloat16 (the tensor cores' fast
    path, as flash-linear-attention runs it) or float32 at `precision`."""
    if dt == jnp.float32:
        return jax.lax.dot(a.astype(dt), b.astype(dt), precision=precision, preferred_element_type=jnp.float32)
    return jax.lax.dot(a.astype(dt), b.astype(dt), preferred_element_type=jnp.float32)


def _normalise_rows(x):
    """Rows of x [C, d] L2-normalised in float32 (the kernels fuse the q/k norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)


def _decay(Gi, Gj, diagonal: bool, strict: bool):
    """exp(G_i - G_j) [len(Gi), len(Gj)]; on a diagonal block only j <= i (j < i if strict) is
    kept, masked before exp so the upper triangle cannot overflow."""
    diff = Gi[:, None] - Gj[None, :]
    if diagonal:
        i = jax.lax.broadcasted_iota(jnp.int32, diff.shape, 0)
        j = jax.lax.broadcasted_iota(jnp.int32, diff.shape, 1)
        diff = jnp.where(j < i if strict else j <= i, diff, -jnp.inf)
    return jnp.exp(diff)


def _last(x):
    """x[-1] of a 1-D value (Triton cannot index values: a masked sum picks it exactly)."""
    return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) == x.shape[0] - 1, x, 0.0))


def _invert_unit_lower(blocks):
    """(I + A)^-1 for each strictly lower A [S, S] in blocks, by forward substitution over rows:
    X_i = e_i - A_i X. The blocks share one loop so that their independent dependency chains
    overlap; rows are selected with masks because Triton has no dynamic indexing of values."""
    S = blocks[0].shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (S, S), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (S, S), 1)

    def row(i, xs):
        is_row_i = rows == i
        unit_row = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (S,), 0) == i, 1.0, 0.0)
        new = []
        for A, x in zip(blocks, xs):
            a_i = jnp.sum(jnp.where(is_row_i, A, 0.0), axis=0)  # A[i, :], zero at and above i
            new.append(jnp.where(is_row_i, (unit_row - jnp.sum(a_i[:, None] * x, axis=0))[None, :], x))
        return tuple(new)

    identity = (rows == cols).astype(jnp.float32)
    return jax.lax.fori_loop(1, S, row, tuple(identity for _ in blocks))


def _wy_kernel(k_ref, v_ref, G_ref, beta_ref, u_ref, w_ref, kd_ref, *, dt, precision):
    """One (row, value head, chunk), all chunks in parallel. With A the strictly lower
    beta k k^T decay of the chunk: U = (I + A)^-1 beta v [C, dv], W = (I + A)^-1 beta exp(G) k
    [C, dk], and the keys decayed to the chunk's end, k exp(G_last - G) [C, dk].

    (I + A) is inverted by blocks of SUB rows, as flash-linear-attention does: the diagonal
    blocks by forward substitution in one shared loop, the blocks below them by block forward
    substitution (matmuls).
    """
    nb = k_ref.shape[0] // SUB
    rows = lambda ref, a: ref[pl.ds(a * SUB, SUB)] if len(ref.shape) == 1 else ref[pl.ds(a * SUB, SUB), :]
    k = [_normalise_rows(rows(k_ref, a)) for a in range(nb)]
    G = [rows(G_ref, a) for a in range(nb)]
    beta = [rows(beta_ref, a) for a in range(nb)]
    f32 = functools.partial(_dot, dt=jnp.float32, precision=precision)
    A = {(a, c): beta[a][:, None] * _dot(k[a], k[c].T, dt, precision) * _decay(G[a], G[c], a == c, strict=True)
         for a in range(nb) for c in range(a + 1)}
    X = dict(zip(((a, a) for a in range(nb)), _invert_unit_lower([A[a, a] for a in range(nb)])))
    for a in range(nb):
        for c in range(a):  # X_ac = -X_aa sum_{c <= m < a} A_am X_mc
            X[a, c] = -f32(X[a, a], sum(f32(A[a, m], X[m, c]) for m in range(c, a)))
    G_last = _last(G[-1])
    beta_v = [beta[c][:, None] * rows(v_ref, c).astype(jnp.float32) for c in range(nb)]
    beta_k = [(beta[c] * jnp.exp(G[c]))[:, None] * k[c] for c in range(nb)]
    for a in range(nb):
        at = pl.ds(a * SUB, SUB)
        u_ref[at, :] = sum(_dot(X[a, c], beta_v[c], dt, precision) for c in range(a + 1)).astype(u_ref.dtype)
        w_ref[at, :] = sum(_dot(X[a, c], beta_k[c], dt, precision) for c in range(a + 1)).astype(w_ref.dtype)
        kd_ref[at, :] = (k[a] * jnp.exp(G_last - G[a])[:, None]).astype(kd_ref.dtype)


def _state_kernel(u_ref, w_ref, kd_ref, G_ref, s0_ref, h_ref, v_new_ref, s_ref, *, chunk: int, dt, precision):
    """One (row, value head, block of BV value columns) walks the chunks in order with its
    [dk, BV] state in float32 registers, two dots a chunk: it writes the state each chunk
    starts from (h) and the chunk's values after the state's reads (v_new)."""

    def one_chunk(n, s):
        at = pl.ds(n * chunk, chunk)
        h_ref[n] = s.astype(h_ref.dtype)
        v_new = u_ref[at, :].astype(jnp.float32) - _dot(w_ref[at, :], s, dt, precision)
        v_new_ref[at, :] = v_new.astype(v_new_ref.dtype)
        return s * jnp.exp(_last(G_ref[at])) + _dot(kd_ref[at, :].T, v_new, dt, precision)

    s_ref[...] = jax.lax.fori_loop(0, h_ref.shape[0], one_chunk, s0_ref[...].astype(jnp.float32))


def _output_kernel(q_ref, k_ref, G_ref, h_ref, v_new_ref, o_ref, *, dt, precision):
    """One (row, value head, chunk), all chunks in parallel: the state's part q exp(G) h plus the
    chunk's own causal part (q k^T decay) v_new."""
    q = _normalise_rows(q_ref[...]) * q_ref.shape[-1] ** -0.5
    k = _normalise_rows(k_ref[...])
    G = G_ref[...]
    intra = _dot(q, k.T, dt, precision) * _decay(G, G, True, strict=False)
    o = _dot(q * jnp.exp(G)[:, None], h_ref[...], dt, precision) + _dot(intra, v_new_ref[...], dt, precision)
    o_ref[...] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("operands", "block_v", "state_stages", "interpret"))
def gdn_chunked_pallas(q, k, v, g, beta, state, *, operands=jnp.float32, block_v: int = 64,
                       state_stages: int = 2, interpret: bool = False):
    """The Pallas kernels; same arguments and results as `gdn_chunked_reference`. dk, dv and
    block_v must be powers of two, >= 16 (block_v is capped at dv). state_stages is Triton's
    software-pipelining depth for the sequential kernel's loads (2 measured fastest).

    `operands` is the dtype the dots read (accumulation is always float32): float32 (TF32x3 on
    the GPU, exact in interpret mode) or bfloat16 (flash-linear-attention's choice, which also
    stores U, W, the chunk states and v_new in bfloat16). Three launches, split the way
    flash-linear-attention splits the work: chunk-parallel WY (the triangular solves), the
    sequential state walk (two dots a chunk), chunk-parallel outputs.
    """
    B, T, nk, dk = q.shape
    nv, dv = v.shape[2], v.shape[3]
    r, Tp = nv // nk, -(-T // CHUNK) * CHUNK
    n = Tp // CHUNK
    block_v = min(block_v, dv)
    if dv % block_v:  # a partial last block of value columns would be left unwritten
        raise ValueError(f"block_v={block_v} must divide the value head dim {dv}")
    dt = jnp.dtype(operands)
    precision = jax.lax.Precision.HIGHEST if interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    kw = dict(dt=dt, precision=precision)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
    q, k, v = pad(q), pad(k), pad(v)  # [B, Tp, heads, d]: read in place, chunk rows strided by heads
    g, beta = (jnp.moveaxis(pad(x.astype(jnp.float32)), 2, 1) for x in (g, beta))  # [B, nv, Tp]
    G = jnp.cumsum(g.reshape(B, nv, n, CHUNK), axis=-1).reshape(B, nv, Tp)  # within-chunk cumulative decay
    params = lambda stages: plt.CompilerParams(num_warps=4, num_stages=stages)

    # chunk-parallel grid (row * value head, chunk)
    token_major = lambda d, by_key: pl.BlockSpec(
        (None, CHUNK, None, d), lambda bh, c: (bh // nv, c, (bh % nv) // r if by_key else bh % nv, 0))
    head_major = lambda d: pl.BlockSpec((None, None, CHUNK, d), lambda bh, c: (bh // nv, bh % nv, c, 0))
    gate = pl.BlockSpec((None, None, CHUNK), lambda bh, c: (bh // nv, bh % nv, c))
    inter = lambda d: jax.ShapeDtypeStruct((B, nv, Tp, d), dt)
    u, w, kd = pl.pallas_call(
        functools.partial(_wy_kernel, **kw),
        out_shape=[inter(dv), inter(dk), inter(dk)],
        grid=(B * nv, n),
        in_specs=[token_major(dk, True), token_major(dv, False), gate, gate],
        out_specs=[head_major(dv), head_major(dk), head_major(dk)],
        compiler_params=params(1), interpret=interpret, name="gdn_chunked_wy",
    )(k, v, G, beta)

    # sequential grid (row * value head, block of value columns)
    all_tokens = lambda d: pl.BlockSpec((None, None, Tp, d), lambda bh, iv: (bh // nv, bh % nv, 0, 0))
    value_cols = pl.BlockSpec((None, None, Tp, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, iv))
    by_state = pl.BlockSpec((None, None, dk, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, iv))
    h, v_new, final = pl.pallas_call(
        functools.partial(_state_kernel, chunk=CHUNK, **kw),
        out_shape=[jax.ShapeDtypeStruct((B, nv, n, dk, dv), dt), inter(dv), jax.ShapeDtypeStruct(state.shape, jnp.float32)],
        grid=(B * nv, dv // block_v),
        in_specs=[value_cols, all_tokens(dk), all_tokens(dk),
                  pl.BlockSpec((None, None, Tp), lambda bh, iv: (bh // nv, bh % nv, 0)), by_state],
        out_specs=[pl.BlockSpec((None, None, n, dk, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, 0, iv)),
                   value_cols, by_state],
        compiler_params=params(state_stages), interpret=interpret, name="gdn_chunked_state",
    )(u, w, kd, G, state.astype(jnp.float32))

    o = pl.pallas_call(
        functools.partial(_output_kernel, **kw),
        out_shape=jax.ShapeDtypeStruct((B, Tp, nv, dv), jnp.float32),
        grid=(B * nv, n),
        in_specs=[token_major(dk, True), token_major(dk, True), gate,
                  pl.BlockSpec((None, None, None, dk, dv), lambda bh, c: (bh // nv, bh % nv, c, 0, 0)), head_major(dv)],
        out_specs=token_major(dv, False),
        compiler_params=params(1), interpret=interpret, name="gdn_chunked_output",
    )(q, k, G, h, v_new)
    return o[:, :T], final


def kernel_fits(q, v) -> bool:
    """Shapes the Triton kernels take: dk and dv powers of two, at least 16 (Triton's smallest dot)."""
    return all(d == next_pow2(d) and d >= 16 for d in (q.shape[-1], v.shape[-1]))


def gdn_chunked(q, k, v, g, beta, state):
    """Dispatcher for the chunked gated delta rule (see `gdn_chunked_reference`): on a GPU the
    Pallas kernels, the reference elsewhere. A bfloat16 model's dots read bfloat16 operands, as
    flash-linear-attention's do (at 4k tokens about 6x faster than XLA's reference, 3.7e-3
    relative to it; on GPU time about 1.35x slower than FLA, measured before the diagonal blocks
    shared one loop; BENCHMARKS.md); a float32 model keeps float32 operands (TF32x3)."""
    if jax.default_backend() == "gpu" and kernel_fits(q, v):
        operands = jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32
        return gdn_chunked_pallas(q, k, v, g, beta, state, operands=operands)
    return gdn_chunked_reference(q, k, v, g, beta, state)
