"""What z-lab's DFlash2 drafters add to DFlash (`DFlash2DraftModel`): a grouped dynamic causal
convolution along the block before and after each layer's attention and MLP, and a candidate
selector that re-ranks the top-k of each block position's logits by the token chosen before it.

Convolution (`attention_conv`, `mlp_conv` of each layer): `kernel_projection` [2 * taps * G, H]
maps the sub-layer's input to two sets of per-group coefficients, `base_kernel` [2, taps, H] adds
a per-channel base; set 0 convolves the input ("prepare"), set 1 the sub-layer's output
("finish"): out[t] = sum_o (base[o] + coef[t, o, group]) * x[t - o], zero before the block's
first position.

Selector (`candidate_selector`): `hidden_projection` [r, H], `predecessor_codebook` and
`successor_codebook` [V, r] (stored without `.weight`). Position j scores its top-k candidates c
by unary logit + sum_r P[prev][r] * hp[j][r] * S[c][r], prev the token chosen at j - 1 (the
anchor for j = 0), and picks among them (argmax, or sampled from the scores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import Linear


class GroupedDynamicConv(nnx.Module):
    """A causal convolution of `taps` along the block, its kernel per position and channel group."""

    def __init__(self, hidden: int, taps: int, group_size: int, *, stack=(), dtype=jnp.float32):
        if hidden % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden}")
        self.taps, self.group_size = taps, group_size
        self.base_kernel = nnx.Param(jnp.zeros((*stack, 2, taps, hidden), dtype))
        self.kernel_projection = Linear(hidden, 2 * taps * (hidden // group_size), stack=stack, dtype=dtype)

    def _convolve(self, x, coef, side: int):
        """x [B, T, H], coef [B, T, taps, G] -> [B, T, H]."""
        base = self.base_kernel[...][side]
        out = jnp.zeros_like(x)
        for o in range(self.taps):
            shifted = jnp.pad(x[:, : x.shape[1] - o], ((0, 0), (o, 0), (0, 0)))
            kernel = base[o] + jnp.repeat(coef[:, :, o], self.group_size, axis=-1)
            out = out + kernel.astype(x.dtype) * shifted
        return out

    def prepare(self, x):
        """x [B, T, H] -> (its convolution, the coefficients `finish` uses)."""
        B, T, H = x.shape
        coef = self.kernel_projection(x).reshape(B, T, 2, self.taps, H // self.group_size)
        return self._convolve(x, coef[:, :, 0], 0), coef[:, :, 1]

    def finish(self, x, coef):
        return self._convolve(x, coef, 1)


class CandidateSelector(nnx.Module):
    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int, *, dtype=jnp.float32):
        self.top_k = top_k
        self.hidden_projection = Linear(hidden, rank, dtype=dtype)
        self.predecessor_codebook = nnx.Param(jnp.zeros((vocab, rank), dtype))
        self.successor_codebook = nnx.Param(jnp.zeros((vocab, rank), dtype))

    def candidates(self, logits):
        """logits [B, T, V] -> (unary logits, token ids) of the top k, [B, T, k] each."""
        return jax.lax.top_k(logits, self.top_k)

    def scores(self, prev, hidden_j, unary_j, cand_j):
        """prev [B] the token before, hidden_j [B, r] (projected), unary_j / cand_j [B, k] ->
        float32 scores of the candidates [B, k]."""
        pred = self.predecessor_codebook[...][prev].astype(jnp.float32) * hidden_j.astype(jnp.float32)
        succ = self.successor_codebook[...][cand_j].astype(jnp.float32)
        return unary_j + jnp.einsum("br,bkr->bk", pred, succ)
