"""Which positions a drafter layer attends to, and the bounded cache a sliding layer keeps.

Published drafters (z-lab DFlash, DSpark, Speculators EAGLE-3) may run some layers with
sliding-window attention and some causally. The rules are vLLM's (`qwen3_dflash.py`
`_resolve_layer_attention`, `llama.py` `LlamaAttention` for EAGLE-3) over the layer kinds a
transformers `Qwen3Config` derives:

* layer kinds: `layer_types`, else HF's rule (with `use_sliding_window`, layers from
  `max_window_layers` on slide); the window is `sliding_window`, which HF drops unless
  `use_sliding_window` is set. A block drafter's `dflash_config.use_swa` makes every layer slide
  when no layer kind says so, with `dflash_config.swa_window_size` winning over `sliding_window`.
* causality of a block drafter's layer: `is_causal`, else `dflash_config.causal`, else causal
  exactly for the layers whose declared kind is `sliding_attention`.
* the mask, by absolute position: a key at k is visible to a query at p iff p - k < W on a
  sliding layer (and k - p < W when it is not causal), and k <= p on a causal one (z-lab's
  `_attention_mask`, vLLM's attention window). Speculators' drafters were trained with the window
  anchored at the block instead (`create_anchor_block_mask_mod`): every query of a block sees the
  W context positions before its anchor and the whole block (causally or not), `from_anchor`.

A sliding layer's keys live in a ring of R slots (R >= W plus what a step writes past the
committed length), slot = position mod R: memory stays R per row however long the context. Rings
are head-major, [G, B, kv, R, d], so that attention's batched dots read them in place.
`ring_positions` says which position each slot holds when the positions below `start` were the
last written; the ring is written only with real positions (`ring_write`), so a slot never holds
padding. A full-attention cache is the same ring with R = the cache length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

FULL, SLIDING = "full_attention", "sliding_attention"


def declared_layer_types(config: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """The layer kinds transformers' Qwen3Config gives a config dict: `layer_types`, else sliding
    from `max_window_layers` on when `use_sliding_window` and `sliding_window` are set. ValueError
    naming a kind that is neither full nor sliding, or a list of the wrong length."""
    kinds = config.get("layer_types")
    if kinds is None:
        slides = hf_sliding_window(config) is not None
        first = config.get("max_window_layers", 28)
        return tuple(SLIDING if slides and i >= first else FULL for i in range(num_layers))
    bad = [k for k in kinds if k not in (FULL, SLIDING)]
    if bad:
        raise ValueError(f"layer kind {bad[0]!r} is not supported; drafter layers are {FULL!r} or {SLIDING!r}")
    if len(kinds) < num_layers:
        raise ValueError(f"layer_types lists {len(kinds)} kinds for {num_layers} layers")
    return tuple(kinds[:num_layers])


def hf_sliding_window(config: dict[str, Any]) -> int | None:
    """`sliding_window` as transformers' Qwen3Config keeps it: only with `use_sliding_window`, 4096
    when not written (a config saved as a diff from the defaults leaves it out)."""
    return config.get("sliding_window", 4096) if config.get("use_sliding_window") else None


def check_window(window, where: str) -> int:
    """The window, or ValueError naming it unless it is a positive integer."""
    if window is None:
        raise ValueError(f"{where} has sliding-attention layers but no window: set sliding_window with "
                         f"use_sliding_window true (or dflash_config.swa_window_size)")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{where}: sliding window {window!r} must be a positive integer")
    return window


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One layer's mask: `window` W (None: full attention), whether it is `causal`, and whether a
    block drafter's window is anchored at the block (`from_anchor`, Speculators' layout)."""

    window: int | None = None
    causal: bool = False
    from_anchor: bool = False

    def ring_size(self, max_len: int, extra: int = 0) -> int:
        """Cache slots per row: the window plus `extra` positions a step may write past the
        committed length, at most max_len (a full layer keeps max_len)."""
        return max_len if self.window is None else min(self.window + extra, max_len)

    def visible(self, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
        """q_pos [B, T], k_pos [B, S] (negative: an empty slot) -> [B, T, S] bool."""
        d = q_pos[:, :, None] - k_pos[:, None, :]
        seen = jnp.broadcast_to(k_pos[:, None, :] >= 0, d.shape)
        if self.causal:
            seen &= d >= 0
        if self.window is not None:
            seen &= d < self.window
            if not self.causal:
                seen &= -d < self.window
        return seen


    def block_visible(self, positions: jax.Array, held: jax.Array, ctx_len: jax.Array) -> jax.Array:
        """A block drafter's mask [B, T, S + T]: which context slots (holding positions held
        [B, S]), then which block positions, each block query at positions [B, T] sees; the
        context is the positions below ctx_len [B]."""
        if not self.from_anchor:
            return jnp.concatenate([self.visible(positions, held), self.visible(positions, positions)], axis=2)
        context = (held >= 0) & (held >= ctx_len[:, None] - self.window)
        context = jnp.broadcast_to(context[:, None, :], (*positions.shape, held.shape[1]))
        return jnp.concatenate([context, LayerAttention(causal=self.causal).visible(positions, positions)], axis=2)


def ring_positions(start: jax.Array, slots: int) -> jax.Array:
    """start [B]: every position below it was written last -> [B, slots] the position each slot
    holds (slot = position mod slots; negative where nothing was written)."""
    last = start[:, None] - 1
    return last - jnp.mod(last - jnp.arange(slots)[None, :], slots)


def ring_write(cache: jax.Array, values: jax.Array, start: jax.Array, n_valid: jax.Array) -> jax.Array:
    """Write values [G, B, kv, T, d] at positions start [B] + t into the head-major cache
    [G, B, kv, R, d], slot = position mod R, for t < n_valid [B] only, and of those the last R (a
    write of more than R positions keeps the newest; padding is never written)."""
    B, T, R = values.shape[1], values.shape[3], cache.shape[3]
    t = jnp.arange(T)[None, :]
    keep = (t < n_valid[:, None]) & (t >= n_valid[:, None] - R)
    slot = jnp.where(keep, jnp.mod(start[:, None] + t, R), R)  # R: out of range, dropped
    # the two index arrays, split by a slice, lead the indexed shape: [B, T, G, kv, d]
    updates = jnp.transpose(values, (1, 3, 0, 2, 4)).astype(cache.dtype)
    return cache.at[:, jnp.arange(B)[:, None], :, slot].set(updates, mode="drop")
