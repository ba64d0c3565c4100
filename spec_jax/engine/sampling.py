"""Token sampling on the device, with per-row parameters.

Each row carries its own temperature, top-k, top-p and PRNG key, so one batch mixes greedy and
sampled requests. A row's randomness at a position is `fold_in(row_key, position)`: the same
seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.batch_invariant import row_tiled

# Multi-token bad words: a row holds up to MAX_BAD_WORDS token sequences of up to MAX_BAD_WORD_LENGTH
# tokens (fixed, so every row fits a continuous batch's live state).
MAX_BAD_WORDS = 32
MAX_BAD_WORD_LENGTH = 8
ANY = -2  # a prefix entry before a shorter word's first token: matches whatever is there


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
    """Per-row sampling parameters. temperature [B] (0 = greedy), top_k [B] (0 = off),
    top_p [B] (1 = off), key [B] typed PRNG keys.

    Optional, None when no row of the batch uses them (the step then compiles without them):
    min_p [B] (0 = off); bias [B, V] float32 added to the raw logits (vLLM's logit_bias, with
    -inf for allowed_token_ids' complement and bad words); min_tokens: (end [B], stop_ids [B, S])
    - a stop id cannot be emitted at a position below end (prompt length + min_tokens);
    penalties: (presence [B], frequency [B], repetition [B]), read with the rows' `TokenHistory`;
    bad_words: (prefixes [B, W, P] int32, last [B, W] int32) - a multi-token bad word's last
    token cannot follow generated tokens equal to its prefix (right-aligned, `ANY` before it;
    last -1 for no word; W = MAX_BAD_WORDS, P = MAX_BAD_WORD_LENGTH - 1); grammar: [B] int32 the
    row's id among the host's grammar matchers (`grammar_rows.GrammarRows`), -1 for none."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array
    min_p: jax.Array | None = None
    bias: jax.Array | None = None
    min_tokens: tuple[jax.Array, jax.Array] | None = None
    penalties: tuple[jax.Array, jax.Array, jax.Array] | None = None
    bad_words: tuple[jax.Array, jax.Array] | None = None
    grammar: jax.Array | None = None

    def with_processors(self, names: frozenset[str], vocab_size: int, stop_ids: jax.Array) -> RowSampling:
        """The same rows carrying exactly the optional fields `names`: a field kept stays as it is,
        one added holds its neutral value in every row (min_p 0, bias 0, min_tokens ending at 0 with
        stop_ids [B, S], penalties 0, 0 and 1, no bad words, no grammar), so those rows' logits are
        unchanged bitwise."""
        B = self.temperature.shape[0]
        # Every field its own buffer (stop_ids copied): the live state is donated, and a buffer
        # may not be donated twice.
        zeros = lambda dtype=jnp.float32: jnp.zeros((B,), dtype)  # noqa: E731
        neutral = {"min_p": zeros, "bias": lambda: jnp.zeros((B, vocab_size), jnp.float32),
                   "min_tokens": lambda: (zeros(jnp.int32), jnp.array(stop_ids, copy=True)),
                   "penalties": lambda: (zeros(), zeros(), jnp.ones((B,), jnp.float32)),
                   "bad_words": lambda: no_bad_words(B), "grammar": lambda: jnp.full((B,), -1, jnp.int32)}
        unknown = names - neutral.keys()
        if unknown:
            raise ValueError(f"unknown logit processors {sorted(unknown)}; known: {sorted(neutral)}")
        fields = {name: (getattr(self, name) if getattr(self, name) is not None else make()) if name in names
                  else None for name, make in neutral.items()}
        return dataclasses.replace(self, **fields)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenHistory:
    """What the penalties read: counts [B, V] int32 of each token among a row's generated tokens,
    in_prompt [B, V] bool whether it is in the row's prompt."""

    counts: jax.Array
    in_prompt: jax.Array

    @classmethod
    def empty(cls, rows: int, vocab_size: int) -> TokenHistory:
        """No tokens seen: for rows whose penalties are neutral, whose counts nothing reads."""
        return cls(jnp.zeros((rows, vocab_size), jnp.int32), jnp.zeros((rows, vocab_size), bool))

    @classmethod
    def of_prompts(cls, prompts: jax.Array, prompt_lengths: jax.Array, vocab_size: int) -> TokenHistory:
        """prompts [B, T] right-padded to prompt_lengths [B]; no generated tokens yet."""
        B, T = prompts.shape
        ids = jnp.where(jnp.arange(T)[None, :] < prompt_lengths[:, None], prompts, vocab_size)  # pads drop
        in_prompt = jnp.zeros((B, vocab_size), bool).at[jnp.arange(B)[:, None], ids].set(True, mode="drop")
        return cls(jnp.zeros((B, vocab_size), jnp.int32), in_prompt)

    def add(self, new: jax.Array, count: jax.Array) -> TokenHistory:
        """After writing the first count [B] of the tokens new [B, m] of each row."""
        B, m = new.shape
        written = (jnp.arange(m)[None, :] < count[:, None]).astype(jnp.int32)
        return TokenHistory(self.counts.at[jnp.arange(B)[:, None], new].add(written), self.in_prompt)

    def through(self, drafts: jax.Array) -> jax.Array:
        """Counts [B, k+1, V] seen by each verify position: position j follows drafts[:, :j] [B, k]."""
        V = self.counts.shape[-1]
        before = jnp.cumsum(jax.nn.one_hot(drafts, V, dtype=jnp.int32), axis=1)  # [B, k, V]
        return self.counts[:, None] + jnp.concatenate([jnp.zeros_like(before[:, :1]), before], axis=1)


def ranked_logprobs(logits: jax.Array, tokens: jax.Array, k: int):
    """Each token's log-probability under logits [..., V] (float32 log-softmax) with its rank
    (1 = the most likely), and the k most likely: (token [...], rank [...] int32, top_ids [..., k]
    int32, top [..., k]) for tokens [...]."""
    lp = row_tiled(lambda x: jax.nn.log_softmax(x.astype(jnp.float32), axis=-1), logits)  # per token, any pass
    token = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
    rank = jnp.sum(lp > token[..., None], axis=-1).astype(jnp.int32) + 1
    top, top_ids = jax.lax.top_k(lp, k)
    return token, rank, top_ids.astype(jnp.int32), top


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EmittedLogprobs:
    """Log-probabilities of the written tokens under the target's raw logits (vLLM's default
    `raw_logprobs`): token [B, L] float32 and rank [B, L] int32 (1 = the most likely) of the token
    at each buffer index; top_ids [B, L, K] int32 and top [B, L, K] float32 the K most likely there."""

    token: jax.Array
    rank: jax.Array
    top_ids: jax.Array
    top: jax.Array

    @classmethod
    def empty(cls, rows: int, length: int, k: int) -> EmittedLogprobs:
        return cls(jnp.zeros((rows, length), jnp.float32), jnp.zeros((rows, length), jnp.int32),
                   jnp.zeros((rows, length, k), jnp.int32), jnp.zeros((rows, length, k), jnp.float32))

    def write(self, idx: jax.Array, logits: jax.Array, new: jax.Array) -> EmittedLogprobs:
        """The tokens new [B, m] written at buffer indices idx [B, m] (out of range: not written),
        each drawn from logits [B, m, V]."""
        token, rank, top_ids, top = ranked_logprobs(logits, new, self.top.shape[-1])
        rows = jnp.arange(new.shape[0])[:, None]
        put = lambda old, value: old.at[rows, idx].set(value.astype(old.dtype), mode="drop")  # noqa: E731
        return EmittedLogprobs(put(self.token, token), put(self.rank, rank), put(self.top_ids, top_ids),
                               put(self.top, top))


def apply_penalties(logits: jax.Array, penalties: tuple, counts: jax.Array, in_prompt: jax.Array) -> jax.Array:
    """vLLM's penalties: repetition divides a positive logit (multiplies a negative one) of every
    token in the prompt or the output; then frequency x count and presence x (count > 0) are
    subtracted. logits and counts [B, V] or [B, T, V]; penalties' arrays [B]; in_prompt [B, V]."""
    presence, frequency, repetition = (x[:, None] if logits.ndim == 2 else x[:, None, None] for x in penalties)
    seen = counts > 0
    repeated = seen | (in_prompt if logits.ndim == 2 else in_prompt[:, None])
    logits = jnp.where(repeated, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * seen


def no_bad_words(rows: int) -> tuple[jax.Array, jax.Array]:
    """`RowSampling.bad_words` for rows without any."""
    return (jnp.full((rows, MAX_BAD_WORDS, MAX_BAD_WORD_LENGTH - 1), ANY, jnp.int32),
            jnp.full((rows, MAX_BAD_WORDS), -1, jnp.int32))


def ban_bad_words(logits: jax.Array, bad_words: tuple[jax.Array, jax.Array], recent: jax.Array) -> jax.Array:
    """-inf on each multi-token bad word's last token where the generated tokens before the
    position end with the rest of the word (vLLM's rule: prompt tokens never match). logits
    [B, T, V]; recent [B, T, P] the P tokens before each position, -1 where not generated."""
    prefixes, last = bad_words
    B, T, V = logits.shape
    match = jnp.all((prefixes[:, None] == ANY) | (prefixes[:, None] == recent[:, :, None]), axis=-1)  # [B, T, W]
    ids = jnp.where(match & (last[:, None] >= 0), last[:, None], V)  # V: nothing to ban, dropped
    return logits.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], ids].set(-jnp.inf, mode="drop")


