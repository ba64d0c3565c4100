"""N-gram (prompt-lookup) drafting, vLLM's rule, on device.

Each row looks up its own last n tokens earlier in its own context and proposes what came
after. vLLM does this on the CPU with a capped KMP scan over the reversed tokens; here it is one
shifted [B, L] comparison per offset j < n_max, unrolled (the window is a few tokens), so the
shifts are static slices XLA fuses with the comparisons into a few elementwise passes: fixed
shapes, O(B * L) live memory, no gather over the buffer.

Let p be the END of a candidate occurrence (its last token). The occurrence of length n that
ends at p equals the row's suffix iff tokens[p - j] == tokens[len - 1 - j] for every j < n,
so the length-n match mask is the length-(n-1) mask AND one more shifted comparison.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def ngram_propose(
    tokens: jax.Array, lengths: jax.Array, *, k: int, n_min: int, n_max: int
) -> tuple[jax.Array, jax.Array]:
    """Propose up to k draft tokens per row by suffix n-gram lookup (vLLM's ngram proposer).

    Args:
      tokens: [B, L] int32. Row b's context is tokens[b, :lengths[b]]; the rest is padding
        with arbitrary values, never read as a match and never proposed.
      lengths: [B] int32, each >= 1 and <= L.
      k: static number of draft slots. n_min, n_max: static bounds, 1 <= n_min <= n_max.
    Returns:
      drafts: [B, k] int32, the proposed tokens; slots at or past n_draft are 0.
      n_draft: [B] int32 in 0..k.

    Rule: take the longest n in [n_min, n_max] such that the row's last n tokens also occur
    at some start i with i + n < length (an earlier occurrence, overlap allowed, not the
    suffix itself); among those occurrences take the earliest i. The drafts are
    tokens[i + n : i + n + k] cut at the row's length, so n_draft = min(k, length - i - n).
    No match (including length < n_min + 1) gives n_draft = 0.
    """
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
    tokens = tokens.astype(jnp.int32)
    lengths = lengths.astype(jnp.int32)
    B, L = tokens.shape
    pos = jnp.arange(L, dtype=jnp.int32)[None, :]  # candidate end p
    last = lengths[:, None] - 1

    # An occurrence ending at p must end before the suffix's last token: p <= len - 2. No
    # occurrence is longer than the buffer, so the window stops there.
    match = pos <= last - 1
    best_end, found = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool)
    for j in range(min(n_max, L)):
        suffix_tok = jnp.take_along_axis(tokens, jnp.maximum(last - j, 0), axis=1)  # [B, 1]
        shifted = jnp.pad(tokens, ((0, 0), (j, 0)))[:, :L]  # shifted[:, p] = tokens[:, p - j]
        match = match & (pos >= j) & (shifted == suffix_tok)
        # A longer n = j + 1 overrides; the first True is the earliest end, hence earliest start.
        hit = match.any(axis=1) & (j + 1 >= n_min)
        best_end = jnp.where(hit, jnp.argmax(match, axis=1).astype(jnp.int32), best_end)
        found = found | hit

    start = best_end + 1  # first token after the occurrence (i + n)
    n_draft = jnp.where(found, jnp.minimum(k, lengths - start), 0).astype(jnp.int32)
    slot = jnp.arange(k, dtype=jnp.int32)[None, :]
    idx = jnp.minimum(start[:, None] + slot, L - 1)
    drafts = jnp.where(slot < n_draft[:, None], jnp.take_along_axis(tokens, idx, axis=1), 0)
    return drafts, n_draft


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """Prompt lookup as a proposer (stateless; see `ngram_propose`)."""

    k: int
    n_min: int
    n_max: int
    may_not_draft = True  # a step can find no match in any row: the engine then skips the verify

    def with_drafts(self, n: int) -> NgramProposer:
        return dataclasses.replace(self, k=n)  # k only cuts the tokens copied after the match

    def init_state(self, model, draft, tokens, lengths, target, choose):
        return ()

    def propose(self, model, draft, state, tokens, lengths, choose):
        drafts, n_draft = ngram_propose(tokens, lengths, k=self.k, n_min=self.n_min, n_max=self.n_max)
        return drafts, n_draft, None, state

    def update(self, model, draft, state, target, emitted, n_acc, lengths, choose):
        return state
