"""A batch of requests as the engine's inputs: prompts right-padded to the engine's buckets,
each row's token budget and stop ids, its sampling parameters, logit processors and PRNG key.
`EngineCore.start` assembles every batch, offline or continuous, here."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.engine.sampling import RowSampling, no_bad_words


def seed_key(seed: int) -> jax.Array:
    """A PRNG key from all 64 bits of a seed (`jax.random.key` keeps only the low 32 without x64,
    so 0 and 2**62 would draw alike)."""
    seed &= 2**64 - 1
    key = jax.random.key(seed & 0xFFFFFFFF)
    return jax.random.fold_in(key, seed >> 32) if seed >> 32 else key


def row_keys(seeds: Sequence[int], rows: int) -> jax.Array:
    """`seed_key` of each seed, then key(0) for the padding rows: [rows] keys. Made as raw key data
    on the host, one transfer for the batch: threefry's key of a 32-bit seed s is (0, s); larger
    seeds (rare) go through `seed_key` on the device."""
    data = np.zeros((rows, 2), np.uint32)
    for i, seed in enumerate(seeds):
        seed &= 2**64 - 1
        data[i] = (0, seed) if seed < 2**32 else jax.random.key_data(seed_key(seed))
    return jax.random.wrap_key_data(data)


@dataclasses.dataclass
class AssembledBatch:
    """B bucket rows, the first n real: tokens [B, T] int32 right-padded, lengths [B],
    max_lengths [B] (prompt + budget, capped at max_model_len), stop_ids [B, S] (-1 padded),
    sampling (`RowSampling`; temperature, top_k and top_p on the host, as the arrays above),
    done [B] (padding rows), speculate [B]; stops: each real row's stop ids; do_sample: whether
    any row samples."""

    tokens: np.ndarray
    lengths: np.ndarray
    max_lengths: np.ndarray
    stop_ids: np.ndarray
    sampling: RowSampling
    done: np.ndarray
    speculate: np.ndarray
    stops: list[list[int]]
    do_sample: bool

    def inputs(self) -> list:
        """The runner's prefill arguments before (speculate, do_sample). The arrays stay
        on the host: a compiled program copies them in with its call, and the prefix-cache path
        reads them there without a copy back."""
        return [self.tokens, self.lengths, self.max_lengths, self.stop_ids, self.sampling, self.done]


def assemble_batch(ids: Sequence[Sequence[int]], params: Sequence, seeds: Sequence[int], *, rows: int,
                   prompt_len: int, max_model_len: int, eos: Sequence[int], stop_width: int | None = None,
                   vocab_size: int | None = None, bad_words: Sequence[Sequence[Sequence[int]]] | None = None,
                   processors: frozenset[str] = frozenset(), grammars: Sequence[int] | None = None) -> AssembledBatch:
    """n = len(ids) checked prompts with their `SamplingParams` and seeds into `rows` >= n
    bucket rows of `prompt_len` >= the longest prompt. stop_width fixes the stop_ids columns
    (default: the most stop ids any row has). vocab_size and bad_words (each row's bad words as
    token sequences, `LLM.bad_word_forms`) are needed only when a row sets logit_bias,
    allowed_token_ids or bad_words.
    processors: `RowSampling`'s optional fields the batch carries even if no row uses them (a
    scheduler's live batch). grammars: each row's id among the engine's `GrammarRows` (-1: none),
    needed when a row has structured outputs."""
    n, B = len(ids), rows
    tokens = np.zeros((B, prompt_len), np.int32)
    lengths = np.ones((B,), np.int32)
    max_lengths = np.full((B,), 2, np.int32)
    stops = [list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(eos)) for p in params]
    stop_ids = np.full((B, stop_width or max(1, max(len(s) for s in stops))), -1, np.int32)
    for i, (x, p, st) in enumerate(zip(ids, params, stops)):
        tokens[i, :len(x)] = x
        lengths[i] = len(x)
        budget = p.max_tokens if p.max_tokens is not None else max_model_len
        max_lengths[i] = min(len(x) + budget, max_model_len)
        stop_ids[i, :len(st)] = st
    speculate = np.zeros((B,), bool)
    speculate[:n] = [p.speculative for p in params]
    pad = lambda values, fill, dtype: np.asarray(list(values) + [fill] * (B - n), dtype)  # noqa: E731
    temperature = pad((p.temperature for p in params), 0.0, np.float32)
    sampling = RowSampling(temperature, pad((max(p.top_k, 0) for p in params), 0, np.int32),
                           pad((p.top_p for p in params), 1.0, np.float32), row_keys(seeds, B),
                           **logit_processors(params, lengths, stop_ids, B, vocab_size, bad_words, processors,
                                              grammars))
    return AssembledBatch(tokens, lengths, max_lengths, stop_ids, sampling, np.arange(B) >= n, speculate, stops,
                          bool((temperature > 0).any()))


LOGIT_BIAS_LIMIT = 100.0  # vLLM clamps each bias to [-100, 100]


def processors_needed(p, bad_words: Sequence[Sequence[int]] = ()) -> frozenset[str]:
    """Which of `RowSampling`'s optional fields a request's `SamplingParams` use, given its bad
    words as token sequences (a one-token word is a bias of -inf; a longer one needs bad_words)."""
    used = {"min_p": p.min_p > 0,
            "bias": bool(p.logit_bias or p.allowed_token_ids or any(len(w) == 1 for w in bad_words)),
            "min_tokens": p.min_tokens > 0,
            "penalties": bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1),
            "bad_words": any(len(w) > 1 for w in bad_words), "grammar": p.structured is not None}
    return frozenset(name for name, on in used.items() if on)


def bad_word_rows(bad_words: Sequence[Sequence[Sequence[int]]], rows: int) -> tuple[jax.Array, jax.Array]:
    """`RowSampling.bad_words` from each row's multi-token bad words (one-token ones are biases)."""
    prefixes, last = (np.array(x) for x in no_bad_words(rows))
    for i, words in enumerate(bad_words):
        for j, word in enumerate(w for w in words if len(w) > 1):
            prefixes[i, j, prefixes.shape[-1] - len(word) + 1:] = word[:-1]
            last[i, j] = word[-1]
    return jnp.asarray(prefixes), jnp.asarray(last)