def process_logits(logits: jax.Array, params: RowSampling, positions: jax.Array,
                   history: TokenHistory | None = None, counts: jax.Array | None = None,
                   recent: jax.Array | None = None) -> jax.Array:
    """The logit processors that change what greedy picks too (vLLM applies them before
    sampling or argmax): the bias, multi-token bad words, min_tokens' ban on stop ids, then the
    penalties. logits [B, V] or [B, T, V] float32 for the tokens written at positions [B] or
    [B, T]; the same shape back. history: the rows' tokens so far (with penalties); counts: in
    place of history.counts for a verify pass ([B, T, V], `TokenHistory.through`); recent: the
    generated tokens before each position ([B, P] or [B, T, P], -1 for none; None when no token
    is generated yet). Speculation verifies against these logits, so its output distribution is
    spec-off's."""
    if all(x is None for x in (params.bias, params.min_tokens, params.penalties, params.bad_words)):
        return logits
    per_row = lambda x: x if logits.ndim == 2 else x[:, None]  # noqa: E731
    if params.bias is not None:
        logits = logits + per_row(params.bias)
    if params.bad_words is not None and recent is not None:
        one = logits.ndim == 2  # a single position: as a pass of one
        banned = ban_bad_words(logits[:, None] if one else logits, params.bad_words, recent[:, None] if one else recent)
        logits = banned[:, 0] if one else banned
    if params.min_tokens is not None:
        end, stop_ids = params.min_tokens
        B, V = stop_ids.shape[0], logits.shape[-1]
        is_stop = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], jnp.where(stop_ids >= 0, stop_ids, V)].set(
            True, mode="drop")  # -1 pads map past the vocabulary and drop
        early = positions < (end if logits.ndim == 2 else end[:, None])  # [B] or [B, T]
        logits = jnp.where(early[..., None] & per_row(is_stop), -jnp.inf, logits)
    if params.penalties is not None:
        logits = apply_penalties(logits, params.penalties, history.counts if counts is None else counts,
                                 history.in_prompt)
    return logits


