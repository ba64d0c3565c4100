"""Exact prefix caching for the GDN hybrid: a store of prompt blocks keyed by the whole prefix.

With prefix caching on, a prompt is prefilled in passes of one block (`block_size` tokens, a
multiple of the GDN chunk), each pass over one row with the cache's full length as its
attention span, so a block's computation depends only on the tokens up to its end, never on how
long the prompt is or how many blocks a request found cached. After each full block the store
keeps what resuming there needs (`Block`): the block's attention KV, the GDN recurrent state and
conv window at its end, and the target's outputs over the block that proposers read at prefill
(post-norm hidden, drafter taps). A later prompt that starts with the same tokens has its cache
filled from the deepest cached block and runs only the passes after it: the same passes on the
same inputs as without the hit, so logits, caches and every proposer's state come out bitwise
equal, on any device and in any dtype.

Keys chain a SHA-256 over the prefix's token ids, block by block, from a root that names the
model, its dtype and what the blocks hold, so two different prefixes never share a block. The
store is an LRU over a byte budget on the device. A block is always made more recent than the
blocks after it in its prefix (a lookup or a prefill touches a prefix's blocks deepest first),
so eviction takes the deepest blocks of the coldest prefixes first; a prompt keeps no more of its
blocks than the budget holds, so its own later blocks never push out its first ones.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any, Sequence

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
    """One cached block of one row. cache: per layer group, `KVCache` slices [G, 1, C, kv, d] of
    the block's positions or the `GDNCache` (conv window, state) at its end; hidden [1, C, H] and
    taps [1, C, n*H] of the target over the block (None when no proposer reads them)."""

    cache: tuple
    hidden: Any = None
    taps: Any = None


def block_bytes(block: Block) -> int:
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(block))


class PrefixCache:
    """The block store of one engine. `root` names the model, dtype and block contents; blocks
    are device arrays held in LRU order under `budget_bytes`."""

    def __init__(self, root: str, block_size: int, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget {budget_bytes} bytes must be >= 0")
        self.root = hashlib.sha256(root.encode()).digest()
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.blocks: collections.OrderedDict[bytes, tuple[Block, int]] = collections.OrderedDict()
        self.bytes = 0
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found cached (prefix_cache_hits)

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The chained key of every full block of `tokens`: key i covers tokens[: (i + 1) C]."""
        C, h, out = self.block_size, self.root, []
        ids = np.asarray(tokens, np.int64)
        for i in range(len(ids) // C):
            h = hashlib.sha256(h + ids[i * C:(i + 1) * C].tobytes()).digest()
            out.append(h)
        return out

    def lookup(self, tokens: Sequence[int]) -> list[Block]:
        """The cached blocks a prompt can resume from, deepest last: the longest run of cached
        blocks from its start, leaving at least its last token to run (its logits draw the first
        token). A prompt longer than a block counts as a query of its tokens (a shorter one can
        never hit), its cached blocks' tokens as hits."""
        if len(tokens) <= self.block_size:
            return []
        found = []
        for key in self.keys(tokens[:len(tokens) - 1]):
            if key not in self.blocks:
                break
            found.append(key)
        self.touch(found)
        self.queries += len(tokens)
        self.hits += len(found) * self.block_size
        return [self.blocks[key][0] for key in found]

    def room(self, block: Block) -> int:
        """How many blocks of this one's size the budget holds."""
        return self.budget_bytes // max(block_bytes(block), 1)

    def put(self, key: bytes, block: Block) -> None:
        """Keep a block, evicting the least recently used ones beyond the budget."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return
        size = block_bytes(block)
        if size > self.budget_bytes:
            return
        self.blocks[key] = (block, size)
        self.bytes += size
        while self.bytes > self.budget_bytes:
            _, (_, evicted) = self.blocks.popitem(last=False)
            self.bytes -= evicted

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make a prefix's blocks (keys in prompt order) the most recent, parents last."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def stats(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits, "blocks": len(self.blocks),
                "bytes": self.bytes, "budget_bytes": self.budget_bytes}
