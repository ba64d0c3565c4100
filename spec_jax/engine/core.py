"""The `EngineCore`: what both front ends drive (`LLM.generate` offline, the server's `Scheduler`
continuously). It turns requests into rows (checked prompt ids, sampling, seeds, bad words, logit
processors), holds the prefix store, runs batches on its `Runner` and builds completions.

    core = start_engine(model, EngineConfig(max_model_len=256), tokenizer=tokenizer)
    state, do_sample, stops = core.start([[1, 2, 3]], [SamplingParams(max_tokens=8)])
    state = core.decode(state, 8, do_sample)

`start_engine` settles the batch size (vLLM's gpu_memory_utilization) before the core exists, so
nothing compiled ever sees another max_num_seqs.
"""

from __future__ import annotations

import array
import dataclasses
import logging
import time
from typing import NoReturn, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.qwen3_5 import Qwen3_5Model
from proposers.registry import build_proposer, target_drafter
from spec_jax.engine.adaptive import StepTimes, compiled_widths
from spec_jax.engine.batch import assemble_batch
from spec_jax.engine.config import DEFAULT_PREFIX_CACHE_BYTES, EngineConfig
from spec_jax.engine.detokenize import cut_at_stop_string
from spec_jax.engine.grammar_rows import GrammarRows
from spec_jax.engine.metrics import request_metrics
from spec_jax.engine.params import CompletionOutput, SamplingParams, logprob_entries
from spec_jax.engine.prefix_cache import PrefixCache
from spec_jax.engine.runner import Runner, bucket
from spec_jax.engine.sampling import MAX_BAD_WORD_LENGTH, MAX_BAD_WORDS
from spec_jax.engine.spec_config import SpeculativeConfig
from spec_jax.engine.state import DecodeState, SpecPlan, shared_of, with_shared

log = logging.getLogger("spec_jax")


def device_memory() -> dict:
    """The first device's memory figures (`bytes_limit`, `bytes_in_use`); empty where it reports none (the CPU)."""
    return jax.devices()[0].memory_stats() or {}


def integer_array(ids: Sequence[int] | np.ndarray) -> np.ndarray | None:
    """ids [T] as an integer array (a list's as int64, an integer array as it is), or None where
    one is not an integer (a bool, a float, ...) or does not fit 64 bits. A list is read in one
    pass in C, not one for its set of types and another to convert it."""
    if isinstance(ids, np.ndarray):
        return ids if np.issubdtype(ids.dtype, np.integer) else None
    try:  # array("q") takes exactly the objects with __index__, of which bool is one
        values = np.frombuffer(array.array("q", ids), np.int64)
    except (TypeError, OverflowError):
        return None
    maybe_bool = np.flatnonzero(values <= 1)  # True and False are read as 1 and 0
    return None if any(isinstance(ids[i], bool) for i in maybe_bool) else values


def make_plan(config: EngineConfig, vocab_size: int, draft) -> SpecPlan | None:
    """The speculative step of `config.speculative` (None: plain decoding): its `proposer` when
    it gives one, else the registry's for its method."""
    spec = config.speculative
    if spec is None:
        return None
    proposer = spec.proposer if spec.proposer is not None else build_proposer(spec, vocab_size, config.cache_len,
                                                                              draft)
    k = config.k
    return SpecPlan(proposer, k, config.rollback, spec.draft_sample_method == "probabilistic",
                    spec.rejection_sample_method, compiled_widths(k) if spec.enable_adaptive_verification else (k,))


def row_bytes(runner: Runner, plan: SpecPlan | None, config: EngineConfig) -> int:
    """Device bytes a batch row adds: its `DecodeState` (with the acceptance rates a synthetic
    plan's rows carry) and a step's float32 logits, probabilities and draws over the k + 1
    verified positions."""
    batch = assemble_batch([[0]], [SamplingParams()], [0], rows=1, prompt_len=runner.prompt_bucket(1),
                           max_model_len=config.max_model_len, eos=runner.cfg.eos_token_id)
    state = runner.state_bytes(plan, *batch.inputs(), jnp.asarray(batch.speculate))
    rates = 4 * config.k if plan is not None and plan.acceptance == "synthetic" else 0
    return state + rates + 3 * (config.k + 1) * runner.cfg.vocab_size * 4


