"""The programs of prefix caching and the host loop that runs them (the store itself is
`prefix_cache.PrefixCache`): a prompt is prefilled one block per pass, each pass over one row with
the cache's full length as its attention span, so a block's computation depends only on the
tokens up to its end; a prompt that starts like an earlier one has its caches restored from the
deepest cached block and runs only the passes after it.

`prefill_blocks` takes the `Runner` whose `run` compiles and calls each program."""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import Batch, KVCache
from models.qwen3_5 import Qwen3_5Model
from spec_jax.engine.prefix_cache import Block, PrefixCache
from spec_jax.engine.state import SpecPlan, plan_taps

# XLA options of a prefix-cache block pass: its kernels launched one by one, not replayed as a
# command buffer (a CUDA graph). The pass takes caches in buffers that move from call to call (a
# restore's output, the previous block's donated caches), where a recorded graph must follow them;
# on the H200 at 27B dims a hit's block pass took 46.8 ms with command buffers and 36.4 without.
# GPU-only: other backends ignore the option.
KERNEL_BY_KERNEL = {"xla_gpu_enable_command_buffer": ""}


def prefill_block(model: Qwen3_5Model, draft, cache, tokens, start, n_valid, *, cache_len: int,
                  plan: SpecPlan | None) -> tuple[Any, Block]:
    """One block of one row's prompt under prefix caching: tokens [1, C] at positions start [1]
    onward, n_valid [1] of them real. Attention spans every cache slot, so the pass computes the
    same whatever the prompt's length. Returns (cache, the block's `Block`: its KV slices, the GDN
    caches at its end, the target's hidden [1, C, H] and taps over it)."""
    out = model(tokens, Batch(start, n_valid), cache, kv_len=cache_len, taps=plan_taps(plan))
    C, at = tokens.shape[1], start[0]
    parts = tuple(KVCache(*(jax.lax.dynamic_slice_in_dim(x, at, C, axis=2) for x in (c.k, c.v)))
                  if isinstance(c, KVCache) else c for c in out.cache)
    return out.cache, Block(parts, out.hidden, out.taps)


def restore_blocks(model: Qwen3_5Model, draft, cache, blocks: tuple[Block, ...], start, *, cache_len: int):
    """A row's caches resumed from consecutive cached blocks starting at position start []:
    their KV slices written in place and, where the blocks carry them (only the
    deepest block the row resumes from does), the GDN caches at the end of the last one.
    cache None: a fresh row's (`init_cache`), made in the same program."""
    if cache is None:
        cache = model.init_cache(1, cache_len)

    def put(c, bs):
        if isinstance(c, KVCache):  # block by block in place: no concatenated copy of the run
            def write(x, name):
                for i, b in enumerate(bs):
                    part = getattr(b, name)
                    x = jax.lax.dynamic_update_slice_in_dim(x, part, start + i * part.shape[2], axis=2)
                return x
            return KVCache(write(c.k, "k"), write(c.v, "v"))
        return c if bs[-1] is None else bs[-1]

    return tuple(put(c, [b.cache[j] for b in blocks]) for j, c in enumerate(cache))


def restored_parts(blocks: Sequence[Block], *, deepest: bool) -> tuple[Block, ...]:
    """What `restore_blocks` reads of a run of blocks: their KV slices, and the GDN caches of the
    last one when it is the deepest block the row resumes from (earlier ones would be
    overwritten); the rest stays out of the call's arguments."""
    kv_groups = [j for j, c in enumerate(blocks[0].cache) if isinstance(c, KVCache)]

    def kv_only(block):  # a hit runs this for each of its blocks: no per-group test
        parts = [None] * len(block.cache)
        for j in kv_groups:
            parts[j] = block.cache[j]
        return Block(tuple(parts))

    last = Block(blocks[-1].cache) if deepest else kv_only(blocks[-1])
    return (*map(kv_only, blocks[:-1]), last)


