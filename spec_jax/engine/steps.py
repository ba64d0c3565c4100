"""The functional engine: explicit state pytrees, pure jitted prefill / decode, on-device loop.

Everything a step reads or writes is in `DecodeState`; `decode_loop` is a `lax.while_loop`
over `decode_step`, so a whole generation runs on the device with no host round trip per
token. `Engine` compiles these ahead of time, once per shape bucket:

  * batch rows B: a power of two up to `max_num_seqs` (and `max_num_seqs` itself);
  * prompt length T: a power of two, at least 64 (the GDN chunk), up to the cache length;
  * cache length L: `max_model_len` rounded up to a multiple of 64, fixed per engine.

A call with a new (B, T, sampling) bucket compiles once; the docstrings say which bucket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import time
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import Var
from jax.sharding import Mesh

from models.layers import Batch, KVCache
from models.qwen3_5 import CHUNK, ForwardOut, Qwen3_5Config, Qwen3_5Model, init_cache
from models.tensor_parallel import replicate
from pallas_kernels.batch_invariant import batch_invariant, invariant_rows, invariant_tile_rows
from proposers import Proposer
from proposers.oracle import SyntheticAcceptance
from spec_jax.engine.prefix_cache import Block, PrefixCache
from spec_jax.engine.sampling import (EmittedLogprobs, RowSampling, TokenHistory, accept_drafts, accept_synthetic, draw,
                                     process_logits, ranked_logprobs, sample_tokens, warp_logits)

log = logging.getLogger("spec_jax")

# XLA options of a prefix-cache block pass: its kernels launched one by one, not replayed as a
# command buffer (a CUDA graph). The pass takes caches in buffers that move from call to call (a
# restore's output, the previous block's donated caches), where a recorded graph must follow them;
# on the H200 at 27B dims a hit's block pass took 46.8 ms with command buffers and 36.4 without.
# GPU-only: other backends ignore the option.
KERNEL_BY_KERNEL = {"xla_gpu_enable_command_buffer": ""}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecStats:
    """Per-row speculation counters. drafted, accepted: [B] draft tokens proposed / accepted;
    num_drafts: [B] steps that verified at least one draft; per_position: [B, k] how often the
    draft at each position was accepted."""

    drafted: jax.Array
    accepted: jax.Array
    num_drafts: jax.Array
    per_position: jax.Array

    @classmethod
    def zeros(cls, batch: int, k: int) -> "SpecStats":
        z = jnp.zeros((batch,), jnp.int32)
        return cls(z, z, z, jnp.zeros((batch, k), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The decode state of B rows.

    tokens: [B, L] int32 prompt then generated tokens. lengths: [B] tokens in `tokens`; the
    caches hold the first lengths - 1 of them (the newest token is fed by the next step).
    prompt_lengths, max_lengths: [B] (a row stops when lengths reaches max_lengths).
    done: [B] bool. stop_ids: [B, S] int32 (-1 pads). sampling: per-row `RowSampling`.
    cache: the model's `ModelCache`. steps: [] int32 decode steps run so far.
    speculate: [B] bool rows that draft (a per-request opt-out); proposer: the draft method's
    own state; stats: `SpecStats` (both empty when speculation is off); history: the
    `TokenHistory` penalties read (None when no row has a penalty); logprobs: the written tokens'
    `EmittedLogprobs` (None unless asked for).
    """

    tokens: jax.Array
    lengths: jax.Array
    prompt_lengths: jax.Array
    max_lengths: jax.Array
    done: jax.Array
    stop_ids: jax.Array
    sampling: RowSampling
    cache: tuple
    steps: jax.Array
    speculate: jax.Array
    proposer: Any = ()
    stats: SpecStats | None = None
    history: TokenHistory | None = None
    logprobs: EmittedLogprobs | None = None


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """Static description of the speculative step: the proposer (a frozen dataclass from
    `proposers/`), k drafts per step, the GDN rollback ("checkpoint" or "replay"), and whether
    drafts are sampled with their probabilities kept (vLLM's draft_sample_method)."""

    proposer: Proposer
    k: int
    rollback: str = "replay"
    probabilistic: bool = False


def plan_taps(plan: SpecPlan | None) -> tuple[int, ...]:
    """Target layers whose outputs the plan's proposer reads (DFlash), else none."""
    return getattr(plan.proposer, "taps", ()) if plan is not None else ()


