"""EAGLE-3 drafting: the head reads three target layers' outputs (through `fc`) with the next
token and chains on its own pre-norm output for k > 1, like MTP. After each verify pass it
re-reads the verified positions with the target's features, which rewrites its KV cache for the
accepted prefix and yields the next first draft."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.qwen3_5 import Batch, KVCache, TargetOut
from proposers.mtp import pick


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3State:
    """cache: the head's KV [1, B, L, kv, d]; draft [B] the next first draft; hidden [B, H] the
    head's pre-norm output that drafted it; q [B, V] its probabilities (or None)."""

    cache: KVCache
    draft: jax.Array
    hidden: jax.Array
    q: jax.Array | None


@dataclasses.dataclass(frozen=True)
class Eagle3Proposer:
    k: int
    taps: tuple[int, ...]

    def _read(self, model, draft, state_cache, tokens, target: TargetOut, start, n_valid, kv_len, choose, positions):
        """Run the head over (tokens, fc(taps)) and draft from each row's last valid position."""
        embedded = draft.embed(tokens, model.embed)
        logits, pre, cache = draft(embedded, draft.fc(target.taps), Batch(start, n_valid), state_cache, kv_len)
        token, q = choose(pick(logits, n_valid - 1), positions)
        return Eagle3State(cache, token, pick(pre, n_valid - 1), q)

    def init_state(self, model, draft, tokens, lengths, target: TargetOut, choose, reference=None) -> Eagle3State:
        T = target.hidden.shape[1]
        next_tokens = jnp.pad(tokens, ((0, 0), (0, 1)))[:, 1 : T + 1]
        cache = draft.init_cache(tokens.shape[0], tokens.shape[1])
        return self._read(model, draft, cache, next_tokens, target, jnp.zeros_like(lengths), lengths - 1, T, choose,
                          lengths)

    def propose(self, model, draft, state: Eagle3State, tokens, lengths, choose):
        L = state.cache.k.shape[2]
        drafts, qs, h, cache = [state.draft], [state.q], state.hidden, state.cache
        ones = jnp.ones_like(lengths)
        for j in range(1, self.k):
            embedded = draft.embed(drafts[-1][:, None], model.embed)
            logits, pre, cache = draft(embedded, h[:, None], Batch(lengths - 2 + j, ones), cache, L)
            h = pre[:, 0]
            d, q = choose(logits[:, 0], lengths + j)
            drafts.append(d)
            qs.append(q)
        q = None if state.q is None else jnp.stack(qs, axis=1)
        return jnp.stack(drafts, axis=1), jnp.full_like(lengths, self.k), q, dataclasses.replace(state, cache=cache)

    def update(self, model, draft, state: Eagle3State, target: TargetOut, emitted, n_acc, lengths, choose):
        return self._read(model, draft, state.cache, emitted, target, lengths - 1, n_acc + 1, state.cache.k.shape[2],
                          choose, lengths + n_acc + 1)
