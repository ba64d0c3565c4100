"""The benchmarks' oracle drafter: it proposes the target's own continuation, each token replaced
by a wrong one with probability `corruption_rate`, so speed can be measured at a controlled
acceptance without trained draft weights. Drafting costs nothing, so it also gives the ceiling a
real drafter at that acceptance could reach; at corruption 0 every draft is right.

The continuation is data: the full sequences (prompt, then output) of a plain run of the same
prompts through `LLM.generate`, taken first. The engine runs the oracle as any proposer of one's
own, through the speculative config's `proposer` field:

    known = KnownSequences.of_outputs(llm.generate(prompt_token_ids=prompts, sampling_params=greedy))
    spec = llm.with_speculation(oracle_config(known, k=3, vocab_size=llm.cfg.vocab_size, corruption_rate=0.2))
    spec.generate(prompt_token_ids=prompts, sampling_params=greedy)
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class KnownSequences:
    """Token sequences known before the run: tokens [N, S] (each prompt, then its continuation,
    zero-padded) and prompt_lengths [N]. Hashed and compared by content, so an oracle over the
    same sequences keys the same compiled programs."""

    def __init__(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]):
        """sequences: (prompt ids, continuation ids) pairs."""
        if not sequences:
            raise ValueError("an oracle needs at least one known sequence")
        width = max(len(p) + len(c) for p, c in sequences)
        self.tokens = np.zeros((len(sequences), width), np.int32)
        for i, (prompt, continuation) in enumerate(sequences):
            self.tokens[i, :len(prompt) + len(continuation)] = [*prompt, *continuation]
        self.prompt_lengths = np.asarray([len(p) for p, _ in sequences], np.int32)
        self.tokens.flags.writeable = self.prompt_lengths.flags.writeable = False
        digest = hashlib.sha256(self.tokens.tobytes() + self.prompt_lengths.tobytes()).digest()
        self._hash = int.from_bytes(digest[:8], "little")

    @classmethod
    def of_outputs(cls, outputs) -> "KnownSequences":
        """From `LLM.generate`'s RequestOutputs: each request's prompt ids and first completion's tokens."""
        return cls([(o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs])

    def fitted(self, width: int) -> np.ndarray:
        """tokens cut or zero-padded to [N, width]."""
        out = np.zeros((self.tokens.shape[0], width), np.int32)
        n = min(width, self.tokens.shape[1])
        out[:, :n] = self.tokens[:, :n]
        return out

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return (isinstance(other, KnownSequences) and self._hash == other._hash
                and np.array_equal(self.tokens, other.tokens)
                and np.array_equal(self.prompt_lengths, other.prompt_lengths))

    def __repr__(self) -> str:
        return f"KnownSequences({self.tokens.shape[0]} sequences of up to {self.tokens.shape[1]} tokens, " \
               f"hash {self._hash:016x})"


@dataclasses.dataclass(frozen=True)
class OracleProposer:
    """Drafts each row's known continuation (`Proposer` protocol, proposers/__init__.py). A row
    finds its sequence by its prompt: the (first) known sequence whose prompt has the row's length
    and tokens. A row with none drafts its own buffer's zeros, and acceptance shows it."""

    k: int
    corruption_rate: float
    vocab_size: int
    known: KnownSequences
    seed: int = 0

    def __post_init__(self):
        if not 0.0 <= self.corruption_rate <= 1.0:
            raise ValueError(f"corruption_rate must be in [0, 1], got {self.corruption_rate}")

    def init_state(self, model, draft, tokens, lengths, target, choose):
        """tokens [B, L], lengths [B] (each prompt and its first token) -> continuation [B, L],
        indexed like the token buffer. Matching compares [B, N, L] tokens: tables stay small."""
        B, L = tokens.shape
        table = jnp.asarray(self.known.fitted(L))  # [N, L]
        prompt_lengths = lengths - 1
        outside = jnp.arange(L)[None, :] >= prompt_lengths[:, None]  # [B, L]
        same = (tokens[:, None, :] == table[None, :, :]) | outside[:, None, :]
        match = same.all(axis=-1) & (jnp.asarray(self.known.prompt_lengths)[None, :] == prompt_lengths[:, None])
        return jnp.where(match.any(axis=1)[:, None], table[jnp.argmax(match, axis=1)], tokens)

    def propose(self, model, draft, continuation, tokens, lengths, choose):
        B, L = continuation.shape
        idx = jnp.minimum(lengths[:, None] + jnp.arange(self.k)[None, :], L - 1)
        drafts = jnp.take_along_axis(continuation, idx, axis=1)
        key = jax.random.fold_in(jax.random.key(self.seed), jnp.sum(lengths))
        u_key, shift_key = jax.random.split(key)
        corrupt = jax.random.uniform(u_key, (B, self.k)) < self.corruption_rate
        shift = jax.random.randint(shift_key, (B, self.k), 1, self.vocab_size)
        drafts = jnp.where(corrupt, (drafts + shift) % self.vocab_size, drafts)
        return drafts, jnp.full_like(lengths, self.k), None, continuation

    def update(self, model, draft, continuation, target, emitted, n_acc, lengths, choose):
        return continuation


def oracle_config(known: KnownSequences, k: int, vocab_size: int, corruption_rate: float = 0.0, **fields) -> dict:
    """The speculative config (a dict for `LLM.with_speculation`) that drafts the `known`
    continuations (a plain run of the prompts to be run) at k tokens a step, each corrupted with
    probability corruption_rate; fields: further config fields (enable_adaptive_verification, ...)."""
    proposer = OracleProposer(k, corruption_rate, vocab_size, known)
    return {**fields, "method": "custom_class", "num_speculative_tokens": k, "proposer": proposer}


def resolved(spec: dict, known: KnownSequences, vocab_size: int) -> dict:
    """A benchmark's config as the engine takes it: {"method": "oracle", "num_speculative_tokens": k,
    "oracle_corruption_rate": c, ...} (the benchmarks' command-line form; c defaults to 0) becomes
    `oracle_config` over `known`; any other config is returned as it is."""
    if spec.get("method") != "oracle":
        return spec
    own = ("method", "num_speculative_tokens", "oracle_corruption_rate")
    if not isinstance(spec.get("num_speculative_tokens"), int):
        raise ValueError(f"an oracle config needs num_speculative_tokens (an integer), got {spec}")
    return oracle_config(known, spec["num_speculative_tokens"], vocab_size,
                         spec.get("oracle_corruption_rate", 0.0), **{f: v for f, v in spec.items() if f not in own})
