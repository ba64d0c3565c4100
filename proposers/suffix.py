"""Suffix decoding (vLLM's method "suffix", after ArcticInference's suffix trees), on device.

vLLM keeps two suffix trees on the host: one over the request's prompt and output, one over the
outputs of recent requests (FIFO, at most `max_cached_requests`), both cut at `max_tree_depth`
tokens a path. Each step, for every match length m of the row's last tokens that the tree holds,
it walks from the matched node to its most frequent child while the running product of
child count / node count (the estimated probability) stays >= min_token_prob, drafting at most
floor(m * max_spec_factor) tokens and never past the tree's depth (m + drafts <= depth); it keeps
the draft of the highest score (the sum of its tokens' probabilities, the longer match on a tie),
and the cache's draft only where it scores strictly higher than the request's own.

Here the trees are implicit: a node's occurrences are the positions where the matched string
ends, and its count is how many there are. For each source (the row's token buffer, and the
`OutputCache` ring of finished outputs) one chain of shifted comparisons gives every position
its match length with the row's suffix (`match_lengths`, as the ngram proposer does); the
`CANDIDATES` best occurrences (longest match, then latest) are walked for every m at once: at
each draft position the token most of the surviving occurrences continue with is drafted, its
probability is that count over the survivors before it, and the survivors become those that
agree. Counting among candidates is exact while a match occurs at most CANDIDATES times; past
that the walk divides by the exact count but counts votes among the candidates only, so a
probability is never overestimated. No vocabulary-sized array, no host round trip.

The row's own source counts its suffix itself as an occurrence that has not continued yet, as
the request's tree does. Unlike vLLM's cache, `OutputCache` holds finished outputs only (not
those of requests still running) and is bounded in tokens as well as in requests.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from proposers import Shared

# Occurrences walked per match: counts are exact while a match occurs at most this often.
CANDIDATES = 16
SEPARATOR = -1  # between two outputs in the ring, and where nothing was written


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class OutputCache(Shared):
    """The outputs of the last finished requests, end to end in a ring of G token slots.

    tokens: [G] int32, each output followed by SEPARATOR (so no match or draft crosses two);
    entry: [G] int32 the number of the request that wrote each slot (-1: none); head: [] int32
    the next slot written; written: [] int32 requests written so far. A slot is live while its
    request is one of the last `max_requests` written (vLLM's FIFO eviction) and not overwritten.
    An output that wraps past the ring's last slot is matched as two.
    """

    tokens: jax.Array
    entry: jax.Array
    head: jax.Array
    written: jax.Array

    @classmethod
    def empty(cls, slots: int) -> "OutputCache":
        none = jnp.full((slots,), SEPARATOR, jnp.int32)
        return cls(none, none, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))

    def live_tokens(self, max_requests: int) -> jax.Array:
        """[G] the ring's tokens, SEPARATOR where the request that wrote a slot was evicted."""
        live = (self.entry >= 0) & (self.entry >= self.written - max_requests)
        return jnp.where(live, self.tokens, SEPARATOR)

    def add(self, tokens: jax.Array, starts: jax.Array, ends: jax.Array, finished: jax.Array) -> "OutputCache":
        """Append tokens[b, starts[b]:ends[b]] of each finished [B] row, in row order, each with a
        SEPARATOR after it; an output longer than the ring keeps its last G - 1 tokens."""
        B, L = tokens.shape
        G = self.tokens.shape[0]
        size = jnp.where(finished, jnp.minimum(ends - starts, G - 1) + 1, 0)  # tokens kept + separator
        offset = self.head + jnp.cumsum(size) - size  # [B] where each output's first kept token goes
        j = jnp.arange(L)[None, :]
        src = jnp.clip(ends[:, None] - (size[:, None] - 1) + j, 0, L - 1)
        value = jnp.where(j < size[:, None] - 1, jnp.take_along_axis(tokens, src, axis=1), SEPARATOR)
        slot = jnp.where(j < size[:, None], (offset[:, None] + j) % G, G)  # G: dropped
        number = self.written + jnp.cumsum(finished) - 1
        return OutputCache(self.tokens.at[slot].set(value, mode="drop"),
                           self.entry.at[slot].set(jnp.broadcast_to(number[:, None], (B, L)), mode="drop"),
                           (self.head + jnp.sum(size)) % G, self.written + jnp.sum(finished))


def match_lengths(haystack: jax.Array, valid_end: jax.Array, tokens: jax.Array, lengths: jax.Array,
                  longest: int) -> tuple[jax.Array, jax.Array]:
    """How far the text ending at each haystack position matches each row's suffix.

    haystack: [B or 1, N] int32 (SEPARATOR never matches); valid_end: [B or 1, N] bool positions an
    occurrence may end at; tokens [B, L], lengths [B]: the rows; longest: static cap on the match.
    Returns (lengths [B, N] int32 in 0..longest, counts [B, longest] how many positions match at
    least m = 1..longest tokens). A match never reaches past a row's own first token. The chain
    of comparisons is one elementwise expression (one pass over the haystack); the counts come
    from a histogram of the lengths.
    """
    B, N = tokens.shape[0], haystack.shape[1]
    pos = jnp.arange(N, dtype=jnp.int32)[None, :]
    idx = jnp.maximum(lengths[:, None] - 1 - jnp.arange(longest)[None, :], 0)
    suffix = jnp.where(jnp.arange(longest)[None, :] < lengths[:, None] - 1,
                       jnp.take_along_axis(tokens, idx, axis=1), SEPARATOR - 1)  # [B, longest]; never matched
    match = valid_end
    matched = jnp.zeros((B, N), jnp.int32)
    for j in range(longest):
        shifted = jnp.pad(haystack, ((0, 0), (j, 0)), constant_values=SEPARATOR)[:, :N]  # [., p] = [., p - j]
        match = match & (shifted == suffix[:, j:j + 1]) & (pos >= j)
        matched = matched + match
    histogram = jnp.zeros((B, longest + 1), jnp.int32).at[jnp.arange(B)[:, None], matched].add(1)
    counts = jnp.cumsum(histogram[:, :0:-1], axis=1)[:, ::-1]  # [B, longest]: lengths >= m
    return matched, counts


def top_positions(rank: jax.Array, count: int, block: int = 128) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(rank [B, N], count) for distinct ranks, through the `count` blocks of `block`
    positions with the highest maxima (each of the top `count` lies in one of them), so the full
    sort runs over count * block values only. Returns (values [B, count], positions [B, count])."""
    B, N = rank.shape
    if N <= 2 * count * block:
        return jax.lax.top_k(rank, count)
    pad = -N % block
    blocks = jnp.pad(rank, ((0, 0), (0, pad)), constant_values=jnp.iinfo(rank.dtype).min).reshape(B, -1, block)
    _, chosen = jax.lax.top_k(jnp.max(blocks, axis=2), count)  # [B, count]
    within = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(B, count * block)
    values, at = jax.lax.top_k(within, count)
    return values, chosen[jnp.arange(B)[:, None], at // block] * block + at % block


def continuations(haystack: jax.Array, ends: jax.Array, stop: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    """The `steps` tokens after each candidate end, and whether each is there.

    haystack: [B or 1, N]; ends: [B, C] candidate end positions; stop: [B] the first position
    past the text (a row's length; N for the ring). A continuation stops at SEPARATOR.
    Returns (tokens [B, C, steps] int32, present [B, C, steps] bool)."""
    B, C = ends.shape
    N = haystack.shape[1]
    idx = ends[:, :, None] + 1 + jnp.arange(steps)[None, None, :]
    within = idx < stop[:, None, None]
    flat = jnp.broadcast_to(haystack, (B, N))
    tok = jnp.take_along_axis(flat, jnp.clip(idx, 0, N - 1).reshape(B, C * steps), axis=1).reshape(B, C, steps)
    present = jnp.cumprod(within & (tok != SEPARATOR), axis=2).astype(bool)
    return tok, present


def walk(cont: jax.Array, present: jax.Array, matched: jax.Array, counts: jax.Array, extra: int,
         limits: jax.Array, min_prob: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The draft of every match length m = 1..M at once (module docstring).

    cont, present: [B, C, J] each candidate's continuation; matched: [B, C] its match length (0:
    no candidate); counts: [B, M] occurrences of each m; extra: occurrences not among the
    candidates that never continue (the row's own suffix); limits: [M] static most drafts per m.
    Returns (drafts [B, M, J] int32, n [B, M] int32, score [B, M] float32)."""
    B, C, J = cont.shape
    M = counts.shape[1]
    m = jnp.arange(1, M + 1)[None, :, None]
    alive = matched[:, None, :] >= m  # [B, M, C]
    total = (counts + extra).astype(jnp.float32)  # survivors before the first draft, [B, M]
    prob = jnp.ones((B, M), jnp.float32)
    going = counts > 0
    n = jnp.zeros((B, M), jnp.int32)
    score = jnp.zeros((B, M), jnp.float32)
    drafts = []
    for i in range(J):
        tok = cont[:, None, :, i]  # [B, 1, C]
        ok = alive & present[:, None, :, i]
        votes = jnp.sum(ok[..., None, :] & (tok[..., :, None] == tok[..., None, :]), axis=-1)  # [B, M, C]
        votes = jnp.where(ok, votes, 0)
        best = jnp.argmax(votes, axis=-1)  # the first (best ranked) candidate among the most voted
        count = jnp.take_along_axis(votes, best[..., None], axis=-1)[..., 0]
        chosen = jnp.take_along_axis(jnp.broadcast_to(tok, ok.shape), best[..., None], axis=-1)[..., 0]
        prob = prob * (count.astype(jnp.float32) / jnp.maximum(total, 1.0))
        going = going & (count > 0) & (prob >= min_prob) & (i < limits[None, :])
        score = score + jnp.where(going, prob, 0.0)
        n = n + going
        drafts.append(jnp.where(going, chosen, 0))
        alive = ok & (tok == chosen[..., None])
        total = count.astype(jnp.float32)
    return jnp.stack(drafts, axis=-1), n, score


def source_draft(haystack, valid_end, stop, extra, tokens, lengths, *, depth, limits, min_prob, k, candidates):
    """The best draft of one source for each row: (drafts [B, k], n [B], score [B])."""
    M = depth - 1
    matched, counts = match_lengths(haystack, valid_end, tokens, lengths, M)
    N = matched.shape[1]
    C = min(candidates, N)
    rank = jnp.where(matched > 0, matched * N + jnp.arange(N)[None, :], -1)
    top, ends = top_positions(rank, C)
    cand_len = jnp.where(top >= 0, top // N, 0)
    J = max(limits)
    cont, present = continuations(haystack, ends, stop, J)
    drafts, n, score = walk(cont, present, cand_len, counts, extra, jnp.asarray(limits), min_prob)
    # vLLM keeps the best score, the longer match on a tie: the last m at the maximum
    best = M - 1 - jnp.argmax(score[:, ::-1], axis=1)
    pick = lambda x: jnp.take_along_axis(x, best[:, None], axis=1)[:, 0]  # noqa: E731
    out = jnp.take_along_axis(drafts, best[:, None, None], axis=1)[:, 0]
    out = jnp.pad(out, ((0, 0), (0, max(0, k - J))))[:, :k]
    return out, pick(n), pick(score)


def suffix_drafts(tokens: jax.Array, lengths: jax.Array, cache: OutputCache | None, *, k: int, depth: int,
                  spec_factor: float, min_prob: float, max_requests: int,
                  candidates: int = CANDIDATES) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Up to k drafts per row by suffix decoding (module docstring), with their score.

    tokens: [B, L] int32, row b's text tokens[b, :lengths[b]] (the rest never read); lengths [B]
    >= 1; cache: the finished outputs (None: no cache, vLLM's max_cached_requests = 0); k, depth
    (max_tree_depth >= 2 to draft anything), spec_factor, min_prob, max_requests, candidates
    (occurrences walked per source): static.
    Returns (drafts [B, k] int32, 0 past n_draft; n_draft [B] int32 in 0..k; score [B] float32,
    the sum of the drafts' estimated probabilities).
    """
    # the most drafts of match length m: the spec factor, k, and the tree's depth
    limits = tuple(min(k, int(m * spec_factor + 1e-6), depth - m) for m in range(1, depth))
    if not any(limits):  # depth 1 or a spec factor too small to draft after any match
        return jnp.zeros((tokens.shape[0], k), jnp.int32), jnp.zeros_like(lengths), jnp.zeros(lengths.shape)
    args = dict(depth=depth, limits=limits, min_prob=min_prob, k=k, candidates=candidates)
    L = tokens.shape[1]
    own = jnp.arange(L)[None, :] <= lengths[:, None] - 2  # earlier occurrences end before the last token
    drafts, n, score = source_draft(tokens, own, lengths, 1, tokens, lengths, **args)
    if cache is not None:
        ring = cache.live_tokens(max_requests)[None, :]
        G = ring.shape[1]
        stop = jnp.full_like(lengths, G)
        c_drafts, c_n, c_score = source_draft(ring, ring != SEPARATOR, stop, 0, tokens, lengths, **args)
        better = c_score > score  # the cache's draft only where it scores strictly higher
        drafts, n, score = (jnp.where(better[:, None], c_drafts, drafts), jnp.where(better, c_n, n),
                            jnp.maximum(score, c_score))
    return drafts, n.astype(jnp.int32), score


@dataclasses.dataclass(frozen=True)
class SuffixProposer:
    """Suffix decoding as a proposer. Its state is the `OutputCache` of finished outputs (None
    when vLLM's max_cached_requests is 0), shared by every row: the step adds each row's output
    to it in the step the row finishes (`retire`), and the engine hands it from batch to batch."""

    k: int
    max_tree_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 10000
    cache_tokens: int = 32768
    may_not_draft = True  # a step can find no match in any row: the engine then skips the verify

    def init_state(self, model, draft, tokens, lengths, target, choose):
        return OutputCache.empty(self.cache_tokens) if self.max_cached_requests > 0 else None

    def propose(self, model, draft, state, tokens, lengths, choose):
        drafts, n_draft, _ = suffix_drafts(tokens, lengths, state, k=self.k, depth=self.max_tree_depth,
                                           spec_factor=self.max_spec_factor, min_prob=self.min_token_prob,
                                           max_requests=self.max_cached_requests)
        return drafts, n_draft, None, state

    def update(self, model, draft, state, target, emitted, n_acc, lengths, choose):
        return state

    @staticmethod
    def retire(state, tokens, prompt_lengths, lengths, finished):
        """The state after rows finished [B] in this step: their outputs tokens[b, prompt_lengths[b]:
        lengths[b]] in the cache. Runs only in steps where some row finished."""
        if state is None:
            return None
        return jax.lax.cond(jnp.any(finished), lambda c: c.add(tokens, prompt_lengths, lengths, finished),
                            lambda c: c, state)
