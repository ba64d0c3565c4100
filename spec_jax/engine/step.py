"""The step functions: pure jitted prefill / decode over explicit state pytrees, and the
on-device loop. Everything a step reads or writes is in `DecodeState`; `decode_loop` is a
`lax.while_loop` over `decode_step` or `spec_step`, so a whole generation runs on the device with
no host round trip per token. `spec_jax.engine.runner.Runner` compiles these once per shape bucket.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from models.layers import Batch
from pallas_kernels.gdn_chunked import CHUNK
from models.qwen3_5 import ForwardOut, Qwen3_5Model
from pallas_kernels.batch_invariant import invariant_rows
from spec_jax.engine.adaptive import choose_verify_lengths, initial_estimates, update_estimates
from spec_jax.engine.sampling import (EmittedLogprobs, RowSampling, TokenHistory, accept_drafts, accept_synthetic,
                                     apply_token_masks, draw, process_logits, ranked_logprobs, sample_tokens,
                                     warp_logits)
from spec_jax.engine.state import DecodeState, SpecPlan, SpecStats, append_tokens, plan_taps


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


def grammar_begin(grammars, sampling: RowSampling, done, tokens, lengths, drafts, n_draft, limit, recent: int):
    """The first half of a step's grammar work, on the host (`GrammarRows.begin`, a callback from
    the compiled step, before its target pass): tokens [B, L] each row's buffer holding lengths [B]
    tokens, the last `recent` of which the matchers may not have seen; drafts [B, k] and n_draft [B]
    the proposer's; limit [B] the most drafts a row may verify. Returns (ticket [] int32, drafts
    [B, k], n_draft [B], tokens): `grammar_finish(ticket)` gives the masks, and the tokens come
    back ordered after the callback, so that a pass reading them (a one-token pass, which reads no
    draft) runs after it, while the host fills the masks."""
    B, k = drafts.shape
    idx = jnp.maximum(lengths[:, None] - recent + jnp.arange(recent)[None, :], 0)
    window = jnp.take_along_axis(tokens, idx, axis=1)
    ids = jnp.where(done, -1, sampling.grammar)
    shapes = (jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((B, k), jnp.int32),
              jax.ShapeDtypeStruct((B,), jnp.int32))
    ticket, drafts, n_draft = io_callback(grammars.begin, shapes, ids, lengths, window, drafts, n_draft, limit)
    ticket, tokens = jax.lax.optimization_barrier((ticket, tokens))
    return ticket, drafts, n_draft, tokens


def grammar_finish(grammars, ticket, raw: jax.Array, positions: int):
    """The masks of `grammar_begin`'s ticket (`GrammarRows.finish`) for its positions = k + 1
    verify positions, called with the pass's raw logits [B, V] so that the host's wait comes after
    the pass (the masks were filled while the device ran it). Returns (masks [B, k+1, W] int32,
    failed [B] bool: rows whose grammar failed, which accept no draft)."""
    B = raw.shape[0]
    shapes = (jax.ShapeDtypeStruct((B, positions, grammars.words), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.bool_))
    return io_callback(grammars.finish, shapes, ticket, jnp.max(raw, axis=-1))


def constrained(sampling: RowSampling, grammars) -> bool:
    """Whether a step runs the grammar's host work: when the rows carry grammar ids (static)."""
    if sampling.grammar is not None and grammars is None:
        raise ValueError("rows carry grammar ids but the step was given no GrammarRows to run them")
    return sampling.grammar is not None


def no_drafts(lengths: jax.Array) -> jax.Array:
    """drafts [B, 0] for a pass that verifies none."""
    return jnp.zeros((lengths.shape[0], 0), jnp.int32)


def prefill(model: Qwen3_5Model, draft, prompts, prompt_lengths, max_lengths, stop_ids, sampling: RowSampling, done,
            speculate, *, cache_len: int, do_sample: bool, plan: SpecPlan | None,
            num_logprobs: int | None = None, grammars=None) -> DecodeState:
    """Run the prompts, sample each row's first token, and start the proposer.

    prompts: [B, T] int32, right-padded; prompt_lengths: [B] (>= 1); max_lengths: [B];
    stop_ids: [B, S]; done: [B] bool (True for padding rows of the batch bucket); speculate:
    [B] bool. grammars: the host's `GrammarRows` when rows carry grammar ids.
    Returns the `DecodeState` with the caches holding each prompt.
    """
    B, T = prompts.shape
    cache = model.init_cache(B, cache_len)
    batch = Batch(start=jnp.zeros((B,), jnp.int32), n_valid=prompt_lengths)
    # Batch-invariant: attention spans the whole cache in every pass, prefill included.
    target = model(prompts, batch, cache, kv_len=cache_len if invariant_rows() else T, taps=plan_taps(plan))
    last = target.hidden[jnp.arange(B), prompt_lengths - 1]
    return start_decode(model, draft, target, last, prompts, prompt_lengths, max_lengths, stop_ids, sampling, done,
                        speculate, cache_len=cache_len, do_sample=do_sample, plan=plan,
                        num_logprobs=num_logprobs, grammars=grammars)


