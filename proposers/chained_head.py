"""Chained-head drafting, shared by MTP and EAGLE-3: a one-layer head reads (token p+1, a hidden
state at p) and predicts token p+2; for k > 1 it chains on its own output.

After prefill and after each verify pass the head re-reads the newly committed positions with
the target's features, which rewrites its KV cache for the accepted prefix (rollback is the
row length, as for attention) and keeps its output at the last one. A step drafts its first
token from that output (so a step that verifies no draft reads no logits at all) and the
remaining k - 1 by chaining the head on its own output, in an unrolled scan (a few steps:
unrolled, XLA reads the head's weights in place).
"""

from __future__ import annotations

import abc
import dataclasses

import jax
import jax.numpy as jnp

from models.layers import Batch, KVCache
from models.qwen3_5 import ForwardOut


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChainedHeadState:
    """cache: the head's KV [1, B, L, kv, d]; hidden [B, H]: the head's output at the row's last
    committed position, which the next first draft is chosen from and the chain feeds back."""

    cache: KVCache
    hidden: jax.Array


def pick(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...] at per-row index idx [B] -> [B, ...]."""
    return x[jnp.arange(x.shape[0]), idx]


@dataclasses.dataclass(frozen=True)
class ChainedHeadProposer(abc.ABC):
    """k drafts a step. A method supplies its head through the five hooks below."""

    k: int

    def with_drafts(self, n: int) -> ChainedHeadProposer:
        return dataclasses.replace(self, k=n)  # the chain's first n drafts do not depend on how far it goes

    @abc.abstractmethod
    def init_cache(self, model, draft, batch: int, max_len: int) -> KVCache:
        ...

    @abc.abstractmethod
    def embed(self, model, draft, tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> the head's token embeddings [B, T, H]."""
        ...

    @abc.abstractmethod
    def features(self, model, draft, target: ForwardOut) -> jax.Array:
        """What the head reads beside the token at committed positions [B, T, H]."""
        ...

    @abc.abstractmethod
    def head(self, model, draft, embedded, hidden, batch: Batch, cache: KVCache, kv_len: int):
        """One head pass -> (output [B, T, H] that chains, cache)."""
        ...

    @abc.abstractmethod
    def logits(self, model, draft, out: jax.Array) -> jax.Array:
        """Head output [B, H] -> float32 draft logits over the target vocabulary [B, V]."""
        ...

    def _read(self, model, draft, cache, tokens, target: ForwardOut, start, n_valid, kv_len) -> ChainedHeadState:
        """Run the head over (tokens, the target's features) from `start` for n_valid [B]
        positions; keep its output at each row's last one."""
        out, cache = self.head(model, draft, self.embed(model, draft, tokens), self.features(model, draft, target),
                               Batch(start, n_valid), cache, kv_len)
        return ChainedHeadState(cache, pick(out, n_valid - 1))

    def next_logits(self, model, draft, state: ChainedHeadState) -> jax.Array:
        """[B, V] float32: the logits each row's next first draft is chosen from."""
        return self.logits(model, draft, state.hidden)

    def init_state(self, model, draft, tokens, lengths, target: ForwardOut, choose) -> ChainedHeadState:
        T = target.hidden.shape[1]
        next_tokens = jnp.pad(tokens, ((0, 0), (0, 1)))[:, 1 : T + 1]  # draft row p reads token p+1
        cache = self.init_cache(model, draft, tokens.shape[0], tokens.shape[1])
        return self._read(model, draft, cache, next_tokens, target, jnp.zeros_like(lengths), lengths - 1, T)

    def propose(self, model, draft, state: ChainedHeadState, tokens, lengths, choose):
        L = state.cache.k.shape[2]
        ones = jnp.ones_like(lengths)
        first, first_q = choose(self.next_logits(model, draft, state), lengths)

        def chain(carry, j):  # draft j from draft j - 1 and the head's own output
            previous, h, cache = carry
            out, cache = self.head(model, draft, self.embed(model, draft, previous[:, None]), h[:, None],
                                   Batch(lengths - 2 + j, ones), cache, L)
            d, q = choose(self.logits(model, draft, out[:, 0]), lengths + j)
            return (d, out[:, 0], cache), (d, q)

        (_, _, cache), (ds, qs) = jax.lax.scan(chain, (first, state.hidden, state.cache),
                                               jnp.arange(1, self.k), unroll=True)
        drafts = jnp.concatenate([first[:, None], ds.T], axis=1)
        q = None if first_q is None else jnp.concatenate([first_q[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
        return drafts, jnp.full_like(lengths, self.k), q, dataclasses.replace(state, cache=cache)

    def update(self, model, draft, state: ChainedHeadState, target: ForwardOut, emitted, n_acc, lengths,
               choose) -> ChainedHeadState:
        return self._read(model, draft, state.cache, emitted, target, lengths - 1, n_acc + 1, state.cache.k.shape[2])