def powers_of_two(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first: 37 -> [32, 4, 1]."""
    return [1 << i for i in reversed(range(n.bit_length())) if n >> i & 1]


def prefill_blocks(runner, plan: SpecPlan | None, store: PrefixCache, prompts, prompt_lengths, done):
    """Each live row's prompt resumes from its deepest cached block and runs the blocks after it
    one pass each, keeping every full block it computes. Returns the batch's caches, the target's
    hidden [B, C, H] over each row's last block (zeros for a padding row), its hidden and taps
    [B, W, ...] over the whole prompt when a proposer reads them (else None; W the prompt bucket
    rounded up to whole blocks, zeros at cached positions whose blocks kept none), and the prompts
    [B, W] on the host. Arguments may be host or device arrays; the programs take host ones as they are."""
    C, cache_len = store.block_size, runner.cache_len
    tokens, lengths, padding = np.asarray(prompts), np.asarray(prompt_lengths), np.asarray(done)
    width = -(-tokens.shape[1] // C) * C
    if width > tokens.shape[1]:
        tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
    fresh = partial(runner.run, "empty_row", lambda model, draft: model.init_cache(1, cache_len))
    run_block = partial(prefill_block, cache_len=cache_len, plan=plan)
    caches, outputs = [], []  # per row: its caches, and the target's outputs [1, C, ...] block by block
    for b in range(tokens.shape[0]):
        cache = None
        outputs.append([])
        if not padding[b]:
            ids = tokens[b, :lengths[b]]
            keys = store.keys(ids)
            found = store.lookup(ids, keys)
            cache = restore(runner, C, found) if found else fresh()
            outputs[-1] += [(blk.hidden, blk.taps) for blk in found]
            for i in range(len(found), -(-len(ids) // C)):
                cache, block = runner.run("prefill_block", run_block, cache, tokens[b:b + 1, i * C:(i + 1) * C],
                                          np.asarray([i * C], np.int32),
                                          np.asarray([min(C, len(ids) - i * C)], np.int32), static=(plan,),
                                          donate=(0,), options=KERNEL_BY_KERNEL)
                outputs[-1].append((block.hidden, block.taps))
                kept = block if plan else dataclasses.replace(block, hidden=None, taps=None)
                if i < min(len(keys), store.room(kept)):  # a full block, within what the budget holds
                    store.put(keys[i], kept)
            store.touch(keys)
        caches.append(fresh() if cache is None else cache)
    H, dtype = runner.cfg.hidden_size, runner.dtype
    last_blocks = [row[-1][0] if row else jnp.zeros((1, C, H), dtype) for row in outputs]
    last_blocks = last_blocks[0] if len(last_blocks) == 1 else jnp.concatenate(last_blocks)
    hidden, taps = assemble_outputs(outputs, width, C, H, len(plan_taps(plan)), dtype) if plan else (None, None)
    cache = caches[0] if len(caches) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *caches)
    return cache, last_blocks, hidden, taps, tokens


def restore(runner, block_size: int, found: Sequence[Block]):
    """A fresh row's caches resumed from its cached blocks `found` (in prompt order, at least
    one): one restore call per power of two of them. Not waited for: the device copies while
    the host dispatches the block pass that reads them."""
    cache, restored = None, 0
    for run in powers_of_two(len(found)):  # few programs, few calls: one per power of two
        parts = restored_parts(found[restored:restored + run], deepest=restored + run == len(found))
        cache = runner.run("restore_blocks", partial(restore_blocks, cache_len=runner.cache_len), cache, parts,
                           np.asarray(restored * block_size, np.int32), donate=(0,))
        restored += run
    return cache


def assemble_outputs(outputs, width: int, C: int, H: int, n_taps: int, dtype):
    """Rows' block outputs [(hidden [1, C, H] or None, taps or None), ...] -> hidden [B, W, H]
    and taps [B, W, n_taps*H] (or None), zeros where a block kept none."""

    def row(parts, j, size):
        have = [p[j] for p in parts] + [None] * (width // C - len(parts))
        pieces = []  # a run of blocks without outputs becomes one zeros array
        for missing, run in itertools.groupby(have, key=lambda x: x is None):
            run = list(run)
            pieces += [jnp.zeros((1, len(run) * C, size), dtype)] if missing else run
        return jnp.concatenate(pieces, axis=1)

    hidden = jnp.concatenate([row(parts, 0, H) for parts in outputs])
    taps = jnp.concatenate([row(parts, 1, n_taps * H) for parts in outputs]) if n_taps else None
    return hidden, taps
