"""The offline API, shaped like vLLM's: `LLM`, `SamplingParams`, `RequestOutput`.

    llm = LLM(model="path/to/checkpoint", dtype="bfloat16", max_model_len=4096, max_num_seqs=8)
    outs = llm.generate(["prompt"], SamplingParams(max_tokens=64, temperature=0.0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text, outs[0].metrics
    llm.logits([1, 2, 3])  # np.ndarray [T, vocab]
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from models.qwen3_5 import CHUNK, ROLLBACKS, Qwen3_5Model
from proposers.registry import build_proposer, target_drafter
from spec_jax.api.batching import assemble_batch, proposer_reference
from spec_jax.api.metrics import aggregate_metrics, request_metrics
from spec_jax.default_model import default_model_dir
from spec_jax.engine.spec_config import NEEDS_MODEL, parse_speculative_config
from spec_jax.engine.steps import DecodeState, Engine, SpecPlan, enable_compilation_cache
from spec_jax.loading import load_model
from spec_jax.loading.drafters import load_draft
from spec_jax.loading.gguf import find_gguf, gguf_tokenizer
from spec_jax.loading.source import resolve_dtype
from spec_jax.loading.tokenizer import Tokenizer

DEFAULT_MAX_MODEL_LEN = 4096


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request; the fields and defaults are vLLM's.

    temperature 0 is greedy. top_k <= 0 and top_p = 1 switch those filters off. max_tokens
    None generates until a stop token or max_model_len.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    speculative: bool = True  # spec_jax extension: False opts this request out of drafting

    def __post_init__(self):
        """Refuse, naming the field, what is not of the field's type or range (nothing is
        coerced: 2.5 tokens or a string temperature are errors, not 2 tokens or a crash later)."""
        check_int("n", self.n, 1, 1, "only n=1 (one completion per prompt) is supported")
        check_real("temperature", self.temperature, "must be >= 0 (0 means greedy)", lambda t: t >= 0)
        check_real("top_p", self.top_p, "must be in (0, 1]", lambda p: 0 < p <= 1)
        check_int("top_k", self.top_k, -1, INT32_MAX, "must be -1 or 0 (off) or a positive count")
        if self.seed is not None:
            check_int("seed", self.seed, -(2**63), 2**63 - 1, "must fit in 64 bits")
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1, INT32_MAX, "must be a positive number of tokens (or None)")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            for i, t in enumerate(self.stop_token_ids):
                check_int(f"stop_token_ids[{i}]", t, 0, INT32_MAX, "must be a token id")
        for name in ("ignore_eos", "skip_special_tokens", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")


INT32_MAX = 2**31 - 1  # token ids, counts and top_k live in int32 on the device


def check_int(name: str, value, lo: int, hi: int, rule: str) -> None:
    """ValueError naming `name` unless value is an int (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} {rule}")