def append_tokens(state: DecodeState, new: jax.Array, count: jax.Array, cache, logits=None) -> DecodeState:
    """Write up to `count` [B] of the tokens new [B, m] per live row, stopping after the first
    stop token and at max_lengths; then update done. logits [B, m, V]: the raw target logits each
    token was drawn from (for `state.logprobs`; None when it is None)."""
    B, m = new.shape
    j = jnp.arange(m)[None, :]
    is_stop = jnp.any(new[:, :, None] == state.stop_ids[:, None, :], axis=-1) & (j < count[:, None])
    first_stop = jnp.min(jnp.where(is_stop, j, m), axis=1)
    room = state.max_lengths - state.lengths
    n = jnp.where(state.done, 0, jnp.minimum(jnp.minimum(count, first_stop + 1), room))
    history = None if state.history is None else state.history.add(new, n)
    idx = state.lengths[:, None] + j
    idx = jnp.where(j < n[:, None], idx, state.tokens.shape[1])  # out of range: dropped
    tokens = state.tokens.at[jnp.arange(B)[:, None], idx].set(new, mode="drop")
    logprobs = None if state.logprobs is None else state.logprobs.write(idx, logits, new)
    lengths = state.lengths + n
    stopped = (first_stop < n) | (lengths >= state.max_lengths)
    return dataclasses.replace(state, tokens=tokens, lengths=lengths, done=state.done | stopped, cache=cache,
                               history=history, logprobs=logprobs)


def drafting_policy(sampling: RowSampling, *, probabilistic: bool, do_sample: bool):
    """The `choose(logits, positions)` proposers draft with: argmax (q one-hot), or, for
    probabilistic drafting of sampled rows, a draw from the row's distribution with its q."""

    def choose(logits, positions):
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if not (probabilistic and do_sample):
            return greedy, None
        warped = warp_logits(logits, sampling)
        drawn = draw(warped, sampling, positions, stream=2)
        return jnp.where(sampling.temperature > 0, drawn, greedy), jax.nn.softmax(warped, axis=-1)

    return choose


def prefill(model: Qwen3_5Model, draft, prompts, prompt_lengths, max_lengths, stop_ids, sampling: RowSampling, done,
            speculate, reference, *, cache_len: int, do_sample: bool, plan: SpecPlan | None,
            num_logprobs: int | None = None) -> DecodeState:
    """Run the prompts, sample each row's first token, and start the proposer.

    prompts: [B, T] int32, right-padded; prompt_lengths: [B] (>= 1); max_lengths: [B];
    stop_ids: [B, S]; done: [B] bool (True for padding rows of the batch bucket); speculate:
    [B] bool; reference: [B, L] (oracle proposer only, else None).
    Returns the `DecodeState` with the caches holding each prompt.
    """
    B, T = prompts.shape
    cache = init_cache(model.cfg, B, cache_len, model.dtype)
    batch = Batch(start=jnp.zeros((B,), jnp.int32), n_valid=prompt_lengths)
    # Batch-invariant: attention spans the whole cache in every pass, prefill included.
    target = model(prompts, batch, cache, kv_len=cache_len if invariant_rows() else T, taps=plan_taps(plan))
    last = target.hidden[jnp.arange(B), prompt_lengths - 1]
    return start_decode(model, draft, target, last, prompts, prompt_lengths, max_lengths, stop_ids, sampling, done,
                        speculate, reference, cache_len=cache_len, do_sample=do_sample, plan=plan,
                        num_logprobs=num_logprobs)


def start_decode(model: Qwen3_5Model, draft, target: ForwardOut, last, prompts, prompt_lengths, max_lengths,
                 stop_ids, sampling: RowSampling, done, speculate, reference, *, cache_len: int, do_sample: bool,
                 plan: SpecPlan | None, num_logprobs: int | None = None) -> DecodeState:
    """What prefill does after the target's pass over the prompts: sample each row's first token
    from last [B, H], the hidden state at its last prompt position, and start the proposer on
    the target's outputs. target: that pass's `ForwardOut` (the caches holding the prompts;
    hidden [B, T, H] and taps, read only by a proposer); the other arguments as `prefill`'s."""
    B, T = prompts.shape
    cache = target.cache
    history = None if sampling.penalties is None else TokenHistory.of_prompts(prompts, prompt_lengths,
                                                                              model.cfg.vocab_size)
    raw = model.logits(last)
    first = sample_tokens(process_logits(raw, sampling, prompt_lengths, history), sampling, prompt_lengths,
                          do_sample=do_sample)
    tokens = jnp.zeros((B, cache_len), jnp.int32).at[:, :T].set(prompts)
    logprobs = None if num_logprobs is None else EmittedLogprobs.empty(B, cache_len, num_logprobs)
    state = DecodeState(tokens, prompt_lengths, prompt_lengths, max_lengths, done, stop_ids, sampling, cache,
                        jnp.zeros((), jnp.int32), speculate, history=history, logprobs=logprobs)
    state = append_tokens(state, first[:, None], jnp.ones_like(first), cache, raw[:, None])
    if plan is None:
        return state
    choose = drafting_policy(sampling, probabilistic=plan.probabilistic, do_sample=do_sample)
    pstate = plan.proposer.init_state(model, draft, state.tokens, state.lengths, target, choose, reference)
    return dataclasses.replace(state, proposer=pstate, stats=SpecStats.zeros(B, plan.k))


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
        cache = init_cache(model.cfg, 1, cache_len, model.dtype)

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