def start_decode(model: Qwen3_5Model, draft, target: ForwardOut, last, prompts, prompt_lengths, max_lengths,
                 stop_ids, sampling: RowSampling, done, speculate, *, cache_len: int, do_sample: bool,
                 plan: SpecPlan | None, num_logprobs: int | None = None, grammars=None) -> DecodeState:
    """What prefill does after the target's pass over the prompts: sample each row's first token
    from last [B, H], the hidden state at its last prompt position, and start the proposer on
    the target's outputs. target: that pass's `ForwardOut` (the caches holding the prompts;
    hidden [B, T, H] and taps, read only by a proposer); the other arguments as `prefill`'s."""
    B, T = prompts.shape
    cache = target.cache
    history = None if sampling.penalties is None else TokenHistory.of_prompts(prompts, prompt_lengths,
                                                                              model.cfg.vocab_size)
    raw = model.logits(last)
    logits = process_logits(raw, sampling, prompt_lengths, history)
    if constrained(sampling, grammars):
        zero = prompt_lengths * 0
        ticket, *_ = grammar_begin(grammars, sampling, done, prompts, prompt_lengths, no_drafts(prompt_lengths),
                                   zero, zero, recent=0)
        logits = apply_token_masks(logits, grammar_finish(grammars, ticket, raw, 1)[0][:, 0])
    first = sample_tokens(logits, sampling, prompt_lengths, do_sample=do_sample)
    tokens = jnp.zeros((B, cache_len), jnp.int32).at[:, :T].set(prompts)
    logprobs = None if num_logprobs is None else EmittedLogprobs.empty(B, cache_len, num_logprobs)
    state = DecodeState(tokens, prompt_lengths, prompt_lengths, max_lengths, done, stop_ids, sampling, cache,
                        jnp.zeros((), jnp.int32), speculate, history=history, logprobs=logprobs)
    state = append_tokens(state, first[:, None], jnp.ones_like(first), cache, raw[:, None])
    if plan is None:
        return state
    choose = drafting_policy(sampling, probabilistic=plan.probabilistic, do_sample=do_sample)
    pstate = plan.proposer.init_state(model, draft, state.tokens, state.lengths, target, choose)
    estimates = initial_estimates(B, plan.k) if plan.adaptive else None
    return dataclasses.replace(state, proposer=pstate, stats=SpecStats.zeros(B, plan.k), acceptance_estimates=estimates)


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


def decode_one(model: Qwen3_5Model, state: DecodeState, taps: tuple[int, ...], *, do_sample: bool,
               masks_of=None) -> tuple[jax.Array, ForwardOut, jax.Array]:
    """Feed each live row's newest token; returns the next token [B], the pass's `ForwardOut` and
    its raw logits [B, V]. masks_of: if rows are constrained, raw logits [B, V] -> the grammar's
    token bitmasks [B, W] (`grammar_finish`, so the host's wait comes after the pass)."""
    B, L = state.tokens.shape
    newest = state.tokens[jnp.arange(B), state.lengths - 1][:, None]
    batch = Batch(start=state.lengths - 1, n_valid=(~state.done).astype(jnp.int32))
    out = model(newest, batch, state.cache, kv_len=L, taps=taps)
    raw = model.logits(out.hidden[:, 0])
    logits = process_logits(raw, state.sampling, state.lengths, state.history, recent=generated_before(state))
    if masks_of is not None:
        logits = apply_token_masks(logits, masks_of(raw))
    return sample_tokens(logits, state.sampling, state.lengths, do_sample=do_sample), out, raw