def check_real(name: str, value, rule: str, ok) -> None:
    """ValueError naming `name` unless value is a finite real number (not a bool) for which ok(value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}={value} {rule}")


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (a stop token) or "length" (max_tokens or max_model_len)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict
    finished: bool = True


class LLM:
    """A Qwen3.5/3.6 checkpoint loaded for generation.

    Args:
      model: checkpoint directory (HF safetensors, GGUF, converted), or a `Qwen3_5Model` already in
        memory (for example random weights made on the device by `bench.models`); None runs the
        embedded default model.
      dtype: "bfloat16", "float32" or "auto" (bfloat16 on GPU, float32 on CPU).
      max_model_len: the longest prompt + completion (default 4096, or the model's limit if lower);
        it sizes the KV cache.
      max_num_seqs: batch rows per step; more prompts run in several batches.
      seed: base seed for requests that do not set their own.
      speculative_config: vLLM's `--speculative-config` (dict or JSON); None runs plain decoding.
      tokenizer: a `tokenizer.json` path (default: the checkpoint's, if it has one).
      rollback: how GDN state returns to the accepted prefix after a verify pass: "checkpoint"
        (keep the state after every verified token and select) or "replay" (keep the delta-rule
        inputs and re-run the accepted prefix). See BENCHMARKS.md for which is faster.
    """

    def __init__(self, model: str | Qwen3_5Model | None = None, *, dtype: str = "auto",
                 max_model_len: int | None = None,
                 max_num_seqs: int = 8, seed: int = 0, speculative_config=None, tokenizer: str | None = None,
                 rollback: str = "replay"):
        if model is None:
            model = str(default_model_dir())
        loaded = model if isinstance(model, Qwen3_5Model) else None
        if loaded is not None:
            model, dtype = None, jnp.dtype(loaded.dtype).name
        if dtype == "auto":
            dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
        resolve_dtype(dtype)
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback={rollback!r}; expected one of {', '.join(ROLLBACKS)}")
        spec = parse_speculative_config(speculative_config, target_model=model)  # fail fast, before loading
        gguf_file = find_gguf(model) if model is not None else None
        if gguf_file is not None and spec is not None and spec.method == "dspark":
            raise ValueError(f"speculative method 'dspark' needs a safetensors target, not the GGUF file {model!r}")
        check_int("max_num_seqs", max_num_seqs, 1, 4096, "must be between 1 and 4096")
        check_int("seed", seed, -(2**63), 2**63 - 1, "must fit in 64 bits")
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, 2, INT32_MAX, "must be at least 2")
        enable_compilation_cache()
        self.model_path = model
        self.model, self.cfg = (loaded, loaded.cfg) if loaded is not None else load_model(model, dtype)
        limit = self.cfg.max_position_embeddings
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, limit) if max_model_len is None else max_model_len
        if not 2 <= max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be between 2 and the model's limit {limit}")
        self.max_model_len = max_model_len
        self._set_speculation(speculative_config, rollback, max_num_seqs)
        self.metrics: dict = {}
        tok_path = Path(tokenizer) if tokenizer else Path(model) / "tokenizer.json" if model else None
        self.tokenizer = Tokenizer(tok_path) if tok_path is not None and tok_path.exists() else None
        if tokenizer and self.tokenizer is None:
            raise ValueError(f"tokenizer file {tokenizer!r} does not exist")
        if not tokenizer and gguf_file is not None:
            self.tokenizer = gguf_tokenizer(gguf_file)  # tokenizer.json beside it, else the GGUF's own vocabulary
        self.seed = seed
        self._requests = 0

    def _set_speculation(self, speculative_config, rollback: str, max_num_seqs: int, draft=None) -> None:
        spec = parse_speculative_config(speculative_config, target_model=self.model_path,
                                        target_has_mtp=self.model.mtp is not None)
        if spec is not None and spec.num_speculative_tokens + 1 >= self.max_model_len:
            raise ValueError(f"num_speculative_tokens={spec.num_speculative_tokens} leaves no room in max_model_len="
                             f"{self.max_model_len}: a step verifies k + 1 tokens")
        if spec is not None and (spec.prompt_lookup_max or 0) >= self.max_model_len:
            raise ValueError(f"prompt_lookup_max={spec.prompt_lookup_max} must be below max_model_len="
                             f"{self.max_model_len}")
        self.speculative_config = spec
        if draft is not None and (spec is None or spec.method not in NEEDS_MODEL):
            raise ValueError(f"a draft network was given but speculative method "
                             f"{spec.method if spec else None!r} runs none; methods with one: {', '.join(NEEDS_MODEL)}")
        if draft is None and spec is not None and spec.method in NEEDS_MODEL:
            draft = load_draft(spec, self.cfg, self.model.dtype)
        if spec is not None and draft is None:
            draft = target_drafter(spec, self.model)
        cache_len = -(-self.max_model_len // CHUNK) * CHUNK
        plan = None if spec is None else SpecPlan(build_proposer(spec, self.cfg.vocab_size, cache_len, draft),
                                                  spec.num_speculative_tokens, rollback,
                                                  spec.draft_sample_method == "probabilistic")
        self.engine = Engine(self.model, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs, plan=plan,
                             draft=draft)

    def with_speculation(self, speculative_config, *, rollback: str = "replay", draft=None) -> "LLM":
        """The same loaded weights with another speculative config (None: plain decoding), for
        comparing methods without reloading. Compiled executables are per config.

        draft: the method's drafter network already in memory (for example one made on the
        device by `bench.models.random_drafter`), used in place of loading the config's `model`.
        """
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback={rollback!r}; expected one of {', '.join(ROLLBACKS)}")
        other = copy.copy(self)
        other._set_speculation(speculative_config, rollback, self.engine.max_num_seqs, draft)
        other.metrics, other._plain_engine = {}, None
        return other

    # ------------------------------------------------------------------ inputs

    def _check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence | np.ndarray):
            raise ValueError(f"{what} must be a list of token ids, got {ids!r}")
        wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))]
        if wrong:
            raise ValueError(f"{what} has {wrong[0]!r} ({type(wrong[0]).__name__}) where a token id (an integer) "
                             f"belongs")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{what} is empty; a prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{what} has {len(ids)} tokens but max_model_len is {self.max_model_len}; "
                f"it must be shorter to leave room for at least one generated token")
        return ids

    def _encode(self, prompt: str, what: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TypeError(f"{what} must be a string, got {type(prompt).__name__}; pass token ids as prompt_token_ids")
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer.json; pass prompt_token_ids instead of text")
        return self.tokenizer.encode(prompt)

    def tokenize(self, prompt: str | Sequence[int], what: str = "prompt") -> list[int]:
        """A prompt's token ids, checked: text through the checkpoint's tokenizer, ids as given.
        Raises ValueError naming `what` for an empty prompt, an id outside the vocabulary, or a
        prompt that leaves no room for a generated token under max_model_len."""
        return self._check_ids(self._encode(prompt, what) if isinstance(prompt, str) else prompt, what)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Full-sequence target logits: token_ids [T] -> np.ndarray [T, vocab] float32."""
        ids = self._check_ids(token_ids, "token_ids")
        return self.engine.logits(np.asarray(ids, np.int32))

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt (text, or token ids through `prompt_token_ids`).

        sampling_params: one for all prompts or one per prompt (default: SamplingParams()).
        Prompts run in batches of up to max_num_seqs rows. Returns one RequestOutput per prompt,
        in order.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts (text) or prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            ids = [self._check_ids(self._encode(p, f"prompt {i}"), f"prompt {i}") for i, p in enumerate(prompts)]
        else:
            if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence | np.ndarray):
                raise ValueError(f"prompt_token_ids must be a list of token-id lists, got {prompt_token_ids!r}")
            ids = [self._check_ids(p, f"prompt_token_ids[{i}]") for i, p in enumerate(prompt_token_ids)]
            prompts = [None] * len(ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(ids) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} sampling_params for {len(ids)} prompts")
        outputs = []
        n = self.engine.max_num_seqs
        t0 = time.perf_counter()
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            for s in range(0, len(ids), n):
                outputs += self._run_batch(prompts[s:s + n], ids[s:s + n], params[s:s + n])
                bar.update(len(ids[s:s + n]))
        self.metrics = aggregate_metrics(outputs)
        self.metrics["tokens_per_s"] = self.metrics["num_generated_tokens"] / (time.perf_counter() - t0)
        return outputs

    # ------------------------------------------------------------------ the functional layer

    def prefill(self, prompt_token_ids: Sequence[Sequence[int]],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> DecodeState:
        """The explicit-state entry for notebooks and eval loops: pad up to max_num_seqs prompts
        to their buckets (batch rows and prompt length, powers of two) and prefill them.

        Returns the `DecodeState` pytree (`tokens` [B, L], `lengths` [B], `done` [B], caches,
        proposer state, `stats`); rows past the prompts are padding and start done. Step it with
        `decode`; row i's tokens are `tokens[i, len(prompt_i):lengths[i]]`.
        """
        ids = [self.tokenize(p, f"prompt_token_ids[{i}]") for i, p in enumerate(prompt_token_ids)]
        if not 1 <= len(ids) <= self.engine.max_num_seqs:
            raise ValueError(f"got {len(ids)} prompts; prefill takes 1 to max_num_seqs={self.engine.max_num_seqs}")
        params = sampling_params or SamplingParams()
        params = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} sampling_params for {len(ids)} prompts")
        return self.start_batch(ids, params)[0]

    def decode(self, state: DecodeState, steps: int = 1) -> DecodeState:
        """Run up to `steps` jitted (speculative) steps on a `prefill`ed state, on the device,
        stopping early when every row is done. The state is donated: use the returned one."""
        if steps < 1:
            raise ValueError(f"steps={steps} must be at least 1")
        do_sample = bool(jax.device_get(jnp.any(state.sampling.temperature > 0)))
        return self.engine.decode(state, steps, do_sample)

    def _row_seed(self, p: SamplingParams) -> int:
        self._requests += 1
        return p.seed if p.seed is not None else hash((self.seed, self._requests)) & 0x7FFFFFFF

    def start_batch(self, ids: Sequence[Sequence[int]], params: Sequence[SamplingParams], *,
                    stop_width: int | None = None, do_sample: bool | None = None):
        """Pad a batch of checked prompt ids to the engine's buckets and prefill it (one
        `SamplingParams` a row). Returns (DecodeState, do_sample, each row's stop ids). The
        scheduler fixes stop_width (the stop_ids columns) and do_sample so that every row it
        prefills fits its live batch."""
        seeds = [self._row_seed(p) for p in params]
        batch = assemble_batch(ids, params, seeds, rows=self.engine.batch_bucket(len(ids)),
                               prompt_len=self.engine.prompt_bucket(max(len(x) for x in ids)),
                               max_model_len=self.max_model_len, eos=self.cfg.eos_token_id, stop_width=stop_width)
        do_sample = batch.do_sample if do_sample is None else do_sample
        reference = proposer_reference(self.engine, batch, self._plain, do_sample)
        state = self.engine.prefill(*batch.inputs(), jnp.asarray(batch.speculate), reference, do_sample)
        return state, do_sample, batch.stops

    def _plain(self) -> Engine:
        """A plain-decoding engine on the same weights (the oracle's reference run), made once."""
        if getattr(self, "_plain_engine", None) is None:
            self._plain_engine = Engine(self.model, max_model_len=self.max_model_len,
                                        max_num_seqs=self.engine.max_num_seqs)
        return self._plain_engine

    def _run_batch(self, prompts, ids, params) -> list[RequestOutput]:
        t0 = time.perf_counter()
        state, do_sample, stops = self.start_batch(ids, params)
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        state = self.engine.decode(state, self.max_model_len, do_sample)
        out_tokens, out_lengths, stats, steps = jax.device_get((state.tokens, state.lengths, state.stats, state.steps))
        t2 = time.perf_counter()
        results = []
        for i in range(len(ids)):
            gen = out_tokens[i, len(ids[i]):out_lengths[i]].tolist()
            finish = "stop" if gen and gen[-1] in stops[i] else "length"
            text = self.tokenizer.decode(gen, params[i].skip_special_tokens) if self.tokenizer else ""
            metrics = request_metrics(len(ids[i]), len(gen), t1 - t0, t2 - t1, stats, i)
            metrics["batch_decode_steps"] = int(steps)
            results.append(RequestOutput(str(self._requests - len(ids) + i), prompts[i], ids[i],
                                         [CompletionOutput(0, text, gen, finish)], metrics))
        return results

    def generate_stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                        prompt_token_ids: Sequence[int] | None = None, steps_per_chunk: int = 1):
        """Yield a request's new token ids as they are accepted (the same jitted step as
        `generate`, run `steps_per_chunk` steps per device call). One request at a time."""
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompt (text) or prompt_token_ids")
        if steps_per_chunk < 1:
            raise ValueError(f"steps_per_chunk={steps_per_chunk} must be at least 1")
        ids = self.tokenize(prompt if prompt is not None else prompt_token_ids)
        params = sampling_params or SamplingParams()
        state, do_sample, _ = self.start_batch([ids], [params])
        sent = len(ids)
        while True:
            length, done = (int(x) for x in jax.device_get((state.lengths[0], state.done[0])))
            if length > sent:
                yield jax.device_get(state.tokens[0, sent:length]).tolist()
                sent = length
            if done:
                return
            state = self.engine.decode(state, steps_per_chunk, do_sample)