def generated_before(state: DecodeState, drafts: jax.Array | None = None) -> jax.Array | None:
    """What multi-token bad words match against (None when no row has any): the P tokens before
    the next position, [B, P], or before each verify position after drafts [B, k], [B, k+1, P];
    -1 in place of prompt tokens (only generated tokens count, as in vLLM)."""
    if state.sampling.bad_words is None:
        return None
    P = state.sampling.bad_words[0].shape[-1]
    idx = state.lengths[:, None] - P + jnp.arange(P)[None, :]
    before = jnp.take_along_axis(state.tokens, jnp.maximum(idx, 0), axis=1)
    before = jnp.where(idx >= state.prompt_lengths[:, None], before, -1)
    if drafts is None:
        return before
    following = jnp.concatenate([before, drafts], axis=1)  # [B, P + k]
    return jnp.stack([following[:, j:j + P] for j in range(drafts.shape[1] + 1)], axis=1)


def decode_one(model: Qwen3_5Model, state: DecodeState, taps: tuple[int, ...], *,
               do_sample: bool) -> tuple[jax.Array, ForwardOut, jax.Array]:
    """Feed each live row's newest token; returns the next token [B], the pass's `ForwardOut` and
    its raw logits [B, V]."""
    B, L = state.tokens.shape
    newest = state.tokens[jnp.arange(B), state.lengths - 1][:, None]
    batch = Batch(start=state.lengths - 1, n_valid=(~state.done).astype(jnp.int32))
    out = model(newest, batch, state.cache, kv_len=L, taps=taps)
    raw = model.logits(out.hidden[:, 0])
    logits = process_logits(raw, state.sampling, state.lengths, state.history, recent=generated_before(state))
    return sample_tokens(logits, state.sampling, state.lengths, do_sample=do_sample), out, raw


def decode_step(model: Qwen3_5Model, draft, state: DecodeState, *, do_sample: bool) -> DecodeState:
    """Plain decoding: feed each live row's newest token and sample the next one."""
    nxt, out, raw = decode_one(model, state, (), do_sample=do_sample)
    state = append_tokens(state, nxt[:, None], jnp.ones_like(nxt), out.cache, raw[:, None])
    return dataclasses.replace(state, steps=state.steps + 1)


