"""Continuous batching: requests share one jitted step through fixed batch slots.

The live `DecodeState` has `max_num_seqs` rows, the slots. A request waits in a queue until a
slot is free; then it is prefilled alone (a batch-1 prefill, one executable per prompt bucket)
and written into its slot by `EngineCore.insert`. The device loop runs the same `decode_loop`
executable as `LLM.generate` (both drive one `EngineCore`), `steps_per_chunk` steps per call, and
hands each request its new tokens after every call. A finished or cancelled request frees its slot for the next waiting
one. Speculation works per slot as in `LLM.generate`: its counters restart with each insert.

The live batch has two layouts: plain, and full (every logit processor and MAX_LOGPROBS logprobs
per token), worn while any of its requests uses a processor or asks for logprobs. `warm_up`
compiles both, so no request waits for the live batch's programs to compile.

One background thread owns the device. Callers talk to it through a thread-safe inbox
(`submit`, `cancel`) and hear back through a per-request `sink(Update)` called on that thread.

    sched = Scheduler(llm.engine).start()
    for update in sched.stream([1, 2, 3], SamplingParams(max_tokens=8, temperature=0)):
        print(update.token_ids, update.finish_reason)
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
from functools import partial
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spec_jax.engine.batch import processors_needed
from spec_jax.engine.core import EngineCore
from spec_jax.engine.metrics import request_metrics
from spec_jax.engine.params import MAX_LOGPROBS, Logprob, SamplingParams, logprob_entries
from spec_jax.engine.sampling import RowSampling

MAX_STOP_TOKEN_IDS = 16  # per request besides EOS: the live batch's stop_ids width is fixed
# The full layout's logit processors: all of `RowSampling`'s optional fields but the grammar ids, which the
# batch carries only while a constrained request runs (each step of such a batch calls the host).
EVERY_PROCESSOR = frozenset(f.name for f in dataclasses.fields(RowSampling) if f.default is None) - {"grammar"}
log = logging.getLogger(__name__)


@dataclasses.dataclass
class Update:
    """What a request hears: its new token ids (with their logprobs, as `LLM.generate` gives them,
    when the request asked for logprobs); at the end, why it finished ("stop", "length", "abort"
    when cancelled, "error"), its metrics (`metrics.request_metrics` plus queue_s) and any error text."""

    token_ids: list[int]
    finish_reason: str | None = None
    metrics: dict | None = None
    error: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None


class Request:
    """One submitted prompt and its place in the scheduler. `sink` runs on the scheduler thread."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 sink: Callable[[Update], None], processors: frozenset[str] = frozenset()):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sink = sink
        self.slot: int | None = None
        self.sent = len(prompt_token_ids)  # buffer index of the first token not yet handed out
        self.num_generated = 0
        self.last_token = -1
        self.stops: set[int] = set()
        self.processors = processors  # the logit processors it needs (`batching.processors_needed`)
        self.grammar = -1  # its id among the core's grammar matchers once admitted (-1: none)
        self.finished = False
        self.t_submit = time.perf_counter()
        self.t_admit = self.t_prefilled = self.t_submit


@partial(jax.jit, static_argnums=2)
def recent(buffers, start: jax.Array, width: int):
    """buffers: a pytree of [B, L, ...] arrays (tokens, `EmittedLogprobs`), start [B] -> the same
    tree of [B, width, ...]: each row's entries from `start` on (clamped at L - 1)."""

    def window(x):
        idx = jnp.minimum(start[:, None] + jnp.arange(width)[None, :], x.shape[1] - 1)
        return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)

    return jax.tree.map(window, buffers)