def decode_step(model: Qwen3_5Model, draft, state: DecodeState, *, do_sample: bool, grammars=None) -> DecodeState:
    """Plain decoding: feed each live row's newest token and sample the next one (within the
    row's grammar, when it has one)."""
    masks_of = None
    if constrained(state.sampling, grammars):
        zero = jnp.zeros_like(state.lengths)
        ticket, _, _, tokens = grammar_begin(grammars, state.sampling, state.done, state.tokens, state.lengths,
                                             no_drafts(state.lengths), zero, zero, recent=1)
        state = dataclasses.replace(state, tokens=tokens)
        masks_of = lambda raw: grammar_finish(grammars, ticket, raw, 1)[0][:, 0]  # noqa: E731
    nxt, out, raw = decode_one(model, state, (), do_sample=do_sample, masks_of=masks_of)
    state = append_tokens(state, nxt[:, None], jnp.ones_like(nxt), out.cache, raw[:, None])
    return dataclasses.replace(state, steps=state.steps + 1)


def verify_pass(model: Qwen3_5Model, cache, inputs, start, n_valid, *, kv_len: int, rollback: str | None,
                taps: tuple[int, ...] = ()) -> ForwardOut:
    """The speculative step's target pass: inputs [B, T] (each row's newest token, then its drafts)
    at positions start [B] onward, n_valid [B] of them real, over `cache` with kv_len slots. With a
    rollback ("checkpoint" or "replay") the attention K/V are written, the GDN caches left as they
    were and what rollback needs kept in `pending`, for `model.commit` to keep the accepted prefix;
    with None, a plain pass. bench.verify_cost times this function, so its figures are the step's."""
    return model(inputs, Batch(start=start, n_valid=n_valid), cache, kv_len=kv_len, rollback=rollback, taps=taps)


def spec_step(model: Qwen3_5Model, draft, state: DecodeState, step_times: jax.Array | None, *, plan: SpecPlan,
              do_sample: bool, grammars=None) -> DecodeState:
    """One speculative step: propose, verify [newest, d1..dw] in one target pass, accept, roll every
    cache back to the accepted prefix, append n_acc + 1 tokens per row.

    w is k, or with adaptive verification (`plan.adaptive`) the width `choose_verify_lengths`
    takes from the rows' acceptance estimates and step_times [W] (seconds of a step at each of
    plan.widths); each width is its own branch of the program (`run_one`). A row verifies at most its limit:
    0 when it does not speculate (or is done), else the room before its max length; its verify
    pass is then a plain decode step of one token, in the same batch.

    Constrained rows (`grammar_begin`): the grammar cuts the drafts at the first it forbids and
    proposes its forced tokens, and each verify position's logits are masked by the grammar's state
    after the drafts before it, so a forbidden token is never accepted nor emitted.
    """
    live = ~state.done
    room = jnp.maximum(state.max_lengths - state.lengths - 1, 0)
    limit = jnp.where(state.speculate & live, jnp.minimum(room, plan.k), 0)
    if plan.adaptive:
        index, limit = choose_verify_lengths(state.acceptance_estimates, step_times, plan.widths, live, limit)

        def at(width, out):  # the step at this width, on the caches and proposer state carried in `out`
            now = dataclasses.replace(state, cache=out[3], proposer=out[4])
            return step_at_width(model, draft, now, limit, plan=plan, width=width, do_sample=do_sample,
                                 grammars=grammars)

        B, k = live.shape[0], plan.k
        raw = None if state.logprobs is None else jnp.zeros((B, k + 1, model.cfg.vocab_size), jnp.float32)
        nothing = (jnp.zeros_like(limit), jnp.zeros_like(limit), jnp.zeros((B, k + 1), jnp.int32), state.cache,
                   state.proposer, raw)
        n_draft, n_acc, emitted, cache, pstate, raw = run_one(index, [partial(at, w) for w in plan.widths], nothing)
    else:
        n_draft, n_acc, emitted, cache, pstate, raw = step_at_width(model, draft, state, limit, plan=plan,
                                                                    width=plan.k, do_sample=do_sample,
                                                                    grammars=grammars)

    s, k = state.stats, plan.k
    accepted_at = (jnp.arange(k)[None, :] < n_acc[:, None]) & live[:, None]
    chosen = jax.nn.one_hot(n_draft, k + 1, dtype=jnp.int32) * live[:, None]
    stats = SpecStats(s.drafted + n_draft, s.accepted + jnp.where(live, n_acc, 0), s.num_drafts + (n_draft > 0),
                      s.per_position + accepted_at, s.verify_lengths + chosen)
    estimates = state.acceptance_estimates
    if plan.adaptive:
        estimates = jnp.where(live[:, None], update_estimates(estimates, n_draft, n_acc), estimates)
    after = append_tokens(state, emitted, n_acc + 1, cache, raw)
    if hasattr(plan.proposer, "retire"):  # the rows that finished in this step
        pstate = plan.proposer.retire(pstate, after.tokens, state.prompt_lengths, after.lengths,
                                      after.done & ~state.done)
    return dataclasses.replace(after, proposer=pstate, stats=stats, steps=state.steps + 1,
                               acceptance_estimates=estimates)