def spec_step(model: Qwen3_5Model, draft, state: DecodeState, *, plan: SpecPlan, do_sample: bool) -> DecodeState:
    """One speculative step: propose k drafts, verify [newest, d1..dk] in one target pass,
    accept, roll every cache back to the accepted prefix, append n_acc + 1 tokens per row.

    Rows that do not speculate (or whose proposer found nothing) carry n_draft = 0: their
    verify pass is a plain decode step of one token, in the same batch. For proposers that can
    come up empty (`may_not_draft`: ngram), a step where no row has a draft runs a one-token pass
    instead of the k+1 verify; other methods always draft, and compile only the verify.
    """
    B, L = state.tokens.shape
    k, rows, live = plan.k, jnp.arange(B), ~state.done
    choose = drafting_policy(state.sampling, probabilistic=plan.probabilistic, do_sample=do_sample)
    drafts, n_draft, q, pstate = plan.proposer.propose(model, draft, state.proposer, state.tokens, state.lengths,
                                                       choose)
    # No drafting for opted-out or finished rows, nor past a row's last allowed token.
    room = jnp.maximum(state.max_lengths - state.lengths - 1, 0)
    n_draft = jnp.where(state.speculate & live, jnp.minimum(n_draft, room), 0)
    newest = state.tokens[rows, state.lengths - 1]

    def verify(_):
        inputs = jnp.concatenate([newest[:, None], drafts], axis=1)  # [B, k+1]
        batch = Batch(start=state.lengths - 1, n_valid=jnp.where(live, n_draft + 1, 0))
        target = model(inputs, batch, state.cache, kv_len=L, rollback=plan.rollback, taps=plan_taps(plan))
        positions = state.lengths[:, None] + jnp.arange(k + 1)[None, :]
        counts = None if state.history is None else state.history.through(drafts)
        raw = model.logits(target.hidden)
        logits = process_logits(raw, state.sampling, positions, state.history, counts,
                                generated_before(state, drafts))
        if isinstance(plan.proposer, SyntheticAcceptance):
            n_acc, emitted = accept_synthetic(plan.proposer.rates_of(pstate), logits, drafts, n_draft,
                                              state.sampling, state.lengths, do_sample=do_sample)
        else:
            n_acc, emitted = accept_drafts(logits, drafts, n_draft, q, state.sampling, state.lengths,
                                           do_sample=do_sample)
        cache = model.commit(target.cache, target.pending, jnp.where(live, n_acc + 1, 0))
        return n_acc, emitted, cache, dataclasses.replace(target, cache=None, pending=None), kept(raw)

    def decode_only(_):
        # `decode_one`, its outputs padded to the k+1 positions proposers read (past
        # n_acc + 1 = 1 they are never read).
        nxt, target, raw = decode_one(model, state, plan_taps(plan), do_sample=do_sample)
        pad = lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, k), (0, 0)))  # noqa: E731
        emitted = jnp.concatenate([nxt[:, None], drafts], axis=1)
        return (jnp.zeros_like(n_draft), emitted, target.cache, ForwardOut(pad(target.hidden), None, pad(target.taps)),
                kept(pad(raw[:, None])))

    def kept(raw):  # the raw logits leave the branch only when logprobs are kept
        return None if state.logprobs is None else raw

    if getattr(plan.proposer, "may_not_draft", False):
        n_acc, emitted, cache, target, raw = jax.lax.cond(jnp.any(n_draft > 0), verify, decode_only, None)
    else:
        n_acc, emitted, cache, target, raw = verify(None)
    pstate = plan.proposer.update(model, draft, pstate, target, emitted, n_acc, state.lengths, choose)

    s = state.stats
    accepted_at = (jnp.arange(k)[None, :] < n_acc[:, None]) & live[:, None]
    stats = SpecStats(s.drafted + n_draft, s.accepted + jnp.where(live, n_acc, 0),
                      s.num_drafts + (n_draft > 0), s.per_position + accepted_at)
    state = append_tokens(state, emitted, n_acc + 1, cache, raw)
    return dataclasses.replace(state, proposer=pstate, stats=stats, steps=state.steps + 1)


def decode_loop(model: Qwen3_5Model, draft, state: DecodeState, max_steps, *, do_sample: bool,
                plan: SpecPlan | None = None) -> DecodeState:
    """Steps in a `lax.while_loop` until every row is done or `max_steps` more steps ran: the
    plain `decode_step`, or `spec_step` when a plan is given. max_steps is traced, so
    streaming in chunks reuses one executable."""
    stop_at = state.steps + max_steps
    step = partial(decode_step, do_sample=do_sample) if plan is None else partial(spec_step, plan=plan,
                                                                                     do_sample=do_sample)

    def cond(s):
        return jnp.any(~s.done) & (s.steps < stop_at)

    return jax.lax.while_loop(cond, partial(step, model, draft), state)


def insert_row(state: DecodeState, row: jax.Array, new: DecodeState) -> DecodeState:
    """Write the one-row state `new` (a batch-1 prefill) into row `row` [] int32 of the B-row
    `state`: tokens, lengths, sampling, every cache and the proposer's state; `steps` stays the
    batch's. A leaf's batch axis is the one where `new` has 1 and `state` has B (caches are
    [G, B, ...], the rest [B, ...]); with B = 1 the row replaces the whole leaf."""
    B = state.done.shape[0]

    def put(old, one):
        if old.ndim == 0:
            return old
        axes = [i for i, (a, b) in enumerate(zip(old.shape, one.shape)) if a != b]
        if not axes and B == 1:
            return one
        if len(axes) != 1 or one.shape[axes[0]] != 1:
            raise ValueError(f"cannot insert a leaf of shape {one.shape} into one of shape {old.shape}: "
                             f"expected the same shape with 1 in place of the batch size {B}")
        return jax.lax.dynamic_update_slice_in_dim(old, one, row, axes[0])

    return jax.tree.map(put, state, new)


def with_processors(state: DecodeState, names: frozenset[str], num_logprobs: int | None,
                    vocab_size: int) -> DecodeState:
    """The B-row `state` carrying exactly the logit processors `names` (`RowSampling`'s optional
    fields, with the `TokenHistory` penalties read) and `num_logprobs` top logprobs per written
    token (None: no logprobs). What stays is kept; what is added starts neutral, so the rows
    already running produce the same tokens (logprobs of another width start empty). A continuous batch widens to what a new request needs
    and narrows when no row needs it any more; the step compiles once per combination."""
    B, L = state.tokens.shape
    sampling = state.sampling.with_processors(names, vocab_size, state.stop_ids)
    history = None
    if "penalties" in names:
        history = state.history if state.history is not None else TokenHistory.empty(B, vocab_size)
    logprobs = None
    if num_logprobs is not None:
        kept = state.logprobs
        logprobs = kept if kept is not None and kept.top.shape[-1] == num_logprobs else EmittedLogprobs.empty(
            B, L, num_logprobs)
    return dataclasses.replace(state, sampling=sampling, history=history, logprobs=logprobs)


