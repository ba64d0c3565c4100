"""Gated delta rule, one token at a time: decode (T = 1) and speculative verify (T = k + 1).

Per value head, with state S [dk, dv] computed in float32:
    S = exp(g_t) * S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
q and k are L2-normalised (q also scaled by dk^-1/2) inside the op. The state comes and goes in
its cache's dtype (float32, or bfloat16 / float16: `mamba_ssm_cache_dtype`); a pass rounds the
state it carries to that dtype after every token (`as_stored`), so a verify pass's token t sees
the state a decode step would have read.

`gdn_recurrent` is the dispatcher the model calls: the Pallas (Triton) kernel on a GPU, the
pure-JAX reference elsewhere. The kernel runs one program per (row, value head, block of BV
value columns): each column of S evolves independently, so the state tile [dk, BV] stays in
float32 registers across the tokens, and q/k normalisation, decay and beta are fused in.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import PartitionSpec as P

from pallas_kernels.batch_invariant import invariant_rows
from pallas_kernels.gdn_common import L2_EPS, as_stored, prepare_qk
from pallas_kernels.tensor_parallel import on_axis, per_device

# Verify passes up to k = 31 drafts run unrolled and in the kernel (DSpark's block 16 verifies
# 17 tokens); past it the rolled scan's per-token kernels cost more than its compile saves.
MAX_UNROLL = 32
# On the CPU a rolled loop launches nothing per token: passes of every length ran as fast or
# faster rolled, and compiled faster (BENCHMARKS.md, "GDN recurrence on the CPU").
CPU_MAX_UNROLL = 1


def unroll_limit() -> int:
    """The most tokens the reference runs unrolled on this backend."""
    return MAX_UNROLL if jax.default_backend() == "gpu" else CPU_MAX_UNROLL


def gdn_recurrent_reference(q, k, v, g, beta, state, *, keep_states: bool = False, unroll: bool | None = None):
    """Pure-JAX recurrent gated delta rule.

    Args:
      q, k: [B, T, nk, dk] (raw, before L2 norm).
      v: [B, T, nv, dv].
      g: [B, T, nv] float32 log-decay (<= 0). beta: [B, T, nv] float32 write strength.
        A padded token has g = 0 and beta = 0, which leaves the state unchanged.
      state: [B, nv, dk, dv], the state before the first token, in its cache's dtype.
      keep_states: also return the state after every token (what speculative rollback selects).
      unroll: run the tokens unrolled (True) or as a loop (False); None: unrolled up to
        `unroll_limit()` tokens.
    Returns:
      o: [B, T, nv, dv] float32; the final state [B, nv, dk, dv]; and, with keep_states,
      the per-token states [B, T, nv, dk, dv] (states in the given state's dtype).
    """
    q, k = prepare_qk(q, k, v.shape[2])
    v = v.astype(jnp.float32)
    stored = state.dtype

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs  # [B, nv, d*], [B, nv]
        s = s * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", s, k_t)
        delta = (v_t - kv_mem) * b_t[..., None]
        s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta)
        o_t = jnp.einsum("bhkv,bhk->bhv", s, q_t)
        s = as_stored(s, stored)
        return s, (o_t, s.astype(stored)) if keep_states else (o_t, None)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
    # Decode and verify run a handful of tokens: unrolled, XLA fuses the steps instead of
    # launching a loop iteration's kernels per token.
    unroll = q.shape[1] <= unroll_limit() if unroll is None else unroll
    final, (o, states) = jax.lax.scan(step, state.astype(jnp.float32), time_major, unroll=unroll)
    o, final = jnp.moveaxis(o, 0, 1), final.astype(stored)
    if keep_states:
        return o, final, jnp.moveaxis(states, 0, 1)
    return o, final


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, repeat_ref, s0_ref, o_ref, *out_refs, T: int, nv: int,
                      stacked: bool, final_state: bool):
    """One (row, value head, value block): q/k [Tp, dk], v [Tp, BV], g/beta [Tp], state [dk, BV]
    (stacked: the whole [G, B, nv, dk, dv] buffer, of which it reads the tile of repeat_ref[0]), in
    the cache's dtype. out_refs: the final state's tile (final_state), then the per-token states
    [Tp, dk, BV]. The tile is carried in float32, rounded to the cache's dtype after each token."""
    if stacked:
        bh, iv = pl.program_id(0), pl.program_id(1)
        bv = o_ref.shape[-1]
        s = s0_ref[repeat_ref[0], bh // nv, bh % nv, :, pl.ds(iv * bv, bv)].astype(jnp.float32)
    else:
        s = s0_ref[...].astype(jnp.float32)
    states_ref = out_refs[1:] if final_state else out_refs
    scale = q_ref.shape[-1] ** -0.5
    for t in range(T):  # T is small and static: unrolled
        q_t = q_ref[t, :].astype(jnp.float32)
        k_t = k_ref[t, :].astype(jnp.float32)
        q_t = q_t * jax.lax.rsqrt(jnp.sum(q_t * q_t) + L2_EPS) * scale
        k_t = k_t * jax.lax.rsqrt(jnp.sum(k_t * k_t) + L2_EPS)
        s = s * jnp.exp(g_ref[t])
        delta = (v_ref[t, :].astype(jnp.float32) - jnp.sum(s * k_t[:, None], axis=0)) * beta_ref[t]
        s = s + k_t[:, None] * delta[None, :]
        o_ref[t, :] = jnp.sum(s * q_t[:, None], axis=0).astype(o_ref.dtype)
        s = as_stored(s, s0_ref.dtype)
        if states_ref:
            states_ref[0][t, :, :] = s.astype(states_ref[0].dtype)
    if final_state:
        out_refs[0][...] = s.astype(out_refs[0].dtype)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("keep_states", "final_state", "block_v", "interpret"))
def gdn_recurrent_pallas(q, k, v, g, beta, state, repeat=None, *, keep_states: bool = False, final_state: bool = True,
                         block_v: int = 32, interpret: bool = False):
    """The Pallas kernel; same arguments and results as `gdn_recurrent_reference`. The final state
    is written over the state operand (aliased): where the caller no longer needs the old state (a
    commit's replay) no copy of it is made; where it does, XLA copies it first. A verify pass that
    discards the final state (final_state=False) reads repeat `repeat`'s tiles of the stacked
    states [G, B, nv, dk, dv] in place, so no slice of them is copied out.

    dk and block_v must be powers of two and block_v must divide dv (Triton's block rule); T is
    padded to a power of two with g = beta = 0 tokens, which leave the state unchanged.
    """
    B, T, nk, dk = q.shape
    nv, dv = v.shape[2], v.shape[3]
    stacked = repeat is not None
    if stacked and final_state:
        raise ValueError("gdn_recurrent_pallas reads a stacked state in place only when the final state is discarded")
    r, Tp = nv // nk, next_pow2(T)
    def pad(x):
        return jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
    def head_major(x):
        return jnp.moveaxis(pad(x), 2, 1)  # [B, T, H, ...] -> [B, H, Tp, ...]
    q, k, v = head_major(q), head_major(k), head_major(v)
    g, beta = head_major(g.astype(jnp.float32)), head_major(beta.astype(jnp.float32))
    grid = (B * nv, dv // block_v)
    by_key_head = pl.BlockSpec((None, None, Tp, dk), lambda bh, iv: (bh // nv, (bh % nv) // r, 0, 0))
    by_value = pl.BlockSpec((None, None, Tp, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, iv))
    by_head = pl.BlockSpec((None, None, Tp), lambda bh, iv: (bh // nv, bh % nv, 0))
    by_state = pl.BlockSpec((None, None, dk, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, iv))
    whole = lambda shape: pl.BlockSpec(shape, lambda bh, iv: (0,) * len(shape))  # noqa: E731  (indexed in-kernel)
    out_shape, out_specs = [jax.ShapeDtypeStruct((B, nv, Tp, dv), jnp.float32)], [by_value]
    if final_state:
        out_shape.append(jax.ShapeDtypeStruct(state.shape, state.dtype))
        out_specs.append(by_state)
    if keep_states:
        out_shape.append(jax.ShapeDtypeStruct((B, nv, Tp, dk, dv), state.dtype))
        out_specs.append(pl.BlockSpec((None, None, Tp, dk, block_v), lambda bh, iv: (bh // nv, bh % nv, 0, 0, iv)))
    repeat = jnp.asarray(0 if repeat is None else repeat, jnp.int32).reshape(1)
    outs = pl.pallas_call(
        functools.partial(_recurrent_kernel, T=T, nv=nv, stacked=stacked, final_state=final_state),
        out_shape=out_shape,
        grid=grid,
        in_specs=[by_key_head, by_key_head, by_value, by_head, by_head, whole((1,)),
                  whole(state.shape) if stacked else by_state],
        out_specs=out_specs,
        input_output_aliases={6: 1} if final_state else {},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_recurrent",
    )(q, k, v, g, beta, repeat, state)
    o = jnp.moveaxis(outs[0], 1, 2)[:, :T]
    final = outs[1] if final_state else None
    if keep_states:
        return o, final, jnp.moveaxis(outs[-1], 1, 2)[:, :T]
    return o, final


def kernel_fits(q, v) -> bool:
    """Shapes the Triton kernel takes: power-of-two dk, dv a multiple of its 32-wide blocks."""
    dk, dv = q.shape[-1], v.shape[-1]
    return dk == next_pow2(dk) and dv % 32 == 0 and q.shape[1] <= MAX_UNROLL


# Measured on the H200 (bench/kernels.py, BENCHMARKS.md): the kernel beats XLA's fused unrolled
# scan on verify passes of 4+ tokens that keep no per-token states (1.11-1.36x in 5 of 6 head
# layouts), and loses on single-token decode and when every state is written out.
KERNEL_MIN_TOKENS = 4
# Past this many state bytes (about 10 rows at 27B dims) the kernel runs passes of any length:
# the unrolled scan's separate kernels each stream the whole state, the kernel reads it once.
KERNEL_MIN_STATE_BYTES = 32 << 20


def gdn_recurrent(q, k, v, g, beta, state, *, keep_states: bool = False):
    """Dispatcher for the recurrent gated delta rule (see `gdn_recurrent_reference`): the Pallas
    kernel on a GPU where it measured faster, the reference otherwise; under a tensor-parallel
    mesh, per device on the heads it holds (value head j reads key head j // (nv // nk), so a
    device holding a contiguous block of both has all it needs). In batch-invariant mode every
    token of every pass runs the same code: the kernel's unrolled step on a GPU
    (`gdn_recurrent_fixed_order`; XLA may pick its einsums' algorithms per program and per batch
    size), the rolled reference's step elsewhere."""
    heads, gates, state_spec = on_axis(4, 2), on_axis(3, 2), on_axis(4, 1)
    out_specs = (heads, state_spec) + ((on_axis(5, 2),) if keep_states else ())
    local = functools.partial(_gdn_recurrent_local, keep_states=keep_states)
    return per_device(local, (heads, heads, heads, gates, gates, state_spec), out_specs)(q, k, v, g, beta, state)


def gdn_verify(q, k, v, g, beta, states, repeat, *, keep_states: bool = False):
    """A verify pass from repeat `repeat` (int32 scalar) of the stacked states [G, B, nv, dk, dv],
    which it leaves as they are (the caller commits a prefix of it later); the other arguments as
    `gdn_recurrent`'s. Returns (o [B, T, nv, dv] float32,) and, with keep_states, the per-token
    states [B, T, nv, dk, dv]. Where the kernel runs it reads the repeat's tiles in place: at
    batch 32 a copy of each layer's state out of the stack costs as much as the pass reading it."""
    heads, gates = on_axis(4, 2), on_axis(3, 2)
    out_specs = (heads,) + ((on_axis(5, 2),) if keep_states else ())
    local = functools.partial(_gdn_verify_local, keep_states=keep_states)
    return per_device(local, (heads, heads, heads, gates, gates, on_axis(5, 2), P()), out_specs)(
        q, k, v, g, beta, states, jnp.asarray(repeat, jnp.int32))


def _gdn_verify_local(q, k, v, g, beta, states, repeat, *, keep_states: bool):
    if not keep_states and _kernel_wins(q, v, states.size // states.shape[0] * states.dtype.itemsize):
        return (gdn_recurrent_pallas(q, k, v, g, beta, states, repeat, final_state=False)[0],)
    out = _gdn_recurrent_local(q, k, v, g, beta, jax.lax.dynamic_index_in_dim(states, repeat, keepdims=False),
                               keep_states=keep_states)
    return (out[0], out[2]) if keep_states else (out[0],)


def _kernel_wins(q, v, state_bytes: int) -> bool:
    """Whether a pass that keeps no per-token states, from a state of state_bytes, runs the kernel
    (outside batch-invariant mode)."""
    long_or_wide = q.shape[1] >= KERNEL_MIN_TOKENS or state_bytes >= KERNEL_MIN_STATE_BYTES
    return jax.default_backend() == "gpu" and invariant_rows() is None and long_or_wide and kernel_fits(q, v)


def gdn_recurrent_fixed_order(q, k, v, g, beta, state, *, keep_states: bool = False, interpret: bool = False):
    """The kernel over passes of any length, in chunks of MAX_UNROLL tokens (the last padded with
    g = beta = 0 tokens, which leave the state as it is): batch-invariant mode on a GPU. The kernel
    runs every token through the same unrolled code, each row in programs of its own, so a token's
    output does not depend on how many tokens or rows share its pass. Same arguments and results
    as `gdn_recurrent_reference`."""
    B, T = q.shape[:2]
    if T <= MAX_UNROLL:
        return gdn_recurrent_pallas(q, k, v, g, beta, state, keep_states=keep_states, interpret=interpret)
    n = -(-T // MAX_UNROLL)
    chunks = lambda x: jnp.moveaxis(  # noqa: E731  [B, T, ...] -> [n, B, MAX_UNROLL, ...]
        jnp.pad(x, [(0, 0), (0, n * MAX_UNROLL - T)] + [(0, 0)] * (x.ndim - 2)).reshape(
            B, n, MAX_UNROLL, *x.shape[2:]), 1, 0)
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, n * MAX_UNROLL, *x.shape[3:])[:, :T]  # noqa: E731

    def chunk(s, xs):
        out = gdn_recurrent_pallas(*xs, s, keep_states=keep_states, interpret=interpret)
        return out[1], (out[0], out[2] if keep_states else None)

    final, (o, states) = jax.lax.scan(chunk, state, tuple(chunks(x) for x in (q, k, v, g, beta)))
    return (unchunk(o), final, unchunk(states)) if keep_states else (unchunk(o), final)


def _gdn_recurrent_local(q, k, v, g, beta, state, *, keep_states: bool):
    on_gpu = jax.default_backend() == "gpu"
    if invariant_rows() is not None:  # one unrolled code for every token, whatever its pass
        if on_gpu and kernel_fits(q[:, :1], v):
            return gdn_recurrent_fixed_order(q, k, v, g, beta, state, keep_states=keep_states)
        return gdn_recurrent_reference(q, k, v, g, beta, state, keep_states=keep_states, unroll=False)
    if not keep_states and _kernel_wins(q, v, state.size * state.dtype.itemsize):
        return gdn_recurrent_pallas(q, k, v, g, beta, state)
    return gdn_recurrent_reference(q, k, v, g, beta, state, keep_states=keep_states)