def sized(config: EngineConfig, row: int) -> EngineConfig:
    """vLLM's gpu_memory_utilization: max_num_seqs lowered to the rows of caches (`row` bytes each)
    that fit in that share of the device's memory beside what is loaded, and a prefix store of no
    given size takes what the batch leaves; says what it chose."""
    utilization, asked = config.gpu_memory_utilization, config.max_num_seqs
    stats = device_memory()
    if not stats.get("bytes_limit"):
        log.info("gpu_memory_utilization=%s: the %s device reports no memory limit; max_num_seqs stays %d",
                 utilization, jax.default_backend(), asked)
        return config
    budget = utilization * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    fit = int(budget // row)
    if fit < 1:
        raise ValueError(f"gpu_memory_utilization={utilization} leaves {budget / 1e9:.2f} GB beside the "
                         f"{stats.get('bytes_in_use', 0) / 1e9:.2f} GB loaded, less than one row of caches "
                         f"({row / 1e9:.3f} GB at max_model_len {config.max_model_len}); raise it or lower "
                         f"max_model_len")
    chosen = min(asked, fit)
    log.info("gpu_memory_utilization=%s: %.2f GB for caches at %.3f GB a row (max_model_len %d): max_num_seqs %d "
             "(cap %d)", utilization, budget / 1e9, row / 1e9, config.max_model_len, chosen, asked)
    buckets = None if config.batch_buckets is None else tuple(b for b in config.batch_buckets if b < chosen)
    config = dataclasses.replace(config, max_num_seqs=chosen, batch_buckets=buckets)
    if config.enable_prefix_caching and config.prefix_cache_bytes is None:
        left = max(0, int(budget - chosen * row))
        log.info("gpu_memory_utilization=%s: %.2f GB left for the prefix cache", utilization, left / 1e9)
        config = dataclasses.replace(config, prefix_cache_bytes=left)
    return config


def start_engine(model: Qwen3_5Model, config: EngineConfig, *, draft=None, tokenizer=None,
                 name: str | None = None, mesh=None) -> "EngineCore":
    """An `EngineCore` over a loaded model: `config` resolved against it (`EngineConfig.for_model`)
    and, with gpu_memory_utilization, sized to the device. draft: the method's network, loaded
    (None: the one cut from the target, if the method has one); tokenizer: anything with encode /
    decode, for text, stop strings and bad words; name: the checkpoint's path, which messages
    name; mesh: the tensor-parallel mesh."""
    config = config.for_model(model.cfg, has_mtp=model.mtp is not None)
    if draft is None and config.speculative is not None:
        draft = target_drafter(config.speculative, model)
    runner = Runner(model, draft, config, mesh)
    plan = make_plan(config, model.cfg.vocab_size, draft)
    if config.gpu_memory_utilization is not None:
        config = sized(config, row_bytes(runner, plan, config))
    core = EngineCore(model, config, runner, plan, tokenizer=tokenizer, name=name)
    core.log_memory()
    return core


class EngineCore:
    """Requests to rows, batches on the runner, rows to completions (see the module's docstring).
    Build one with `start_engine`; `with_speculation` gives another on the same weights."""

    def __init__(self, model: Qwen3_5Model, config: EngineConfig, runner: Runner, plan: SpecPlan | None, *,
                 tokenizer=None, name: str | None = None, requests: int = 0,
                 step_times: dict[int, StepTimes] | None = None):
        """step_times: an adaptive plan's cost model per batch bucket, shared by the cores on one runner."""
        self.model = model
        self.config = config
        self.runner = runner
        self.cfg = runner.cfg
        self.plan = plan
        self.tokenizer = tokenizer
        self.name = name
        self.requests = requests  # rows and requests started: an unseeded row's seed, a request's id
        self.prefix_cache = self.new_store()
        self.step_times = {} if step_times is None else step_times
        self._grammars: GrammarRows | None = None  # made at the first constrained request
        self.shared = []  # the proposer's `Shared` state, handed from one batch of `run_batch` to the next

    def grammar_rows(self) -> GrammarRows:
        """The host matchers of this core's constrained rows (made at first use, from the tokenizer)."""
        if self._grammars is None:
            text = getattr(getattr(self.tokenizer, "hf", None), "to_str", None)
            if text is None:
                raise ValueError(f"structured outputs need the model's tokenizer.json, and {self.name} has none")
            options = dict(forced_drafts=self.config.grammar_drafts, reasoning_parser=self.config.reasoning_parser)
            self._grammars = GrammarRows(text(), self.cfg.vocab_size, self.cfg.eos_token_id[0], **options)
        return self._grammars

    def grammar_ids(self, state: DecodeState) -> list[int]:  # -1: none; empty when no row has one
        return [] if state.sampling.grammar is None else np.asarray(state.sampling.grammar).tolist()

    def grammar_failure(self, grammar_id: int) -> str | None:
        """Why a row's grammar failed (`GrammarRows.failure`), or None."""
        return None if grammar_id < 0 or self._grammars is None else self._grammars.failure(grammar_id)

    def release(self, grammar_ids: Sequence[int]) -> None:
        """Forget the grammar matchers of finished rows (`grammar_ids`)."""
        if self._grammars is not None:
            self._grammars.release(grammar_ids)

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (the store's counters stay); False when caching is off."""
        if self.prefix_cache is None:
            return False
        self.prefix_cache.clear()
        return True

    def new_store(self) -> PrefixCache | None:
        """A new, empty prefix store (None when prefix caching is off). Its root key names what its
        blocks depend on: the model, its dtype, the speculative config, the block size and mode."""
        c = self.config
        if not c.enable_prefix_caching:
            return None
        budget = DEFAULT_PREFIX_CACHE_BYTES if c.prefix_cache_bytes is None else c.prefix_cache_bytes
        root = (f"{self.name or id(self.model)}|{jnp.dtype(self.runner.dtype).name}|{c.speculative!r}|"
                f"{c.prefix_block_size}|invariant={c.batch_invariant}")
        return PrefixCache(root, c.prefix_block_size, budget, c.prefix_cache_host_bytes)

    def with_speculation(self, spec: SpeculativeConfig | None, rollback: str, *, draft=None) -> "EngineCore":
        """A core on the same weights with another speculative config (None: plain decoding), its
        own runner and a new prefix store. draft: as `start_engine`'s."""
        config = dataclasses.replace(self.config, speculative=spec, rollback=rollback).for_model(
            self.cfg, has_mtp=self.model.mtp is not None)
        if draft is None and spec is not None:
            draft = target_drafter(spec, self.model)
        runner = Runner(self.model, draft, config, self.runner.mesh)
        plan = make_plan(config, self.cfg.vocab_size, draft)
        return EngineCore(self.model, config, runner, plan, tokenizer=self.tokenizer, name=self.name,
                          requests=self.requests)

    def keeps_step(self, spec: SpeculativeConfig | None, rollback: str) -> bool:
        """Whether `spec` and `rollback` run this core's speculative step (`SpeculativeConfig.same_step`)."""
        current = self.config.speculative
        return (current is not None and spec is not None and rollback == self.config.rollback
                and current.same_step(spec))

    def with_rates(self, spec: SpeculativeConfig) -> "EngineCore":
        """A core on this one's runner, drafter and plan, and so its compiled programs, under a
        config that only changes the synthetic acceptance rates (`keeps_step`), with a new prefix store."""
        if not self.keeps_step(spec, self.config.rollback):
            raise ValueError(f"{spec} changes more than the synthetic acceptance rates of {self.config.speculative}")
        return EngineCore(self.model, dataclasses.replace(self.config, speculative=spec), self.runner, self.plan,
                          tokenizer=self.tokenizer, name=self.name, requests=self.requests, step_times=self.step_times)

    def with_tokenizer(self, tokenizer) -> "EngineCore":
        """This core's runner and plan (so its programs) with `tokenizer`; a new prefix store."""
        return EngineCore(self.model, self.config, self.runner, self.plan, tokenizer=tokenizer, name=self.name,
                          requests=self.requests, step_times=self.step_times)

    def log_memory(self) -> None:
        """Say where the device's memory goes: weights, the batch's caches, the prefix store."""
        stats = device_memory()
        if not stats.get("bytes_limit") or not log.isEnabledFor(logging.INFO):
            return
        weights = sum(x.nbytes for x in self.runner.param_leaves)  # the target's and any drafter's
        row = self.row_bytes()
        store = self.prefix_cache.budget_bytes if self.prefix_cache is not None else 0
        log.info("device memory: %.2f GB the allocator may take; weights (with any drafter) %.2f GB, caches "
                 "%.2f GB (%d rows x %.3f GB at max_model_len %d), prefix store up to %.2f GB",
                 stats["bytes_limit"] / 1e9, weights / 1e9, row * self.max_num_seqs / 1e9, self.max_num_seqs,
                 row / 1e9, self.max_model_len, store / 1e9)

    def row_bytes(self) -> int:  # `row_bytes` of this core
        return row_bytes(self.runner, self.plan, self.config)

    # ------------------------------------------------------------------ requests to rows

    def next_request(self) -> int:
        """A fresh number from the counter unseeded rows and request ids draw on."""
        self.requests += 1
        return self.requests - 1

    def batch_bucket(self, n: int) -> int:
        """The rows a batch of n runs in: the smallest bucket that holds it, max_num_seqs at most."""
        buckets, most = self.config.batch_buckets, self.max_num_seqs
        if buckets is None:
            return bucket(n, 1, most)
        return min([b for b in buckets if n <= b < most] + [most])

    def prompt_ids(self, prompt: str | Sequence[int], what: str) -> np.ndarray:
        """A prompt's token ids [T], checked: text through the tokenizer, ids as given (`check_ids`)."""
        return self.check_ids(self.encode(prompt, what) if isinstance(prompt, str) else prompt, what)

    def encode(self, prompt: str, what: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"{what} must be a string, got {type(prompt).__name__}; pass token ids as prompt_token_ids")
        if self.tokenizer is None:
            raise ValueError(f"{self.name} has no tokenizer.json; pass prompt_token_ids instead of text")
        return self.tokenizer.encode(prompt)

    def check_ids(self, ids: Sequence[int], what: str) -> np.ndarray:
        """A prompt's token ids [T] checked (ValueError naming `what` for a non-integer, an empty
        prompt, an id outside the vocabulary, or no room left for a generated token), as
        `integer_array` gives them."""
        if (isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | np.ndarray)
                or (isinstance(ids, np.ndarray) and ids.ndim != 1)):
            raise ValueError(f"{what} must be a list of token ids, got {str(ids)[:80]}")
        if isinstance(ids, np.ndarray) and ids.dtype == object:  # Python objects: checked one by one, as a list's
            ids = ids.tolist()
        values = integer_array(ids)
        if values is None or values.ndim != 1 or not len(values) or not self._in_vocabulary(values):
            self._name_bad_id(ids, what)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{what} has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                f"it must be shorter to leave room for at least one generated token")
        return values

    def _in_vocabulary(self, ids: np.ndarray) -> bool:
        return 0 <= ids.min() and ids.max() < self.cfg.vocab_size

    def _name_bad_id(self, ids: Sequence[int], what: str) -> NoReturn:
        """Raise ValueError naming the first value of ids that is not a token id of the vocabulary."""
        wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
        if wrong:
            raise ValueError(f"{what} has {wrong[0]!r} ({type(wrong[0]).__name__}) where a token id (an integer) "
                             f"belongs")
        if not len(ids):
            raise ValueError(f"{what} is empty; a prompt needs at least one token")
        bad = [int(t) for t in ids if not 0 <= t < self.cfg.vocab_size]
        raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")

    def bad_word_forms(self, p: SamplingParams) -> list[list[int]]:
        """A request's bad_words as the token sequences vLLM bans: each word with leading spaces
        stripped, and with one space before it when that starts with another token and is as many
        tokens long. Raises ValueError when a form is longer than MAX_BAD_WORD_LENGTH tokens or a
        request has more than MAX_BAD_WORDS forms of several tokens."""
        if not p.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError(f"bad_words need a tokenizer, and {self.name} has none; use logit_bias")
        forms = []
        for word in p.bad_words:
            plain = self.tokenizer.encode(word.lstrip())
            spaced = self.tokenizer.encode(" " + word.lstrip())
            forms += [plain] + ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        if max(map(len, forms)) > MAX_BAD_WORD_LENGTH:
            raise ValueError(f"bad_words: {max(forms, key=len)!r} is longer than {MAX_BAD_WORD_LENGTH} tokens, the "
                             f"most a bad word may have")
        if sum(len(f) > 1 for f in forms) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words: {sum(len(f) > 1 for f in forms)} word forms of several tokens; at most "
                             f"{MAX_BAD_WORDS} are supported")
        return forms

    def check_params(self, p: SamplingParams) -> list[list[int]]:
        """What SamplingParams cannot check alone, against this model: logit_bias keys and
        allowed_token_ids are ids of its vocabulary; stop strings and bad_words need its tokenizer.
        Raises ValueError naming the field; returns the request's `bad_word_forms`."""
        if p.min_tokens > self.max_model_len:
            raise ValueError(f"min_tokens={p.min_tokens} exceeds max_model_len={self.max_model_len}: no completion "
                             f"can be that long")
        if p.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer, and {self.name} has none; use stop_token_ids")
        for name, ids in (("logit_bias", [int(t) for t in p.logit_bias or {}]),
                          ("allowed_token_ids", p.allowed_token_ids or []), ("stop_token_ids", p.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        if p.structured is not None:
            if self.config.tensor_parallel_size > 1:
                raise ValueError("structured outputs are not built for tensor_parallel_size > 1 yet")
            self.grammar_rows().matcher(p.structured)  # compiles (and caches) the grammar, or says why not
        return self.bad_word_forms(p)

    def _row_seed(self, p: SamplingParams) -> int:
        n = self.next_request() + 1
        return p.seed if p.seed is not None else hash((self.config.seed, n)) & 0x7FFFFFFF

    # ------------------------------------------------------------------ running rows

    def start(self, ids: Sequence[Sequence[int]], params: Sequence[SamplingParams], *,
              stop_width: int | None = None, do_sample: bool | None = None,
              processors: frozenset[str] = frozenset(), num_logprobs: int | None = None,
              rows: int | None = None) -> tuple[DecodeState, bool, list[list[int]]]:
        """Pad a batch of checked prompt ids to the buckets and prefill it (one `SamplingParams` a
        row). Returns (DecodeState, do_sample, each row's stop ids). A continuous batch fixes
        stop_width (the stop_ids columns), do_sample, the logit processors carried (`RowSampling`'s
        optional fields, besides those a row uses) and num_logprobs kept per token (default: the
        most any row asks for) so that every row it prefills fits its live batch, and rows
        (default: the batch bucket of len(ids)) to 1 for a request joining it."""
        seeds = [self._row_seed(p) for p in params]
        grammars = None
        if any(p.structured is not None for p in params) or "grammar" in processors:
            rows_of = self.grammar_rows()
            grammars = [rows_of.add(p.structured, x) if p.structured is not None else -1 for x, p in zip(ids, params)]
        batch = assemble_batch(ids, params, seeds, rows=rows or self.batch_bucket(len(ids)),
                               prompt_len=self.runner.prompt_bucket(max(len(x) for x in ids)),
                               max_model_len=self.max_model_len, eos=self.cfg.eos_token_id, stop_width=stop_width,
                               vocab_size=self.cfg.vocab_size, bad_words=[self.bad_word_forms(p) for p in params],
                               processors=processors, grammars=grammars)
        do_sample = batch.do_sample if do_sample is None else do_sample
        if num_logprobs is None:
            num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if self.prefix_cache is not None:
            self.prefix_cache.take_found()  # from here on its lookups are this batch's rows'
        state = self.runner.prefill(self.plan, self.prefix_cache, *batch.inputs(), batch.speculate, do_sample,
                                    num_logprobs, self._grammars_of(batch.sampling))
        return self._with_plan_data(state, len(batch.lengths)), do_sample, batch.stops

    def _grammars_of(self, sampling) -> GrammarRows | None:
        """The `GrammarRows` a program over rows with this sampling calls: ours when they carry grammar ids."""
        return self._grammars if sampling.grammar is not None else None

    def _with_plan_data(self, state: DecodeState, rows: int) -> DecodeState:
        """What the plan's step reads besides the prefill's state: the synthetic acceptance rule's
        rates [rows, k]."""
        if self.plan is None or self.plan.acceptance != "synthetic":
            return state
        rates = np.asarray(self.config.speculative.synthetic_conditional_rates(), np.float32)
        return dataclasses.replace(state, acceptance_rates=jnp.asarray(np.tile(rates, (rows, 1))))

    def decode(self, state: DecodeState, steps: int, do_sample: bool) -> DecodeState:
        """Up to `steps` (speculative) steps on the device; the state is donated. Under an adaptive
        plan the first steps of each batch bucket time every verify width (`StepTimes.calibrate`)."""
        plan, grammars = self.plan, self._grammars_of(state.sampling)
        if plan is None or not plan.adaptive:
            return self.runner.decode(plan, state, steps, do_sample, grammars)
        times = self.step_times.setdefault(state.done.shape[0], StepTimes(len(plan.widths)))
        run = lambda s, n, force: self.runner.decode(plan, s, n, do_sample, grammars, force)  # noqa: E731
        state, steps = times.calibrate(run, state, steps)
        return self.runner.decode(plan, state, steps, do_sample, grammars, times.times()) if steps > 0 else state

    def insert(self, state: DecodeState, row: int, new: DecodeState) -> DecodeState:
        """`Runner.insert`: the one-row state `new` into slot `row` of the live `state` (donated)."""
        return self.runner.insert(state, row, new)

    def with_processors(self, state: DecodeState, names: frozenset[str], num_logprobs: int | None) -> DecodeState:
        """`Runner.with_processors`: the live state carrying these logit processors and logprobs."""
        return self.runner.with_processors(state, names, num_logprobs)

    def logits(self, token_ids: np.ndarray) -> np.ndarray:
        """Full-sequence target logits: token_ids [T] -> [T, vocab] float32."""
        return self.runner.logits(token_ids)

    def run_batch(self, ids: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[tuple]:
        """One batch of rows to the end: each row's (CompletionOutput, metrics)."""
        t0 = time.perf_counter()
        state, do_sample, stops = self.start(ids, params)
        state, self.shared = with_shared(state, self.shared), []  # the arrays go to the state, donated
        cached = self.prefix_cache.take_found() if self.prefix_cache is not None else [0] * len(ids)  # row order
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        held = self.grammar_ids(state)
        try:
            state = self.decode(state, self.max_model_len, do_sample)
            self.shared = shared_of(state)
            out_tokens, out_lengths, stats, steps, logprobs = jax.device_get(
                (state.tokens, state.lengths, state.stats, state.steps, state.logprobs))
            failed = [(row, self.grammar_failure(i)) for row, i in enumerate(held) if self.grammar_failure(i)]
        finally:
            self.release(held)
        if failed:
            row, failure = failed[0]
            raise RuntimeError(f"structured outputs: the grammar engine gave up on the batch's row {row}: {failure}")
        t2 = time.perf_counter()
        results = []
        for i, p in enumerate(params):
            gen = out_tokens[i, len(ids[i]):out_lengths[i]].tolist()
            out = self.completion(gen, p, stops[i])
            if p.logprobs is not None:
                self._attach_logprobs(out, logprobs, i, len(ids[i]), p)
            metrics = request_metrics(len(ids[i]), len(out.token_ids), t1 - t0, t2 - t1, stats, i)
            metrics["batch_decode_steps"] = int(steps)
            metrics["num_cached_tokens"] = cached[i]  # prompt tokens resumed from the prefix cache
            results.append((out, metrics))
        return results

    # ------------------------------------------------------------------ rows to completions

    def completion(self, gen: list[int], p: SamplingParams, stop_ids: list[int]) -> CompletionOutput:
        """A row's generated ids as vLLM reports them: cut at the first stop string, with the text,
        finish_reason and stop_reason (the stop string or stop token id; None at EOS or length)."""
        if p.stop and self.tokenizer is not None:
            text, cut, stop = cut_at_stop_string(self.tokenizer, gen, p.stop_strings, p.skip_special_tokens,
                                                 p.include_stop_str_in_output)
            if stop is not None:
                return CompletionOutput(0, text if p.detokenize else "", cut, "stop", stop)
            text = text if p.detokenize else ""
        else:
            text = self.tokenizer.decode(gen, p.skip_special_tokens) if self.tokenizer and p.detokenize else ""
        if gen and gen[-1] in stop_ids:
            return CompletionOutput(0, text, gen, "stop", None if gen[-1] in self.cfg.eos_token_id else gen[-1])
        return CompletionOutput(0, text, gen, "length")

    def _attach_logprobs(self, out: CompletionOutput, kept, row: int, start: int, p: SamplingParams) -> None:
        """vLLM's logprobs of a completion from the batch's `EmittedLogprobs` (on the host): per
        token, its own entry and the top `p.logprobs` ones; the cumulative logprob."""
        at = slice(start, start + len(out.token_ids))
        out.logprobs = logprob_entries(out.token_ids, kept.token[row, at], kept.rank[row, at], kept.top_ids[row, at],
                                       kept.top[row, at], p.logprobs, self.token_text if p.detokenize else None)
        out.cumulative_logprob = float(sum(kept.token[row, at]))

    def prompt_logprobs(self, ids: list[int], p: SamplingParams) -> list | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then each token's entry and the
        top `p.prompt_logprobs` (`logprob_entries`), from the target's raw logits."""
        if p.prompt_logprobs is None:
            return None
        token, rank, top_ids, top = self.runner.prompt_logprobs(np.asarray(ids, np.int32), p.prompt_logprobs)
        return [None] + logprob_entries(ids[1:], token, rank, top_ids, top, p.prompt_logprobs,
                                        self.token_text if p.detokenize else None)

    def token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], False)