def forward_logits(model: Qwen3_5Model, draft, tokens, length, *, cache_len: int):
    """Full-sequence logits of one right-padded sequence: tokens [1, T], length [1] -> [1, T, V]."""
    cache = init_cache(model.cfg, 1, cache_len, model.dtype)
    batch = Batch(start=jnp.zeros((1,), jnp.int32), n_valid=length)
    return model.logits(model(tokens, batch, cache, kv_len=tokens.shape[1]).hidden)


# ----------------------------------------------------------------------------- compilation


def prompt_logprobs(model: Qwen3_5Model, draft, tokens, length, *, num: int):
    """vLLM's prompt logprobs of one right-padded prompt: tokens [1, T], length [1] -> (token [T-1],
    rank [T-1], top_ids [T-1, num], top [T-1, num]) for prompt tokens 1..T-1, from the raw logits
    at the position before each (`ranked_logprobs`). Logits are made CHUNK positions at a time,
    so a long prompt never holds [T, V] at once."""
    T = tokens.shape[1]
    cache = init_cache(model.cfg, 1, T, model.dtype)
    hidden = model(tokens, Batch(start=jnp.zeros((1,), jnp.int32), n_valid=length), cache, kv_len=T).hidden[0]
    following = jnp.concatenate([tokens[0, 1:], tokens[0, :1]])  # the token each position predicts; the last unused

    def chunk(args):
        h, nxt = args
        return ranked_logprobs(model.logits(h), nxt, num)

    blocks = (hidden.reshape(T // CHUNK, CHUNK, -1), following.reshape(T // CHUNK, CHUNK))
    return jax.tree.map(lambda x: x.reshape((T,) + x.shape[2:])[:-1], jax.lax.map(chunk, blocks))


def cache_length(max_model_len: int, prefix_cache: PrefixCache | None = None) -> int:
    """Cache slots of an engine: max_model_len rounded up to the GDN chunk, or to the prefix
    cache's block size (a block pass writes whole blocks)."""
    unit = CHUNK if prefix_cache is None else prefix_cache.block_size
    return -(-max_model_len // unit) * unit


def powers_of_two(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first: 37 -> [32, 4, 1]."""
    return [1 << i for i in reversed(range(n.bit_length())) if n >> i & 1]


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at hi."""
    return min(max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1))))), hi)


def enable_compilation_cache() -> None:
    """Persist compiled executables across processes (override the folder with SPEC_JAX_XLA_CACHE)."""
    folder = os.environ.get("SPEC_JAX_XLA_CACHE", os.path.expanduser("~/.cache/spec_jax/xla"))
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def default_decode_layout() -> bool:
    """Whether an engine switches its networks to the decode layout when not told: on the GPU,
    where XLA copies weights sliced out of a stack inside the decode loop; elsewhere the stacked,
    rolled layout compiles faster and runs alike."""
    return jax.default_backend() == "gpu"


def read_inputs(jaxpr, n: int) -> list[int]:
    """Which of a jaxpr's first n inputs its equations or outputs read, in order."""
    read = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, Var)}
    read.update(v for v in jaxpr.outvars if isinstance(v, Var))
    return [i for i, v in enumerate(jaxpr.invars[:n]) if v in read]


def describe_shapes(args) -> str:
    """The bucket an executable serves, for log lines: batch rows x tokens of its first array."""
    first = next((a for a in jax.tree.leaves(args) if getattr(a, "ndim", 0) >= 1), None)
    if first is None:
        return "its inputs"
    return f"batch {first.shape[0]}" + (f" x {first.shape[1]}" if first.ndim >= 2 else "")