def apply_token_masks(logits: jax.Array, masks: jax.Array) -> jax.Array:
    """-inf where a grammar forbids the token: logits [..., V] float32, masks [..., W] int32 bitmasks
    (token t allowed where bit t % 32 of word t // 32 is set; W * 32 >= V)."""
    bits = (masks[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [..., W, 32]
    allowed = bits.reshape(masks.shape[:-1] + (-1,))[..., :logits.shape[-1]]
    return jnp.where(allowed == 1, logits, -jnp.inf)


def warp_logits(logits: jax.Array, params: RowSampling) -> jax.Array:
    """Temperature, then min-p, then top-k, then top-p: logits [B, V] float32 -> masked, scaled logits [B, V]
    (removed tokens at -inf). softmax of the result is the distribution a row samples from."""
    V = logits.shape[-1]
    t = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / t[:, None]
    if params.min_p is not None:  # after temperature, as vLLM: drop tokens below min_p x the top probability
        floor = jnp.max(scaled, axis=-1, keepdims=True) + jnp.log(params.min_p[:, None])  # -inf where min_p = 0
        scaled = jnp.where(scaled >= floor, scaled, -jnp.inf)
    desc = -jnp.sort(-scaled, axis=-1)
    k = jnp.where(params.top_k > 0, jnp.minimum(params.top_k, V), V)
    in_top_k = jnp.arange(V)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_top_k & (mass_before < params.top_p[:, None])
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample_tokens(logits: jax.Array, params: RowSampling, positions: jax.Array, *, do_sample: bool) -> jax.Array:
    """Next token per row: argmax where temperature == 0, else a draw from `warp_logits`.

    logits: [B, V] float32; positions: [B] where the token will be written (folds the key).
    do_sample: static; False compiles the greedy-only path (no sort over the vocabulary).
    Returns [B] int32.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not do_sample:
        return greedy
    drawn = draw(warp_logits(logits, params), params, positions, stream=0)
    return jnp.where(params.temperature > 0, drawn, greedy)


def draw(logits: jax.Array, params: RowSampling, positions: jax.Array, stream: int) -> jax.Array:
    """One categorical draw per row from logits [B, V], keyed by (row key, position, stream)."""
    keys = jax.vmap(lambda k, p: jax.random.fold_in(jax.random.fold_in(k, p), stream))(params.key, positions)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def accept_drafts(logits: jax.Array, drafts: jax.Array, n_draft: jax.Array, draft_probs: jax.Array | None,
                  params: RowSampling, positions: jax.Array, *, do_sample: bool) -> tuple[jax.Array, jax.Array]:
    """Verify k drafts per row against the target (Leviathan et al.; vLLM's standard method).

    logits: [B, k+1, V] float32 target logits at [last, d1..dk]; drafts: [B, k]; n_draft: [B]
    real drafts per row (0..k; the rest are ignored); draft_probs: [B, k, V] the draft's q, or
    None to treat q as one-hot on the drafted token (ngram, or greedy drafting); positions: [B]
    buffer index of the row's first emitted token.

    Greedy rows (temperature 0) accept the longest prefix with d_i == argmax p_i and emit the
    target's argmax after it. Sampled rows accept d_i with probability min(1, p_i(d_i)/q_i(d_i)),
    at the first rejection draw from normalize(max(0, p_i - q_i)), and after k acceptances draw
    a bonus token from p_{k+1}; p is the row's temperature/top-k/top-p distribution.

    Returns n_acc [B] (0..n_draft) and emitted [B, k+1]: the first n_acc + 1 entries are the
    row's new tokens.
    """
    B, T, V = logits.shape
    k = T - 1
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
    in_draft = jnp.arange(k)[None, :] < n_draft[:, None]
    greedy_ok = (drafts == argmax[:, :k]) & in_draft
    n_greedy = jnp.sum(jnp.cumprod(greedy_ok, axis=1), axis=1).astype(jnp.int32)
    if not do_sample:
        return n_greedy, argmax

    flat = jax.tree.map(lambda x: jnp.repeat(x, T, axis=0), params)
    warped = warp_logits(logits.reshape(B * T, V), flat).reshape(B, T, V)
    p = jax.nn.softmax(warped, axis=-1)
    if draft_probs is None:
        q = jax.nn.one_hot(drafts, V, dtype=p.dtype)
    else:
        q = draft_probs
    q = jnp.where(in_draft[..., None], q, 0.0)
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u_keys = jax.vmap(lambda key, pos: jax.random.split(jax.random.fold_in(jax.random.fold_in(key, pos), 1), k))(
        params.key, positions)
    u = jax.vmap(jax.vmap(jax.random.uniform))(u_keys)  # [B, k]
    ok = (u * q_d < p_d) & in_draft
    n_sampled = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)

    # At a rejection, draw from the residual; after the last draft, from p itself (q = 0 there),
    # through the same warped logits spec-off sampling uses.
    q_full = jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], axis=1)
    def at(x):
        return jnp.take_along_axis(x, n_sampled[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(at(p) - at(q_full), 0.0)
    rejected = n_sampled < n_draft
    use_residual = rejected & (jnp.sum(residual, axis=-1) > 0)
    final_logits = jnp.where(use_residual[:, None], jnp.log(residual), at(warped))
    final = draw(final_logits, params, positions + n_sampled, stream=0)
    emitted = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    emitted = jnp.where(jnp.arange(T)[None, :] == n_sampled[:, None], final[:, None], emitted)

    sampled_row = params.temperature > 0
    n_acc = jnp.where(sampled_row, n_sampled, n_greedy)
    return n_acc, jnp.where(sampled_row[:, None], emitted, argmax)


SYNTHETIC_STREAM = 3  # key stream of synthetic acceptance (0: sampling, 1-2: verification, drafting)


def accept_synthetic(rates: jax.Array, logits: jax.Array, drafts: jax.Array, n_draft: jax.Array,
                     params: RowSampling, positions: jax.Array, *, do_sample: bool) -> tuple[jax.Array, jax.Array]:
    """vLLM's "synthetic" rejection, for benchmarks: draft i is accepted with probability
    rates [B, k] (given that the drafts before it were), whatever the target says; the token
    after the accepted drafts is the target's (argmax, or a draw for sampled rows). Other
    arguments and the results as `accept_drafts`."""
    B, k = drafts.shape
    keys = jax.vmap(lambda key, p: jax.random.fold_in(jax.random.fold_in(key, p), SYNTHETIC_STREAM))(
        params.key, positions)
    u = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(keys)
    ok = (u < rates) & (jnp.arange(k)[None, :] < n_draft[:, None])
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    after = sample_tokens(logits[jnp.arange(B), n_acc], params, positions + n_acc, do_sample=do_sample)
    padded = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
    return n_acc, jnp.where(jnp.arange(k + 1)[None, :] < n_acc[:, None], padded, after[:, None])
