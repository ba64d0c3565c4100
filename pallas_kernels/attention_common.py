"""Pieces shared by the flash-attention kernels (Triton and wgmma): which cache blocks a range walks."""

import jax.numpy as jnp


def key_range(seen, split, splits: int):
    """The key blocks [first, first + steps) that range `split` of `splits` walks for queries that
    see `seen` blocks (int32 scalars, seen >= 1): the seen blocks cut into `splits` runs of
    ceil(seen / splits), so the ranges share the work evenly however long the cache is (a static
    cut of the whole cache would leave it all to the first ranges of a long one)."""
    per_split = (seen + splits - 1) // splits
    first = split * per_split
    return first, jnp.clip(seen - first, 0, per_split)
