"""Token sampling on the device, with per-row parameters.

Each row carries its own temperature, top-k, top-p and PRNG key, so one batch mixes greedy and
sampled requests. A row's randomness at a position is `fold_in(row_key, position)`: the same
seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowSampling:
    """Per-row sampling parameters. temperature [B] (0 = greedy), top_k [B] (0 = off),
    top_p [B] (1 = off), key [B] typed PRNG keys."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array


def warp_logits(logits: jax.Array, params: RowSampling) -> jax.Array:
    """Temperature, then top-k, then top-p: logits [B, V] float32 -> masked, scaled logits [B, V]
    (removed tokens at -inf). softmax of the result is the distribution a row samples from."""
    V = logits.shape[-1]
    t = jnp.where(params.temperature > 0, params.temperature, 1.0)
    scaled = logits / t[:, None]
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
    keys = jax.vmap(jax.random.fold_in)(params.key, positions)
    warped = warp_logits(logits, params)
    drawn = jax.vmap(jax.random.categorical)(keys, warped).astype(jnp.int32)
    return jnp.where(params.temperature > 0, drawn, greedy)
