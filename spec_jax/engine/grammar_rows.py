"""The host side of structured output: one llguidance matcher per constrained row, kept in step
with the tokens the device writes, and the token masks the step verifies against.

The step (`spec_jax.engine.step`) calls it twice per step from inside the compiled program (host
callbacks): `begin` after the proposer drafted, before the target's pass, and `finish` after the
target's logits, before they are read. Between the two the masks are filled on a worker thread, so
the costliest host work runs while the device runs the target's pass:

- each row's matcher first consumes the tokens the previous step wrote (only accepted tokens are
  ever consumed, so nothing needs undoing after a rejection);
- the drafts are walked through a copy of the grammar state: a draft the grammar forbids ends the
  row's drafts there (it could only be rejected), and where the grammar forces tokens (llguidance's
  fast-forward tokens: the canonical tokens of the bytes every continuation starts with) they are
  proposed as drafts, in place of a forbidden draft or past the proposer's last one;
- the mask of each verify position is the grammar's after the drafts before it, computed for all
  rows in parallel by llguidance (on the worker), which rolls its matchers back to the accepted
  state itself.

With a reasoning parser (`EngineConfig.reasoning_parser`) a row's grammar holds the answer after the
reasoning its prompt leaves open (`reasoning_grammar`). Rows of the batch without a grammar get masks
of all ones. Compiled grammars are cached per grammar text, so a schema is compiled once however
many requests use it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import threading
import time

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

from spec_jax.engine.reasoning_grammar import after_reasoning, reasoning_start
from spec_jax.engine.structured import StructuredOutputsParams, grammar_text

CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used go first)


def mask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over vocab_size tokens (bit t % 32 of word t // 32)."""
    return (vocab_size + 31) // 32


def special_texts(tokenizer_json: str, tokenizer: llguidance.LLTokenizer) -> frozenset[str]:
    """The added tokens llguidance holds as special (the tokenizer's special ones, and those shaped
    `<...>` like Qwen's `<think>`): their bytes are no text, so a grammar names them as tokens."""
    added = json.loads(tokenizer_json).get("added_tokens") or []
    return frozenset(t["content"] for t in added
                     if t["id"] < tokenizer.vocab_size and tokenizer.is_special_token(t["id"]))