class Engine:
    """A loaded model plus its ahead-of-time compiled executables, keyed by shape bucket."""

    def __init__(self, model: Qwen3_5Model, *, max_model_len: int, max_num_seqs: int, plan: SpecPlan | None = None,
                 draft=None, decode_layout: bool | None = None, batch_buckets: tuple[int, ...] | None = None,
                 compiler_options: dict | None = None, mesh: Mesh | None = None,
                 prefix_cache: PrefixCache | None = None, batch_invariant: bool = False):
        """draft: the proposer's own network (an NNX model), if its method has one.
        batch_buckets: the batch row counts to compile for (each <= max_num_seqs); None: powers of two.
        compiler_options: XLA options for every executable (`jax.stages.Lowered.compile`'s).
        decode_layout: switch the target and a drafter with stacked layers to their decode layout
        (`Qwen3_5Model.use_decode_layout`, in place: every layer's weights arrays of their own, run
        unrolled); None: `default_decode_layout()`.
        mesh: the tensor-parallel mesh the target was sharded over (`models.tensor_parallel`);
        every program is compiled over it and the drafter's weights are copied to each device.
        prefix_cache: a `PrefixCache` store: prompts are prefilled a block at a time and resume
        from the deepest cached block (the cache length is then a multiple of its block size).
        batch_invariant: trace the target batch-invariant (`pallas_kernels.batch_invariant`): a
        token's logits are bitwise the same in any pass, so greedy speculation equals plain decoding."""
        if default_decode_layout() if decode_layout is None else decode_layout:
            for network in (model, draft):
                if hasattr(network, "use_decode_layout"):
                    network.use_decode_layout()
        self.cfg: Qwen3_5Config = model.cfg
        self.dtype = model.dtype
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.batch_buckets = batch_buckets
        self.compiler_options = compiler_options
        self.prefix_cache = prefix_cache
        if batch_invariant and model.cfg.is_moe:
            raise ValueError("batch_invariant=True is built for dense models; this checkpoint routes experts "
                             f"(num_experts={model.cfg.num_experts})")
        self.invariant_rows = invariant_tile_rows() if batch_invariant else None
        self.cache_len = cache_length(max_model_len, prefix_cache)
        self.plan = plan
        self.mesh = mesh
        self.graphdef, self.params = nnx.split((model, draft))
        if mesh is not None:
            self.params = replicate(self.params, mesh)
        # Programs take the parameters as one flat list: flattening the nnx State (a Variable
        # node per leaf) on every call costs about a millisecond of host time.
        self.param_leaves, self.param_tree = jax.tree.flatten(self.params)
        self.executables = {}

    def batch_bucket(self, n: int) -> int:
        """The rows a batch of n runs in: the smallest bucket that holds it, max_num_seqs at most."""
        if self.batch_buckets is None:
            return bucket(n, 1, self.max_num_seqs)
        return min([b for b in self.batch_buckets if n <= b < self.max_num_seqs] + [self.max_num_seqs])

    def prompt_bucket(self, n: int) -> int:
        return bucket(n, CHUNK, self.cache_len)

    def _compiled(self, name, fn, *args, static=(), donate=(), options=None):
        """AOT-compile `fn(model, draft, *args)` once per (name, shapes, static) and run it; over a
        mesh, once per shardings too: the same state may come sharded two ways (its processors'
        fields made by `with_processors`, or by a program), and a program runs only the shardings
        it was compiled for. options: XLA options of this program, under the engine's `compiler_options`."""
        leaves, structure = jax.tree.flatten(args)
        key = (name, structure, tuple((a.shape, a.dtype) for a in leaves), static)
        if self.mesh is not None:
            key += (tuple(getattr(a, "sharding", None) for a in leaves),)
        if key not in self.executables:
            t0 = time.perf_counter()
            self.executables[key] = self._compile(name, fn, args, donate, options)
            log.info("compiled %s for %s in %.1f s", name, describe_shapes(args), time.perf_counter() - t0)
        program, params = self.executables[key]
        return program(params, *args)

    def _compile(self, name, fn, args, donate, options=None) -> tuple[jax.stages.Compiled, list]:
        """`fn(model, draft, *args)` compiled as a function of the parameter leaves and `args`
        (donate: the indices of args donated), named `jit_<name>` in a profile. Returns (program,
        the leaves it takes): each leaf costs host time at every call, so a program that reads few
        of them (a restore reads none, start_decode one or two) is traced again over those alone;
        a model pass, which reads most, takes them all rather than pay a second trace at compile
        time."""
        donate_argnums = tuple(i + 1 for i in donate)
        with self.tracing():
            run = jax.jit(self._on_params(fn, name=name), donate_argnums=donate_argnums)
            traced = run.trace(self.param_leaves, *args)
            used = read_inputs(traced.jaxpr, len(self.param_leaves))
            params = self.param_leaves
            if len(used) <= len(self.param_leaves) // 2:
                params = [self.param_leaves[i] for i in used]
                run = jax.jit(self._on_params(fn, used, name=name), donate_argnums=donate_argnums)
                traced = run.trace(params, *args)
            lowered = traced.lower()
        return lowered.compile(compiler_options={**(options or {}), **(self.compiler_options or {})} or None), params

    @contextlib.contextmanager
    def tracing(self):
        """The context programs are traced in: the tensor-parallel mesh, if any, and the
        batch-invariant mode, if on."""
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            with batch_invariant(self.invariant_rows):
                yield

    def _on_params(self, fn, used: Sequence[int] | None = None, name: str = "run"):
        """fn(model, draft, *a) as a function of the flat parameters: run(param_leaves, *a); with
        `used`, of those leaves only: run([param_leaves[i] for i in used], *a), the others traced
        as zeros (fn never reads them, so they compile away). name: the function's name, which
        jit gives the program."""
        graphdef, tree, everything = self.graphdef, self.param_tree, self.param_leaves

        def run(leaves, *a):
            if used is not None:
                given = dict(zip(used, leaves))
                leaves = [given[i] if i in given else jnp.zeros(x.shape, x.dtype) for i, x in enumerate(everything)]
            model, draft = nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))
            return fn(model, draft, *a)

        run.__name__ = run.__qualname__ = name
        return run

    def row_bytes(self, prompts, prompt_lengths, max_lengths, stop_ids, sampling, done, speculate,
                  reference) -> int:
        """Device bytes of the `DecodeState` a prefill of these one-row arguments returns (caches,
        proposer state, token buffer): what each further batch row costs. Traced, not compiled or run."""
        fn = partial(prefill, cache_len=self.cache_len, do_sample=False, plan=self.plan)
        with self.tracing():
            state = jax.eval_shape(self._on_params(fn), self.param_leaves, prompts, prompt_lengths, max_lengths,
                                   stop_ids, sampling, done, speculate, reference)
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)
                   if hasattr(leaf, "dtype") and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))

    def prefill(self, prompts, prompt_lengths, max_lengths, stop_ids, sampling, done, speculate, reference,
                do_sample: bool, num_logprobs: int | None = None) -> DecodeState:
        """`prefill` of a batch (its arguments); with a prefix cache, block by block per row."""
        static = (do_sample, num_logprobs)
        rest = (max_lengths, stop_ids, sampling, done, speculate, reference)
        if self.prefix_cache is None:
            fn = partial(prefill, cache_len=self.cache_len, do_sample=do_sample, plan=self.plan,
                         num_logprobs=num_logprobs)
            return self._compiled("prefill", fn, prompts, prompt_lengths, *rest, static=static)
        cache, last_blocks, hidden, taps, prompts = self._prefill_blocks(prompts, prompt_lengths, done)
        start = partial(start_decode, cache_len=self.cache_len, do_sample=do_sample, plan=self.plan,
                        num_logprobs=num_logprobs)

        def fn(model, draft, cache, last_blocks, hidden, taps, prompts, prompt_lengths, *a):
            # a row's last prompt position lies in the last block its prefill ran
            last = last_blocks[jnp.arange(prompts.shape[0]), (prompt_lengths - 1) % last_blocks.shape[1]]
            return start(model, draft, ForwardOut(hidden, cache, taps), last, prompts, prompt_lengths, *a)

        # The caches go in donated: the state takes them over instead of a copy.
        return self._compiled("start_decode", fn, cache, last_blocks, hidden, taps, prompts, prompt_lengths, *rest,
                              static=static, donate=(0,))

    def _prefill_blocks(self, prompts, prompt_lengths, done):
        """Prefix caching: each live row's prompt resumes from its deepest cached block and runs
        the blocks after it one pass each, keeping every full block it computes. Returns the
        batch's caches, the target's hidden [B, C, H] over each row's last block (zeros for a
        padding row), its hidden and taps [B, W, ...] over the whole prompt when a proposer reads
        them (else None; W the prompt bucket rounded up to whole blocks, zeros at cached positions
        whose blocks kept none), and the prompts [B, W] on the host.
        Arguments may be host or device arrays; the programs take host ones as they are."""
        store, C = self.prefix_cache, self.prefix_cache.block_size
        tokens, lengths, padding = np.asarray(prompts), np.asarray(prompt_lengths), np.asarray(done)
        width = -(-tokens.shape[1] // C) * C
        if width > tokens.shape[1]:
            tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
        fresh = partial(self._compiled, "empty_row", lambda model, draft: init_cache(model.cfg, 1, self.cache_len,
                                                                                      model.dtype))
        run_block = partial(prefill_block, cache_len=self.cache_len, plan=self.plan)
        caches, outputs = [], []  # per row: its caches, and the target's outputs [1, C, ...] block by block
        for b in range(tokens.shape[0]):
            cache = None
            outputs.append([])
            if not padding[b]:
                ids = tokens[b, :lengths[b]]
                keys = store.keys(ids)
                found = store.lookup(ids, keys)
                cache = self._restore(found) if found else fresh()
                outputs[-1] += [(blk.hidden, blk.taps) for blk in found]
                for i in range(len(found), -(-len(ids) // C)):
                    cache, block = self._compiled("prefill_block", run_block, cache, tokens[b:b + 1, i * C:(i + 1) * C],
                                                  np.asarray([i * C], np.int32),
                                                  np.asarray([min(C, len(ids) - i * C)], np.int32), donate=(0,),
                                                  options=KERNEL_BY_KERNEL)
                    outputs[-1].append((block.hidden, block.taps))
                    kept = block if self.plan else dataclasses.replace(block, hidden=None, taps=None)
                    if i < min(len(keys), store.room(kept)):  # a full block, within what the budget holds
                        store.put(keys[i], kept)
                store.touch(keys)
            caches.append(fresh() if cache is None else cache)
        last_blocks = [row[-1][0] if row else jnp.zeros((1, C, self.cfg.hidden_size), self.dtype) for row in outputs]
        last_blocks = last_blocks[0] if len(last_blocks) == 1 else jnp.concatenate(last_blocks)
        hidden, taps = self._assemble_outputs(outputs, width) if self.plan else (None, None)
        cache = caches[0] if len(caches) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *caches)
        return cache, last_blocks, hidden, taps, tokens

    def _restore(self, found: Sequence[Block]):
        """A fresh row's caches resumed from its cached blocks `found` (in prompt order, at least
        one): one restore call per power of two of them. Not waited for: the device copies while
        the host dispatches the block pass that reads them."""
        cache, restored, C = None, 0, self.prefix_cache.block_size
        for run in powers_of_two(len(found)):  # few programs, few calls: one per power of two
            parts = restored_parts(found[restored:restored + run], deepest=restored + run == len(found))
            cache = self._compiled("restore_blocks", partial(restore_blocks, cache_len=self.cache_len), cache,
                                   parts, np.asarray(restored * C, np.int32), donate=(0,))
            restored += run
        return cache

    def _assemble_outputs(self, outputs, width: int):
        """Rows' block outputs [(hidden [1, C, H] or None, taps or None), ...] -> hidden [B, W, H]
        and taps [B, W, n*H] (or None), zeros where a block kept none."""
        H, n_taps, C = self.cfg.hidden_size, len(plan_taps(self.plan)), self.prefix_cache.block_size

        def row(parts, j, size):
            have = [p[j] for p in parts] + [None] * (width // C - len(parts))
            pieces = []  # a run of blocks without outputs becomes one zeros array
            for missing, run in itertools.groupby(have, key=lambda x: x is None):
                run = list(run)
                pieces += [jnp.zeros((1, len(run) * C, size), self.dtype)] if missing else run
            return jnp.concatenate(pieces, axis=1)

        hidden = jnp.concatenate([row(parts, 0, H) for parts in outputs])
        taps = jnp.concatenate([row(parts, 1, n_taps * H) for parts in outputs]) if n_taps else None
        return hidden, taps

    def decode(self, state: DecodeState, max_steps: int, do_sample: bool) -> DecodeState:
        fn = partial(decode_loop, do_sample=do_sample, plan=self.plan)
        return self._compiled("decode", fn, state, jnp.asarray(max_steps, jnp.int32), static=(do_sample,), donate=(0,))

    def insert(self, state: DecodeState, row: int, new: DecodeState) -> DecodeState:
        """Continuous batching: put a one-row prefill `new` into slot `row` of the live `state`
        (donated). One executable per engine: `new`'s shapes do not depend on the prompt bucket."""
        fn = lambda model, draft, *a: insert_row(*a)
        return self._compiled("insert", fn, state, jnp.asarray(row, jnp.int32), new, donate=(0,))

    def prompt_logprobs(self, token_ids: np.ndarray, num: int) -> tuple[np.ndarray, ...]:
        """`prompt_logprobs` of a prompt token_ids [T] on the host: arrays for tokens 1..T-1."""
        T = len(token_ids)
        tokens = np.zeros((1, self.prompt_bucket(T)), np.int32)
        tokens[0, :T] = token_ids
        out = self._compiled("prompt_logprobs", partial(prompt_logprobs, num=num), jnp.asarray(tokens),
                             jnp.asarray([T], jnp.int32), static=(num,))
        return tuple(np.asarray(x[:T - 1]) for x in out)

    def with_processors(self, state: DecodeState, names: frozenset[str], num_logprobs: int | None) -> DecodeState:
        """`with_processors` for this model's vocabulary."""
        return with_processors(state, names, num_logprobs, self.cfg.vocab_size)

    def logits(self, token_ids: np.ndarray) -> np.ndarray:
        T = len(token_ids)
        Tb = self.prompt_bucket(T)
        tokens = np.zeros((1, Tb), np.int32)
        tokens[0, :T] = token_ids
        fn = partial(forward_logits, cache_len=Tb)
        out = self._compiled("logits", fn, jnp.asarray(tokens), jnp.asarray([T], jnp.int32))
        return np.asarray(out[0, :T])