class Scheduler:
    """Continuous batching over the core's max_num_seqs slots, with `steps_per_chunk` decode
    steps per device call, 1 to max_model_len (more: less dispatch overhead, coarser streaming).
    The live batch wears the plain or the full layout (`_fit_layout`)."""

    def __init__(self, core: EngineCore, *, steps_per_chunk: int = 4):
        if isinstance(steps_per_chunk, bool) or not isinstance(steps_per_chunk, int) \
                or not 1 <= steps_per_chunk <= core.max_model_len:
            raise ValueError(f"steps_per_chunk={steps_per_chunk!r} must be 1 to {core.max_model_len} (max_model_len: "
                             f"no row runs more steps)")
        self.core = core
        plan = core.plan
        self.k = plan.k if plan is not None else 0
        # Probabilistic drafting keeps draft probabilities in the proposer state only when
        # sampling is compiled in, so then every call samples (greedy rows still take argmax).
        self.always_sample = plan is not None and plan.probabilistic
        self.steps_per_chunk = steps_per_chunk
        self.window = steps_per_chunk * (self.k + 1) + 1  # most tokens a row can gain per call
        self.stop_width = MAX_STOP_TOKEN_IDS + len(core.cfg.eos_token_id)
        self.slots: list[Request | None] = [None] * core.max_num_seqs
        self.full = False  # the live batch's layout: full, or plain
        self.constrained = False  # whether the live batch carries grammar ids
        self.waiting: collections.deque[Request] = collections.deque()
        self.inbox: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.counters: collections.Counter = collections.Counter()
        self.accepted_per_position = [0] * self.k
        self.queued = 0  # submitted, not yet admitted or cancelled
        self.last_stats = None
        self.state = None
        self.ids = itertools.count()
        self.thread = threading.Thread(target=self._loop, name="spec-jax-scheduler", daemon=True)

    # ------------------------------------------------------------------ caller side (any thread)

    def start(self) -> "Scheduler":
        self.thread.start()
        return self

    def shutdown(self) -> None:
        """Abort every request and stop the device thread."""
        self.inbox.put(("stop", None))
        self.thread.join()

    def warm_up(self) -> None:
        """Compile what the live batch runs, before serving: both layouts, greedy and sampled, for
        the shortest prompt bucket. A program that fails raises RuntimeError with its error."""
        for logprobs in (None, 0):  # a request asking for logprobs puts the batch in the full layout
            for temperature in (0.0, 1.0):
                params = SamplingParams(max_tokens=2, temperature=temperature, ignore_eos=True, logprobs=logprobs)
                for update in self.stream([0], params):
                    if update.error is not None:
                        raise RuntimeError(f"warm-up failed: {update.error}")
        self.reset_counters()

    def request(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                sink: Callable[[Update], None]) -> Request:
        """A checked request, not yet queued (`enqueue` queues it); `sink` will get its updates.
        Bad prompts, stop lists or token ids raise ValueError."""
        ids = self.core.prompt_ids(prompt_token_ids, "prompt").tolist()
        bad_words = self.core.check_params(params)
        if len(params.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"{len(params.stop_token_ids)} stop_token_ids given; at most {MAX_STOP_TOKEN_IDS} "
                             f"are supported")
        return Request(next(self.ids), ids, params, sink, processors_needed(params, bad_words))

    def enqueue(self, requests: Sequence[Request]) -> None:
        """Queue checked requests (`request`), in order."""
        with self.lock:
            self.queued += len(requests)
        self.inbox.put(("add", list(requests)))

    def submit(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               sink: Callable[[Update], None]) -> Request:
        """Queue a prompt; `sink` gets its updates. Bad prompts, stop lists or token ids raise
        ValueError here."""
        req = self.request(prompt_token_ids, params, sink)
        self.enqueue([req])
        return req

    def cancel(self, req: Request, reason: str = "abort") -> None:
        """Stop a request (a no-op once it finished); it hears a final update with `reason`: "abort",
        or "stop" when its listener found a stop string (counted as such in the metrics)."""
        self.inbox.put(("cancel", (req, reason)))

    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> Iterator[Update]:
        """Submit and yield the request's updates until it finishes; leaving early cancels it."""
        updates: queue.Queue = queue.Queue()
        req = self.submit(prompt_token_ids, params, updates.put)
        try:
            while True:
                update = updates.get()
                yield update
                if update.finish_reason is not None:
                    return
        finally:
            self.cancel(req)

    def stats(self) -> dict:
        """A snapshot of the counters: requests by finish reason, prompt / generation tokens,
        speculation counters of finished requests, running and waiting requests."""
        with self.lock:
            out = dict(self.counters)
            out["accepted_per_position"] = list(self.accepted_per_position)
            out["running"] = sum(r is not None for r in self.slots)
            out["waiting"] = self.queued
        store = self.core.prefix_cache
        if store is not None:
            out["prefix_cache_queries"], out["prefix_cache_hits"] = store.queries, store.hits
        return out

    def reset_counters(self) -> None:
        """Zero the totals (e.g. after a warm-up request); running and waiting are live."""
        with self.lock:
            self.counters.clear()
            self.accepted_per_position = [0] * self.k

    # ------------------------------------------------------------------ device thread

    def _loop(self) -> None:
        self.state = self._empty_state()
        while self._read_inbox(block=not any(self.slots) and not self.waiting):
            try:
                self._admit()
                if any(self.slots):
                    self._run_chunk()
            except Exception as e:  # a device failure ends the running requests, not the server
                log.exception("scheduler step failed")
                for req in list(self.slots):
                    if req is not None:
                        self._finish(req, "error", error=f"{type(e).__name__}: {e}")
                self.state = self._empty_state()
        for req in list(self.slots) + list(self.waiting):
            if req is not None:
                self._finish(req, "abort")

    def _empty_state(self):
        """A live batch whose rows are all done: a prefill of one-token dummies that stop at once."""
        self.full = self.constrained = False
        dummy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        B = len(self.slots)
        state, _, _ = self.core.start([[0]] * B, [dummy] * B, stop_width=self.stop_width,
                                      do_sample=self.always_sample or None)
        return state

    def _read_inbox(self, block: bool) -> bool:
        """Take new and cancelled requests; False once asked to stop."""
        messages = [self.inbox.get()] if block else []
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for kind, payload in messages:
            if kind == "stop":
                return False
            if kind == "add":
                self.waiting.extend(payload)
            elif not payload[0].finished:  # ("cancel", (request, reason))
                self._cancel(*payload)
        return True

    def _cancel(self, req: Request, reason: str) -> None:
        if req.slot is None:
            self.waiting.remove(req)
        else:
            self.state = dataclasses.replace(self.state, done=self.state.done.at[req.slot].set(True))
        self._finish(req, reason)

    def _admit(self) -> None:
        """Prefill waiting requests into free slots."""
        for slot, occupant in enumerate(self.slots):
            if not self.waiting:
                return
            if occupant is not None:
                continue
            req = self.waiting.popleft()
            req.t_admit = time.perf_counter()
            try:
                self._fit_layout(joining=req)
                processors, num_logprobs = self._layout()
                row, _, stops = self.core.start([req.prompt_token_ids], [req.params], stop_width=self.stop_width,
                                                do_sample=self.always_sample or None, processors=processors,
                                                num_logprobs=num_logprobs, rows=1)
            except Exception as e:  # e.g. a prompt bucket that fails to compile: this request only
                log.exception("prefill failed")
                self._finish(req, "error", error=f"{type(e).__name__}: {e}")
                continue
            req.grammar = (self.core.grammar_ids(row) or [-1])[0]
            try:
                self.state = self.core.insert(self.state, slot, row)
            except Exception as e:  # the donated live batch may be gone too: `_loop` ends the running requests
                self._finish(req, "error", error=f"{type(e).__name__}: {e}")
                raise
            req.slot, req.stops, req.t_prefilled = slot, set(stops[0]), time.perf_counter()
            with self.lock:
                self.slots[slot] = req
                self.queued -= 1
                self.counters["prompt_tokens"] += len(req.prompt_token_ids)

    def _layout(self) -> tuple[frozenset[str], int | None]:
        """The live batch's logit processors and logprobs kept per token (None: none)."""
        grammar = frozenset({"grammar"}) if self.constrained else frozenset()
        return (EVERY_PROCESSOR | grammar, MAX_LOGPROBS) if self.full else (grammar, None)

    def _fit_layout(self, joining: Request | None = None) -> None:
        """Put the live batch in the full layout while one of its requests (or `joining`, about to
        be inserted) uses a logit processor or asks for logprobs, else in the plain one; with grammar
        ids while one of them is constrained. Rows that use less than the layout carries hold neutral
        values: their tokens are the same."""
        requests = [r for r in self.slots if r is not None] + ([joining] if joining is not None else [])
        full = any(r.processors - {"grammar"} or r.params.logprobs is not None for r in requests)
        constrained = any("grammar" in r.processors for r in requests)
        if (full, constrained) != (self.full, self.constrained):
            self.full, self.constrained = full, constrained
            self.state = self.core.with_processors(self.state, *self._layout())

    def _run_chunk(self) -> None:
        """Run steps_per_chunk steps over the live batch, then hand out new tokens and finish
        the rows that are done."""
        self._fit_layout()
        do_sample = self.always_sample or any(r is not None and r.params.temperature > 0 for r in self.slots)
        self.state = self.core.decode(self.state, self.steps_per_chunk, do_sample)
        sent = np.asarray([r.sent if r is not None else 0 for r in self.slots], np.int32)
        window, kept = recent((self.state.tokens, self.state.logprobs), jnp.asarray(sent), self.window)
        lengths, done, window, kept, self.last_stats = jax.device_get(
            (self.state.lengths, self.state.done, window, kept, self.state.stats))
        for slot, req in enumerate(self.slots):
            if req is None:
                continue
            n_new = int(lengths[slot]) - req.sent
            if n_new > self.window:
                raise RuntimeError(f"slot {slot} gained {n_new} tokens in one call; at most {self.window} expected")
            new = window[slot, :n_new].tolist()
            logprobs = None
            if req.params.logprobs is not None:
                logprobs = logprob_entries(new, kept.token[slot], kept.rank[slot], kept.top_ids[slot], kept.top[slot],
                                           req.params.logprobs)
            req.sent += n_new
            req.num_generated += n_new
            req.last_token = new[-1] if new else req.last_token
            with self.lock:
                self.counters["generation_tokens"] += n_new
            failure = self.core.grammar_failure(req.grammar)
            if failure is not None:  # its grammar gave up (a resource limit): the row stops here
                self.state = dataclasses.replace(self.state, done=self.state.done.at[slot].set(True))
                self._finish(req, "error", new, error=f"structured outputs: {failure}")
            elif done[slot]:
                self._finish(req, "stop" if req.last_token in req.stops else "length", new, logprobs=logprobs)
            elif new:
                self._emit(req, Update(new, logprobs=logprobs))

    def _finish(self, req: Request, reason: str, new: list[int] | None = None, error: str | None = None,
                logprobs: list | None = None) -> None:
        """Free the request's slot, count it, and send its last update."""
        req.finished = True
        self.core.release([req.grammar])
        # The last chunk's counters are this request's once it has seen a chunk since its insert.
        stats = self.last_stats if req.slot is not None and req.num_generated > 0 else None
        metrics = request_metrics(len(req.prompt_token_ids), req.num_generated, req.t_prefilled - req.t_admit,
                                  time.perf_counter() - req.t_prefilled, stats, req.slot)
        metrics["queue_s"] = req.t_admit - req.t_submit
        with self.lock:
            self.counters[f"requests_{reason}"] += 1
            if req.slot is not None:
                self.slots[req.slot] = None
            elif reason in ("abort", "error"):
                self.queued -= 1
            if stats is not None:
                self.counters["num_drafts"] += int(stats.num_drafts[req.slot])
                self.counters["num_draft_tokens"] += int(stats.drafted[req.slot])
                self.counters["num_accepted_tokens"] += int(stats.accepted[req.slot])
                self.accepted_per_position = [a + int(b) for a, b in zip(self.accepted_per_position,
                                                                          stats.per_position[req.slot])]
        self._emit(req, Update(new or [], reason, metrics, error, logprobs))

    def _emit(self, req: Request, update: Update) -> None:
        try:
            req.sink(update)
        except Exception:  # the listener is gone (e.g. its event loop closed): stop generating for it
            log.exception("request %d: its listener failed; cancelling it", req.request_id)
            if not req.finished:
                self.cancel(req)
