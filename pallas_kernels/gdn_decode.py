"""One decode token of a Gated DeltaNet layer in one kernel, from its projections to its output.

Per row and value head h (key head h // (nv // nk)), with the layer's K-tap window:
    u = silu(sum_s seq[s] * conv_w[:, s])           short causal convolution, per channel
    q, k, v = u's channel parts; q, k L2-normalised (q also scaled by dk^-1/2)
    beta = sigmoid(b_h);  g = -exp(A_log_h) * softplus(a_h + dt_bias_h)
    S = exp(g) * S;  S = S + k (beta (v - S^T k))^T;  o = S^T q
A row that is not valid this step (a finished or padding row) gets g = beta = 0: its state stays.

Unfused, XLA runs this as about ten small kernels a layer (the convolution, the two gates, the
norms, the head repeat, the recurrence's reductions), each a launch of ~2 us around < 1 us of
work; at batch 1 they cost more than the layer's weight reads. One program per (row, value head,
block of value columns) recomputes its key head's q and k (a few hundred multiply-adds) rather
than share them, so no program waits on another. The token's projections and the conv window are
read where they lie (the projection matmul's output, the cache), and the next window is written by
one program per channel, so nothing is joined or gathered around the kernel. The model's unfused
path is the reference.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.batch_invariant import invariant_rows
from pallas_kernels.gdn_common import L2_EPS

BLOCK_V = 32  # value columns a program: its [dk, 32] float32 state tile stays in registers


def _conv_silu(rows: list, w_ref) -> jax.Array:
    """rows: the K inputs [n] (the window then the token), w [n, K] -> silu of the K-tap
    convolution, [n] float32."""
    acc = sum(row.astype(jnp.float32) * w_ref[:, s].astype(jnp.float32) for s, row in enumerate(rows))
    return acc * jax.nn.sigmoid(acc)


def _window(conv_ref, win_ref, new_ref, g, row, start, width: int, keep, writes) -> list:
    """The K inputs of channels [start, start + width) of `row`: repeat g's window in conv [G, B,
    K-1, C] then the token's new_ref [width]. Where `writes`, stores the row's next window (shifted
    by the token where `keep`, as it was otherwise) into win [B, K-1, C]: one program a channel."""
    taps = conv_ref.shape[2] + 1
    old = [conv_ref[g, row, s, pl.ds(start, width)] for s in range(taps - 1)]
    rows = old + [new_ref[...].astype(old[0].dtype)]
    mask = jnp.broadcast_to(writes, (width,))
    for s in range(taps - 1):
        plt.store(win_ref.at[row, jnp.int32(s), pl.ds(start, width)], jnp.where(keep, rows[s + 1], rows[s]), mask=mask)
    return rows


def _decode_kernel(q_new, k_new, v_new, q_w, k_w, v_w, b_ref, a_ref, a_log_ref, dt_bias_ref, valid_ref, g_ref,
                   conv_ref, s0_ref, o_ref, s_ref, win_ref, *, nv: int, nk: int, bv: int):
    """One (row, value head, value block): the token's q, k, v parts [dk] / [BV] and weights
    [dk, K] / [BV, K], b, a, valid [1], A_log, dt_bias [1], g [1]; the windows conv [G, B, K-1, C]
    and the states s0 = s [G, B, nv, dk, dv] whole (the states one aliased buffer), of which this
    program reads and writes the tile [g, row, head, :, block]. The first program of a key head
    writes its q and k channels' next window, each program its v block's."""
    bh, iv = pl.program_id(0), pl.program_id(1)
    row, head, g = bh // nv, bh % nv, g_ref[0]
    dk = q_new.shape[0]
    key_head = head // (nv // nk)
    valid = valid_ref[...]
    keep = valid_ref[0] > 0
    first = (head % (nv // nk) == 0) & (iv == 0)
    window = functools.partial(_window, conv_ref, win_ref, g=g, row=row, keep=keep)
    q = _conv_silu(window(q_new, start=key_head * dk, width=dk, writes=first), q_w)
    k = _conv_silu(window(k_new, start=(nk + key_head) * dk, width=dk, writes=first), k_w)
    v = _conv_silu(window(v_new, start=2 * nk * dk + head * s0_ref.shape[-1] + iv * bv, width=bv, writes=True), v_w)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * (dk ** -0.5)
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    beta = jax.nn.sigmoid(b_ref[...].astype(jnp.float32)) * valid
    decay = -jnp.exp(a_log_ref[...]) * jax.nn.softplus(a_ref[...].astype(jnp.float32) + dt_bias_ref[...]) * valid
    tile = (g, row, head, slice(None), pl.ds(iv * bv, bv))
    s = s0_ref[tile].astype(jnp.float32) * jnp.exp(decay)
    delta = (v - jnp.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    o_ref[...] = jnp.sum(s * q[:, None], axis=0)
    s_ref[tile] = s.astype(s_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_k_heads", "gates_at", "interpret"))
def gdn_decode_pallas(proj, conv, conv_w, A_log, dt_bias, valid, states, g, *, num_k_heads: int,
                      gates_at: tuple[int, int], interpret: bool = False):
    """The fused decode token, updating repeat g's state in place in the stacked states: the kernel
    reads and writes its tiles of that one buffer (aliased), so no slice of the states is copied out
    or written back, which at batch 32 would move each layer's whole state twice more a step. It
    reads the projections and the conv window where they lie (no joined copy a layer) and returns
    the next window for the caller to store.

    Args:
      proj: [B, W] the token's projections: its conv inputs, channels [q (nk*dk) | k (nk*dk) |
        v (nv*dv)], first, then anything, with b and a (the write-strength and decay
        projections, [nv] each) at channels gates_at[0] and gates_at[1] on.
      conv: [G, B, K-1, C] the conv windows (pre-conv inputs, oldest first); repeat g's is read.
      conv_w: [C, K] the depthwise convolution's taps. A_log, dt_bias: [nv] float32.
      valid: [B] bool, rows whose token counts this step.
      states: [G, B, nv, dk, dv] the layer's pattern position's states (donate them), in the
        cache's dtype: float32, or bfloat16 / float16 (read into float32, written back rounded).
      g: int32 scalar, the repeat whose state this layer holds.
      num_k_heads: nk.
    Returns:
      o [B, nv, dv] float32, the states with repeat g's advanced [G, B, nv, dk, dv], and repeat
      g's next conv window [B, K-1, C] in conv's dtype (a row not valid keeps its window).
    """
    B = proj.shape[0]
    _, _, nv, dk, dv = states.shape
    nk, bv = num_k_heads, BLOCK_V
    r, v_block0 = nv // nk, 2 * nk * dk // bv
    b_at, a_at = gates_at

    def per_head(x):  # [..., nv] -> [..., nv, 1] float32: a size-1 block per program
        return x.astype(jnp.float32).reshape(*x.shape, 1)

    # Each operand's channel block, in units of its block width: q's and k's key head, v's columns.
    def q_block(bh, iv):
        return (bh % nv) // r

    def k_block(bh, iv):
        return nk + (bh % nv) // r

    def v_block(bh, iv):
        return v_block0 + (bh % nv) * (dv // bv) + iv

    def token(width, block):
        return pl.BlockSpec((None, width), lambda bh, iv: (bh // nv, block(bh, iv)))

    def taps(width, block):
        return pl.BlockSpec((width, conv_w.shape[1]), lambda bh, iv: (block(bh, iv), 0))

    def gate(at):  # a size-1 block, so its block index is the channel
        return pl.BlockSpec((None, 1), lambda bh, iv: (bh // nv, at + bh % nv))

    head = pl.BlockSpec((None, 1), lambda bh, iv: (bh % nv, 0))
    row = pl.BlockSpec((None, 1), lambda bh, iv: (bh // nv, 0))
    whole = lambda shape: pl.BlockSpec(shape, lambda bh, iv: (0,) * len(shape))  # noqa: E731  (indexed in-kernel)
    in_specs = [token(dk, q_block), token(dk, k_block), token(bv, v_block),
                taps(dk, q_block), taps(dk, k_block), taps(bv, v_block),
                gate(b_at), gate(a_at), head, head, row, whole((1,)), whole(conv.shape), whole(states.shape)]
    window_shape = conv.shape[1:]
    out_specs = [pl.BlockSpec((None, None, bv), lambda bh, iv: (bh // nv, bh % nv, iv)), whole(states.shape),
                 whole(window_shape)]
    out_shape = [jax.ShapeDtypeStruct((B, nv, dv), jnp.float32), jax.ShapeDtypeStruct(states.shape, states.dtype),
                 jax.ShapeDtypeStruct(window_shape, conv.dtype)]
    return pl.pallas_call(
        functools.partial(_decode_kernel, nv=nv, nk=nk, bv=bv),
        out_shape=out_shape,
        grid=(B * nv, dv // bv),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases={13: 1},
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gdn_decode",
    )(proj, proj, proj, conv_w, conv_w, conv_w, proj, proj, per_head(A_log), per_head(dt_bias),
      per_head(valid), jnp.asarray(g, jnp.int32).reshape(1), conv, states)


def use_decode_kernel(tokens: int, taps: int, state: jax.Array, shards: int) -> bool:
    """Whether a GDN layer's pass of `tokens` tokens with a `taps`-tap convolution and states
    [..., dk, dv] runs `gdn_decode_pallas`: one token, on a GPU, on one device, outside
    batch-invariant mode, at power-of-two taps and dk and dv a multiple of BLOCK_V (Triton's
    block rule)."""
    dk, dv = state.shape[-2:]
    return (tokens == 1 and jax.default_backend() == "gpu" and shards == 1 and invariant_rows() is None
            and is_pow2(taps) and is_pow2(dk) and dv % BLOCK_V == 0)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