def run_one(index, branches, carry):
    """branches[index](carry), each branch a loop of at most one trip: a loop updates the caches
    in its carry in place, where XLA's conditional copies every cache a branch writes (the
    step's whole state, each step). index: [] int32; every branch maps carry to its structure."""
    for i, branch in enumerate(branches):
        _, carry = jax.lax.while_loop(lambda c, i=i: c[0] == i, lambda c, b=branch: (-1, b(c[1])), (index, carry))
        index = jnp.where(index == i, -1, index)
    return carry


def step_at_width(model: Qwen3_5Model, draft, state: DecodeState, limit, *, plan: SpecPlan, width: int,
                  do_sample: bool, grammars=None):
    """Propose, verify up to `width` drafts a row (at most limit [B] of them), accept and update
    the proposer. Returns n_draft [B] drafts verified, n_acc [B], emitted [B, k+1] (the first
    n_acc + 1 are the row's new tokens), the caches, the proposer's state and the raw logits
    [B, k+1, V] (None unless logprobs are kept).

    Width 0 is a plain decode step that drafts nothing (unless the proposer's state needs every
    step's `propose`: `must_propose`). A proposer with `with_drafts` drafts only `width`
    tokens; the others draft k and the first `width` are verified. For proposers that can come up
    empty (`may_not_draft`: ngram), a step where no row has a draft runs the one-token pass instead
    of the verify; other methods always draft, and compile only the verify.
    """
    B, L = state.tokens.shape
    k, rows, live = plan.k, jnp.arange(B), ~state.done
    choose = drafting_policy(state.sampling, probabilistic=plan.probabilistic, do_sample=do_sample)
    proposer = plan.proposer
    if 0 < width < k and hasattr(proposer, "with_drafts"):
        proposer = proposer.with_drafts(width)
    if width == 0 and not getattr(proposer, "must_propose", False):
        drafts, n_draft, q, pstate = jnp.zeros((B, 0), jnp.int32), jnp.zeros_like(limit), None, state.proposer
    else:
        drafts, n_draft, q, pstate = proposer.propose(model, draft, state.proposer, state.tokens, state.lengths,
                                                      choose)
        drafts, q = drafts[:, :width], None if q is None else q[:, :width]
    n_draft = jnp.minimum(n_draft, limit)
    newest = state.tokens[rows, state.lengths - 1]
    ticket = None
    if constrained(state.sampling, grammars):  # the last step may have written up to k + 1 tokens
        ticket, forced, n_forced, tokens = grammar_begin(grammars, state.sampling, state.done, state.tokens,
                                                         state.lengths, drafts, n_draft, jnp.minimum(limit, width),
                                                         recent=k + 1)
        state = dataclasses.replace(state, tokens=tokens)
        if q is not None:  # a token the grammar put in place is drafted with certainty
            replaced = (forced != drafts) | (jnp.arange(width)[None, :] >= n_draft[:, None])
            q = jnp.where(replaced[..., None], jax.nn.one_hot(forced, q.shape[-1], dtype=q.dtype), q)
        drafts, n_draft = forced, n_forced

    def verify(_):
        inputs = jnp.concatenate([newest[:, None], drafts], axis=1)  # [B, width+1]
        target = verify_pass(model, state.cache, inputs, state.lengths - 1, jnp.where(live, n_draft + 1, 0), kv_len=L,
                             rollback=plan.rollback, taps=plan_taps(plan))
        positions = state.lengths[:, None] + jnp.arange(width + 1)[None, :]
        counts = None if state.history is None else state.history.through(drafts)
        raw = model.logits(target.hidden)
        logits = process_logits(raw, state.sampling, positions, state.history, counts,
                                generated_before(state, drafts))
        n_verified = n_draft
        if ticket is not None:
            masks, failed = grammar_finish(grammars, ticket, raw[:, 0], width + 1)
            logits, n_verified = apply_token_masks(logits, masks), jnp.where(failed, 0, n_draft)
        if plan.acceptance == "synthetic":
            n_acc, emitted = accept_synthetic(state.acceptance_rates[:, :width], logits, drafts, n_verified,
                                              state.sampling, state.lengths, do_sample=do_sample)
        else:
            n_acc, emitted = accept_drafts(logits, drafts, n_verified, q, state.sampling, state.lengths,
                                           do_sample=do_sample)
        cache = model.commit(target.cache, target.pending, jnp.where(live, n_acc + 1, 0))
        return n_acc, emitted, cache, dataclasses.replace(target, cache=None, pending=None), kept(raw)

    def decode_only(_):
        # `decode_one`, its outputs padded to the width+1 positions proposers read (past
        # n_acc + 1 = 1 they are never read).
        masks_of = None if ticket is None else lambda raw: grammar_finish(grammars, ticket, raw, width + 1)[0][:, 0]
        nxt, target, raw = decode_one(model, state, plan_taps(plan), do_sample=do_sample, masks_of=masks_of)
        pad = lambda x: None if x is None else jnp.pad(x, ((0, 0), (0, width), (0, 0)))  # noqa: E731
        emitted = jnp.concatenate([nxt[:, None], drafts], axis=1)
        return (jnp.zeros_like(n_draft), emitted, target.cache, ForwardOut(pad(target.hidden), None, pad(target.taps)),
                kept(pad(raw[:, None])))

    def kept(raw):  # the raw logits leave the branch only when logprobs are kept
        return None if state.logprobs is None else raw

    if width == 0:
        n_acc, emitted, cache, target, raw = decode_only(None)
    elif getattr(proposer, "may_not_draft", False):
        n_acc, emitted, cache, target, raw = jax.lax.cond(jnp.any(n_draft > 0), verify, decode_only, None)
    else:
        n_acc, emitted, cache, target, raw = verify(None)
    pstate = proposer.update(model, draft, pstate, target, emitted, n_acc, state.lengths, choose)
    emitted = jnp.pad(emitted, ((0, 0), (0, k - width)))
    raw = None if raw is None else jnp.pad(raw, ((0, 0), (0, k - width), (0, 0)))
    return n_draft, n_acc, emitted, cache, pstate, raw


