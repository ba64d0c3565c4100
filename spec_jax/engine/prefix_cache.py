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
store is an LRU over a byte budget in device memory, with an optional second tier in host
memory for the blocks the device evicts. A block is always made more recent than the
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


class Tier:
    """Blocks in LRU order under a byte budget (key -> (block, bytes)); `add` returns what it evicted."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget {budget_bytes} bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self.blocks: collections.OrderedDict[bytes, tuple[Any, int]] = collections.OrderedDict()
        self.bytes = 0

    def add(self, key: bytes, block, size: int) -> list[tuple[bytes, Any, int]]:
        if key in self.blocks or size > self.budget_bytes:
            return []
        self.blocks[key] = (block, size)
        self.bytes += size
        evicted = []
        while self.bytes > self.budget_bytes:
            old, (gone, gone_size) = self.blocks.popitem(last=False)
            self.bytes -= gone_size
            evicted.append((old, gone, gone_size))
        return evicted

    def pop(self, key: bytes):
        block, size = self.blocks.pop(key)
        self.bytes -= size
        return block, size


class PrefixCache:
    """The block store of one engine. `root` names the model, dtype and block contents. Blocks
    live in device memory in LRU order under `budget_bytes`; with a `host_budget_bytes`, blocks
    the device evicts move to host memory, and a hit there is copied back (bitwise: a copy),
    which costs a transfer instead of the block's prefill pass."""

    def __init__(self, root: str, block_size: int, budget_bytes: int, host_budget_bytes: int = 0):
        self.root = hashlib.sha256(root.encode()).digest()
        self.block_size = block_size
        self.device, self.host = Tier(budget_bytes), Tier(host_budget_bytes)
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens found cached (prefix_cache_hits)
        self.host_hits = 0  # of those, tokens copied back from host memory
        self.found_tokens: list[int] = []  # tokens each lookup found cached, in order, until `take_found`

    @property
    def budget_bytes(self) -> int:
        return self.device.budget_bytes

    @budget_bytes.setter
    def budget_bytes(self, value: int) -> None:
        self.device.budget_bytes = value

    @property
    def bytes(self) -> int:
        return self.device.bytes

    @property
    def blocks(self):
        return self.device.blocks

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The chained key of every full block of `tokens`: key i covers tokens[: (i + 1) C]."""
        ids = memoryview(np.ascontiguousarray(tokens, np.int32)).cast("B")  # token ids fit 32 bits
        step, h, out = 4 * self.block_size, self.root, []
        for end in range(step, len(ids) + 1, step):
            h = hashlib.sha256(h + ids[end - step:end]).digest()
            out.append(h)
        return out

    def lookup(self, tokens: Sequence[int], keys: Sequence[bytes] | None = None) -> list[Block]:
        """The cached blocks a prompt can resume from, deepest last: the longest run of cached
        blocks from its start, leaving at least its last token to run (its logits draw the first
        token); blocks found in host memory come back to the device. A prompt longer than a block
        counts as a query of its tokens (a shorter one can never hit), its cached blocks' tokens
        as hits. keys: `keys(tokens)` if the caller has them already."""
        if len(tokens) <= self.block_size:
            self.found_tokens.append(0)
            return []
        keys = self.keys(tokens) if keys is None else keys
        seen, found = [], []  # found: the blocks themselves, as a copy back may evict ones found earlier
        for key in keys[:(len(tokens) - 1) // self.block_size]:
            if key in self.device.blocks:
                self.device.blocks.move_to_end(key)
                block = self.device.blocks[key][0]
            elif key in self.host.blocks:
                (host_block, shardings), size = self.host.pop(key)
                block = jax.device_put(host_block, shardings)
                self._to_device(key, block, size)
                self.host_hits += self.block_size
            else:
                break
            seen.append(key)
            found.append(block)
        self.touch(seen)
        self.queries += len(tokens)
        self.hits += len(found) * self.block_size
        self.found_tokens.append(len(found) * self.block_size)
        return found

    def take_found(self) -> list[int]:
        """The tokens each lookup since the last call found cached (a request's vLLM
        num_cached_tokens), in lookup order; starts the next list."""
        found, self.found_tokens = self.found_tokens, []
        return found

    def clear(self) -> None:
        """Drop every block, on the device and in host memory (vLLM's reset_prefix_cache); the
        lifetime counters stay."""
        self.device, self.host = Tier(self.device.budget_bytes), Tier(self.host.budget_bytes)

    def room(self, block: Block) -> int:
        """How many blocks of this one's size the device and host budgets hold."""
        return (self.device.budget_bytes + self.host.budget_bytes) // max(block_bytes(block), 1)

    def put(self, key: bytes, block: Block) -> None:
        """Keep a block, evicting the least recently used ones beyond the budget (to host memory
        when it has a budget)."""
        if key in self.device.blocks:
            self.device.blocks.move_to_end(key)
            return
        self._to_device(key, block, block_bytes(block))

    def _to_device(self, key: bytes, block: Block, size: int) -> None:
        """Keep a block on the device; what that evicts, or the block itself if it is larger than
        the device budget, goes to host memory (with its shardings, to come back as it was)."""
        overflow = [(key, block, size)] if size > self.device.budget_bytes else self.device.add(key, block, size)
        for old, gone, gone_size in overflow if self.host.budget_bytes else ():
            self.host.add(old, (jax.device_get(gone), jax.tree.map(lambda x: x.sharding, gone)), gone_size)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Make a prefix's blocks (keys in prompt order) the most recent, parents last."""
        for key in reversed(keys):
            if key in self.device.blocks:
                self.device.blocks.move_to_end(key)

    def stats(self) -> dict:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits, "blocks": len(self.device.blocks),
                "bytes": self.device.bytes, "budget_bytes": self.device.budget_bytes,
                "host_blocks": len(self.host.blocks), "host_bytes": self.host.bytes, "host_hits": self.host_hits}