def eos_only(words: int, eos: int) -> np.ndarray:
    """The bitmask [W] int32 that allows EOS alone."""
    mask = np.zeros(words, np.uint32)
    mask[eos // 32] = np.uint32(1) << np.uint32(eos % 32)
    return mask.view(np.int32)


@dataclasses.dataclass
class Row:
    """One constrained row: its matcher, where its generated tokens start in the row's buffer
    (None until the first step sees the row) and how many of them the matcher has consumed."""

    matcher: llguidance.LLMatcher
    start: int | None = None
    consumed: int = 0
    failure: str | None = None  # llguidance's error, once its matcher failed (a resource limit)


class GrammarRows:
    """The matchers of an engine's constrained rows (see the module's docstring). Hashable by
    identity: the compiled programs that call it are keyed by it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int, *, forced_drafts: bool = True,
                 reasoning_parser: str | None = None, threads: int | None = None):
        """tokenizer_json: the checkpoint's tokenizer.json text; vocab_size: the model's (masks
        cover it; ids past the tokenizer's are never allowed); eos: the token a finished grammar allows;
        forced_drafts: draft what the grammar forces (`EngineConfig.grammar_drafts`); reasoning_parser:
        `EngineConfig.reasoning_parser` (a grammar then holds the answer after the reasoning);
        threads: llguidance's (None: its default)."""
        if not 0 <= eos < vocab_size:
            raise ValueError(f"structured outputs: the EOS id {eos} is outside the vocabulary [0, {vocab_size})")
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(threads)
        self.words = mask_words(vocab_size)
        self.special = special_texts(tokenizer_json, self.tokenizer)
        self.compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self.compiles = 0  # grammars compiled so far (a cache miss each)
        self.forced_drafts, self.reasoning_parser = forced_drafts, reasoning_parser
        self.rows: dict[int, Row] = {}
        # steps served; seconds in `begin` and waiting in `finish` (the device waits on both); seconds of
        # mask filling (beside the device's pass); tokens the grammar drafted
        self.calls, self.begin_s, self.wait_s, self.fill_s, self.forced = 0, 0.0, 0.0, 0.0, 0
        self.next_id = self.next_ticket = 0
        self.pending: dict[int, concurrent.futures.Future] = {}  # `begin`'s fills not yet finished
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self.lock = threading.Lock()

    def matcher(self, params: StructuredOutputsParams, start: str = "closed") -> llguidance.LLMatcher:
        """A fresh matcher of the request's grammar, from the compiled one cached under its text;
        ValueError with llguidance's message for a grammar it cannot compile. start: where the
        output starts relative to the reasoning (`reasoning_grammar.reasoning_start`; "closed":
        the grammar holds from the first token)."""
        text = after_reasoning(grammar_text(params), start, self.special)
        with self.lock:
            pristine = self.compiled.get(text)
            if pristine is not None:
                self.compiled.move_to_end(text)
                return pristine.deep_copy()
        pristine = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        pristine.compute_bitmask()  # a grammar that admits no first token fails here, not mid-batch
        if pristine.is_error():
            raise ValueError(f"structured outputs: the {params.kind} constraint does not compile: "
                             f"{pristine.get_error().split(chr(10))[0]}")
        with self.lock:
            self.compiles += 1
            self.compiled[text] = pristine
            while len(self.compiled) > CACHED_GRAMMARS:
                self.compiled.popitem(last=False)
        return pristine.deep_copy()

    def add(self, params: StructuredOutputsParams, prompt_ids=()) -> int:
        """Start a constrained row after the prompt `prompt_ids` (with a reasoning parser, where the
        reasoning it leaves open ends is where the grammar starts); returns its id (what the row's
        `RowSampling.grammar` holds)."""
        row = Row(self.matcher(params, self.start_after(prompt_ids)))
        with self.lock:
            self.next_id += 1
            self.rows[self.next_id - 1] = row
            return self.next_id - 1

    def start_after(self, prompt_ids) -> str:
        """Where the output after `prompt_ids` starts relative to its reasoning
        (`reasoning_grammar.reasoning_start`); "closed" without a reasoning parser."""
        if self.reasoning_parser is None:
            return "closed"
        return reasoning_start(self.tokenizer.decode_str(list(prompt_ids)))

    def failure(self, row_id: int) -> str | None:
        """Why a row's grammar failed (llguidance's message), or None."""
        with self.lock:
            row = self.rows.get(int(row_id))
        return None if row is None else row.failure

    def release(self, ids) -> None:
        """Forget finished rows (ids < 0 and unknown ids are skipped)."""
        with self.lock:
            for i in ids:
                self.rows.pop(int(i), None)

    def begin(self, ids, lengths, recent, drafts, n_draft, limit):
        """The first half of a step's grammar work, called from the compiled step before its target
        pass: catch the matchers up and walk the drafts. The masks are filled on a worker thread
        meanwhile, so the costly part overlaps the device's pass; `finish(ticket)` returns them.

        ids [B] int32 (-1: no grammar, or a finished row); lengths [B] tokens in each row's buffer;
        recent [B, R] its last R tokens (those written since the previous call among them);
        drafts [B, k] and n_draft [B] the proposer's; limit [B] the most drafts a row may verify.
        Returns ticket [] int32 and the drafts [B, k], n_draft [B] to verify (cut at a forbidden
        draft, forced tokens proposed).
        """
        t0 = time.perf_counter()
        B, k = drafts.shape
        drafts, n_draft = np.array(drafts, np.int32), np.array(n_draft, np.int32)
        walks, heads = [], []  # rows with drafts to walk; rows with none (llguidance takes them apart)
        with self.lock:
            rows = [(b, self.rows.get(int(i))) for b, i in enumerate(ids) if i >= 0]
        for b, row in rows:
            if row is None:
                raise RuntimeError(f"batch row {b} holds grammar id {int(ids[b])}, which no request owns")
            self._catch_up(row, int(lengths[b]), recent[b])
            if row.matcher.is_error():
                n_draft[b] = 0
                continue
            chain, walked = self._walk(row.matcher, drafts[b, :n_draft[b]].tolist(), min(int(limit[b]), k))
            drafts[b, :len(chain)] = chain
            n_draft[b] = len(chain)
            if walked:
                walks.append((row.matcher, b * (k + 1), walked))
            else:
                heads.append((row.matcher, b * (k + 1)))
        with self.lock:
            ticket, self.next_ticket = self.next_ticket, self.next_ticket + 1
            self.pending[ticket] = self.worker.submit(self._fill, B, k, rows, walks, heads)
        self.calls += 1
        self.begin_s += time.perf_counter() - t0
        return np.int32(ticket), drafts, n_draft

    def finish(self, ticket, after=None):
        """The masks of `begin`'s ticket: [B, k+1, W] int32 (position j: after the row's first j
        drafts), and failed [B] bool, the rows whose grammar failed while they were filled (their
        masks allow EOS alone; they accept no draft). `after` is not read: the compiled step passes
        the target's logits, which orders the call after its pass."""
        t0 = time.perf_counter()
        with self.lock:
            fill = self.pending.pop(int(ticket))
        masks, failed = fill.result()
        self.wait_s += time.perf_counter() - t0
        return masks, failed

    def _fill(self, B: int, k: int, rows, walks, heads) -> tuple[np.ndarray, np.ndarray]:
        """`finish`'s results, computed by llguidance for all rows in parallel (on the worker thread)."""
        t0 = time.perf_counter()
        masks = np.full((B * (k + 1), self.words), -1, np.int32)
        failed = np.zeros(B, bool)
        if walks:
            fill_next_token_bitmask_par_with_draft_tokens(self.executor, walks, masks)
        if heads:
            fill_next_token_bitmask_par(self.executor, heads, masks)
        for b, row in rows:
            if row.matcher.is_error():  # a resource limit: the row ends now, at EOS, and reports why (`failure`)
                row.failure = row.failure or row.matcher.get_error().split("\n")[0]
                masks[b * (k + 1):(b + 1) * (k + 1)] = eos_only(self.words, self.tokenizer.eos_token)
                failed[b] = True
        self.fill_s += time.perf_counter() - t0
        return masks.reshape(B, k + 1, self.words), failed

    def _catch_up(self, row: Row, length: int, recent: np.ndarray) -> None:
        """Consume the tokens written since the row's matcher last saw it: those of the buffer from
        start + consumed up to length, the tail of recent."""
        if row.start is None:
            row.start = length  # the first call comes before any token is generated
        new = length - row.start - row.consumed
        if new > len(recent):
            raise RuntimeError(f"{new} tokens were written since the grammar's last step; at most {len(recent)} "
                               f"expected")
        if new <= 0:
            return
        tokens = recent[len(recent) - new:].tolist()
        row.consumed += new
        if row.matcher.is_stopped():  # the grammar ended (EOS, or a failure): later tokens are past it
            return
        if not row.matcher.consume_tokens(tokens):
            raise RuntimeError(f"a constrained row wrote tokens {tokens} its grammar forbids: "
                               f"{row.matcher.get_error()}")

    def _walk(self, matcher: llguidance.LLMatcher, drafts: list[int], limit: int) -> tuple[list[int], list[int]]:
        """The drafts to verify: the proposer's while the grammar allows them, the grammar's forced
        tokens where it forbids one or past the last (EOS once the grammar ended), at most `limit`.
        Returns them and the tokens before the last verify position that needs a mask (the same,
        less a final EOS). The matcher ends where it began."""
        chain: list[int] = []
        consumed = 0
        while len(chain) < limit:
            j = len(chain)
            if matcher.is_stopped():  # the grammar ended: EOS is the one token it allows
                if self.forced_drafts:
                    chain.append(self.tokenizer.eos_token)
                    self.forced += 1
                break
            if j < len(drafts) and matcher.try_consume_tokens([drafts[j]]) == 1:
                chain.append(drafts[j])
                consumed += 1
                if drafts[j] == self.tokenizer.eos_token:
                    break
                continue
            forced = matcher.compute_ff_tokens()[:limit - j] if self.forced_drafts else []
            if not forced or not matcher.consume_tokens(forced):
                break
            chain += forced
            self.forced += len(forced)
            consumed += len(forced)
        if consumed:
            matcher.rollback(consumed)
        ends = bool(chain) and chain[-1] == self.tokenizer.eos_token
        return chain, chain[:-1] if ends else chain