def decode_loop(model: Qwen3_5Model, draft, state: DecodeState, max_steps, step_times=None, *, do_sample: bool,
                plan: SpecPlan | None = None, grammars=None) -> DecodeState:
    """Steps in a `lax.while_loop` until every row is done or `max_steps` more steps ran: the
    plain `decode_step`, or `spec_step` when a plan is given (step_times [W]: its cost model,
    read when the plan is adaptive). max_steps and step_times are traced, so streaming in chunks
    and every measured cost reuse one executable. grammars: the host's `GrammarRows`, when rows
    carry grammar ids (each step then calls it once)."""
    stop_at = state.steps + max_steps
    if plan is None:
        step = partial(decode_step, do_sample=do_sample, grammars=grammars)
    else:
        step = partial(spec_step, step_times=step_times, plan=plan, do_sample=do_sample, grammars=grammars)

    def cond(s):
        return jnp.any(~s.done) & (s.steps < stop_at)

    return jax.lax.while_loop(cond, partial(step, model, draft), state)


def forward_logits(model: Qwen3_5Model, draft, tokens, length, *, cache_len: int):
    """Full-sequence logits of one right-padded sequence: tokens [1, T], length [1] -> [1, T, V]."""
    cache = model.init_cache(1, cache_len)
    batch = Batch(start=jnp.zeros((1,), jnp.int32), n_valid=length)
    return model.logits(model(tokens, batch, cache, kv_len=tokens.shape[1]).hidden)


def prompt_logprobs(model: Qwen3_5Model, draft, tokens, length, *, num: int):
    """vLLM's prompt logprobs of one right-padded prompt: tokens [1, T], length [1] -> (token [T-1],
    rank [T-1], top_ids [T-1, num], top [T-1, num]) for prompt tokens 1..T-1, from the raw logits
    at the position before each (`ranked_logprobs`). Logits are made CHUNK positions at a time,
    so a long prompt never holds [T, V] at once."""
    T = tokens.shape[1]
    cache = model.init_cache(1, T)
    hidden = model(tokens, Batch(start=jnp.zeros((1,), jnp.int32), n_valid=length), cache, kv_len=T).hidden[0]
    following = jnp.concatenate([tokens[0, 1:], tokens[0, :1]])  # the token each position predicts; the last unused

    def chunk(args):
        h, nxt = args
        return ranked_logprobs(model.logits(h), nxt, num)

    blocks = (hidden.reshape(T // CHUNK, CHUNK, -1), following.reshape(T // CHUNK, CHUNK))
    return jax.tree.map(lambda x: x.reshape((T,) + x.shape[2:])[:-1], jax.lax.map(chunk, blocks))


