"""Training batches on the device: random windows of the corpus streams, fixed held-out windows,
and the target's greedy continuations (the DFlash drafter's training data).

The whole training split lives on the device as one int32 array, so drawing a batch is a gather
inside the jitted step: no host round trip per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import Batch
from spec_jax.training.corpus import KINDS, Corpus


def full_batch(B: int, T: int) -> Batch:
    """T new tokens per row from position 0: a training pass over whole windows."""
    return Batch(jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Windows:
    """The training streams joined: tokens [N] int32; per kind, offsets [K], lengths [K] and the
    probability of drawing a window from it, weights [K]."""

    tokens: jax.Array
    offsets: jax.Array
    lengths: jax.Array
    weights: jax.Array

    @classmethod
    def from_corpus(cls, corpus: Corpus, prose_fraction: float) -> "Windows":
        parts = [corpus.streams[kind, "train"].astype(np.int32) for kind in KINDS]
        lengths = np.array([len(p) for p in parts])
        weights = np.array([1.0 - prose_fraction, prose_fraction], np.float32)
        return cls(jnp.asarray(np.concatenate(parts)), jnp.asarray(np.cumsum(lengths) - lengths, jnp.int32),
                   jnp.asarray(lengths, jnp.int32), jnp.asarray(weights))

    def sample(self, key, n: int, length: int) -> jax.Array:
        """n random windows of `length` tokens -> [n, length] int32 (call inside jit)."""
        k_kind, k_start = jax.random.split(key)
        kind = jax.random.choice(k_kind, self.weights.shape[0], (n,), p=self.weights)
        span = self.lengths[kind] - length
        start = self.offsets[kind] + (jax.random.uniform(k_start, (n,)) * span).astype(jnp.int32)
        return jax.vmap(lambda s: jax.lax.dynamic_slice(self.tokens, (s,), (length,)))(start)


def heldout_windows(corpus: Corpus, kind: str, n: int, length: int) -> np.ndarray:
    """Up to n evenly spaced, non-overlapping windows of a held-out stream: [n', length] int32.
    Raises ValueError when the stream is shorter than one window."""
    stream = corpus.streams[kind, "heldout"].astype(np.int32)
    fits = len(stream) // length
    if fits == 0:
        raise ValueError(f"the held-out {kind} stream has {len(stream)} tokens, fewer than one window of {length}; "
                         f"use a shorter --seq-len or a larger corpus")
    picks = np.linspace(0, fits - 1, min(n, fits)).astype(int)
    return np.stack([stream[i * length:(i + 1) * length] for i in picks])


def greedy_continue(model, prompts: jax.Array, n_new: int) -> jax.Array:
    """The model's greedy continuation: prompts [B, P] -> [B, P + n_new] (prompt, then new tokens).
    Prefill in one pass, then one token per step in a lax.scan (call inside jit)."""
    B, P = prompts.shape
    L = P + n_new
    out = model(prompts, full_batch(B, P), model.init_cache(B, L), kv_len=L)
    hidden, cache = out.hidden, out.cache
    first = jnp.argmax(model.logits(hidden[:, -1]), axis=-1).astype(jnp.int32)
    ones = jnp.ones((B,), jnp.int32)

    def step(carry, i):
        token, cache = carry
        out = model(token[:, None], Batch(jnp.full((B,), P + i, jnp.int32), ones), cache, kv_len=L)
        h, cache = out.hidden, out.cache
        return (jnp.argmax(model.logits(h[:, 0]), axis=-1).astype(jnp.int32), cache), token

    _, new = jax.lax.scan(step, (first, cache), jnp.arange(n_new))
    return jnp.concatenate([prompts, new.T], axis=1)