def logit_processors(params: Sequence, lengths: np.ndarray, stop_ids: np.ndarray, rows: int, vocab_size: int | None,
                     bad_words: Sequence[Sequence[Sequence[int]]] | None, keep: frozenset[str] = frozenset(),
                     grammars: Sequence[int] | None = None) -> dict:
    """`RowSampling`'s optional fields for the processors some row uses or `keep` names (absent
    otherwise, so the step compiles without them; rows that do not use one get its neutral value):
    min_p [B]; bias [B, V] (logit_bias clamped to +-100, -inf off allowed_token_ids and on one-token
    bad words); min_tokens (end [B] = prompt length + min_tokens, stop_ids); penalties (presence,
    frequency, repetition, each [B]); bad_words (`bad_word_rows`); grammar [B] (each row's id in
    `grammars`, -1 for none)."""
    n = len(params)
    bad_words = bad_words or [[] for _ in params]
    used = keep.union(*map(processors_needed, params, bad_words))
    column = lambda name, neutral: jnp.asarray([getattr(p, name) for p in params] + [neutral] * (rows - n),  # noqa: E731
                                               jnp.float32)
    out = {}
    if "min_p" in used:
        out["min_p"] = column("min_p", 0.0)
    if "bias" in used:
        bias = np.zeros((rows, vocab_size), np.float32)
        for i, (p, words) in enumerate(zip(params, bad_words)):
            if p.allowed_token_ids:
                bias[i] = -np.inf
                bias[i, list(p.allowed_token_ids)] = 0.0
            for token, value in (p.logit_bias or {}).items():
                bias[i, int(token)] += float(np.clip(value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT))
            bias[i, [w[0] for w in words if len(w) == 1]] = -np.inf
        out["bias"] = jnp.asarray(bias)
    if "bad_words" in used:
        out["bad_words"] = bad_word_rows(bad_words, rows)
    if "penalties" in used:
        out["penalties"] = (column("presence_penalty", 0.0), column("frequency_penalty", 0.0),
                            column("repetition_penalty", 1.0))
    if "min_tokens" in used:
        end = np.zeros((rows,), np.int32)
        end[:n] = [lengths[i] + p.min_tokens for i, p in enumerate(params)]
        out["min_tokens"] = (jnp.asarray(end), jnp.asarray(stop_ids))
    if "grammar" in used:
        ids = np.full((rows,), -1, np.int32)
        if grammars is not None:
            ids[:n] = grammars
        out["grammar"] = jnp.asarray(ids)
    return out
