"""The offline API, shaped like vLLM's: `LLM` (its request and result types are in `params`).

    llm = LLM(model="path/to/checkpoint", dtype="bfloat16", max_model_len=4096, max_num_seqs=8)
    outs = llm.generate(["prompt"], SamplingParams(max_tokens=64, temperature=0.0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text, outs[0].metrics
    llm.logits([1, 2, 3])  # np.ndarray [T, vocab]
"""

from __future__ import annotations

import array
import copy
import functools
import itertools
import logging
import os
import time
from pathlib import Path
from typing import NoReturn, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from models.qwen3_5 import CHUNK, ROLLBACKS, Qwen3_5Model
from models.tensor_parallel import make_mesh, shard_model
from proposers.registry import build_proposer, target_drafter
from spec_jax.api.batching import assemble_batch, proposer_reference, reference_shape
from spec_jax.api.engine_args import check_quantization, checkpoint_methods
from spec_jax.api.engine_args import resolve as resolve_engine_args
from spec_jax.api.chat import ChatTemplate, ChatTokenizer, conversations, cut_at_stop_string
from spec_jax.api.metrics import LifetimeCounters, aggregate_metrics, merge_metrics, request_metrics
from spec_jax.api.params import (INT32_MAX, CompletionOutput, RequestOutput, SamplingParams, check_int,
                                 fan_out, generation_defaults, logprob_entries)
from spec_jax.default_model import default_model_dir
from spec_jax.engine.sampling import MAX_BAD_WORD_LENGTH, MAX_BAD_WORDS
from spec_jax.engine.prefix_cache import PrefixCache
from spec_jax.engine.memory import claim_device_memory
from spec_jax.engine.spec_config import NEEDS_MODEL, parse_speculative_config
from spec_jax.engine.steps import DecodeState, Engine, SpecPlan, cache_length, enable_compilation_cache
from spec_jax.loading import load_model
from spec_jax.loading.drafters import load_draft
from spec_jax.loading.gguf import find_gguf, gguf_tokenizer
from spec_jax.loading.hub import local_checkpoint
from spec_jax.loading.quantized import quantize_projections
from spec_jax.loading.source import resolve_dtype
from spec_jax.loading.tokenizer import Tokenizer

log = logging.getLogger("spec_jax")

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 8
MAX_NUM_SEQS_SIZED = 256  # vLLM's default max_num_seqs: the cap when gpu_memory_utilization sizes the batch


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


def checked_batch_buckets(buckets, max_num_seqs: int) -> tuple[int, ...] | None:
    """batch_buckets as a sorted tuple (read once: a generator is fine); ValueError naming a bad one."""
    if buckets is None:
        return None
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise ValueError(f"batch_buckets must be a non-empty list of row counts, got {buckets!r}")
    buckets = list(buckets)
    if not buckets:
        raise ValueError("batch_buckets must be a non-empty list of row counts, got an empty one")
    for b in buckets:
        check_int("a batch bucket", b, 1, max_num_seqs, f"must be between 1 and max_num_seqs={max_num_seqs}")
    return tuple(sorted({int(b) for b in buckets}))


def check_compiler_options(options: dict | None) -> None:
    """ValueError naming an option XLA does not know (found by compiling a one-op program with them)."""
    if options is None:
        return
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"compiler_options must be a dict of XLA option names to values, got {options!r}")
    try:
        jax.jit(lambda x: x).lower(jnp.zeros(1)).compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        raise ValueError(f"compiler_options={options!r}: XLA refused them ({e})") from None


DEFAULT_PREFIX_CACHE_GB = 4.0


def prefix_caching_settings(enabled: bool, block_size: int | None, budget_gb: float | None,
                            max_model_len: int) -> tuple[int, int | None] | None:
    """Checked (block size, byte budget or None: not given) of the prefix store, or None when
    caching is off; the block size and budget are checked either way. A block is a multiple of
    CHUNK tokens no longer than the cache (max_model_len rounded up to CHUNK): a longer one could
    never fill, and the caches are sized to hold whole blocks. Default: 256 on the GPU (or the
    cache's length if shorter), CHUNK elsewhere."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enable_prefix_caching={enabled!r} must be True or False")
    longest = cache_length(max_model_len)
    if block_size is None:
        block_size = min(256, longest) if jax.default_backend() == "gpu" else CHUNK
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not CHUNK <= block_size <= longest \
            or block_size % CHUNK:
        raise ValueError(f"prefix_block_size={block_size!r} must be a positive multiple of {CHUNK} (the GDN chunk) "
                         f"up to {longest} (max_model_len={max_model_len} rounded up to one)")
    if budget_gb is not None and (isinstance(budget_gb, bool) or not isinstance(budget_gb, int | float)
                                  or not 0 < budget_gb < 1e6):
        raise ValueError(f"prefix_cache_gb={budget_gb!r} must be a positive number of gigabytes")
    if not enabled:
        return None
    return block_size, None if budget_gb is None else int(budget_gb * 1e9)


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
      batch_buckets: the batch row counts programs are compiled for; a batch runs padded to the
        smallest that holds it (max_num_seqs always one). Default: powers of two up to max_num_seqs.
        One bucket, [max_num_seqs], compiles once for every batch size, at the cost of padded rows.
      compiler_options: XLA options for every program this LLM compiles, as `jax.jit` takes them,
        e.g. {"xla_backend_optimization_level": 0} to compile faster what runs briefly.
      seed: base seed for requests that do not set their own.
      speculative_config: vLLM's `--speculative-config` (dict or JSON); None runs plain decoding.
      tokenizer: a `tokenizer.json` file, a directory holding one, or a cached HF repo id (default: the
        checkpoint's, if it has one).
      rollback: how GDN state returns to the accepted prefix after a verify pass: "checkpoint"
        (keep the state after every verified token and select) or "replay" (keep the delta-rule
        inputs and re-run the accepted prefix). See BENCHMARKS.md for which is faster.
      tensor_parallel_size: devices to split the target over (a 1-D mesh; heads, MLP and expert
        channels and the vocabulary divided among them, `models/tensor_parallel.py`); the drafters
        are copied whole to each. Must divide the head counts and the MLP width.
      enable_prefix_caching: keep prompt blocks so a prompt that starts like an earlier one resumes
        from the deepest cached block (`spec_jax/engine/prefix_cache.py`); output is bitwise the
        same with and without a hit, for plain decoding and every speculative method.
      prefix_block_size: tokens a cached block (and a prefill pass) holds, a multiple of 64 up to
        max_model_len rounded up to 64 (default 256 on the GPU, where a pass of 256 rows keeps the
        matmuls compute-bound; 64 elsewhere).
      prefix_cache_gb: device memory the prefix store may hold (least recently used blocks go first);
        default: what gpu_memory_utilization leaves beside the batch's caches when it is given, else 4.
      prefix_cache_host_gb: host memory for blocks the device evicts (0: none); a hit there is
        copied back instead of prefilled again.
      batch_invariant: compute the target so that a token's logits are bitwise the same whatever
        shares its pass (decode, verify, prefill, any batch): greedy output with speculation then
        equals plain decoding token for token, in any dtype (`pallas_kernels/batch_invariant.py`).
        Dense models only.
      **kwargs: vLLM's other engine arguments (`engine_args`): `gpu_memory_utilization` sizes
        max_num_seqs to the device memory left for caches, `quantization` checks the checkpoint's
        or ("fp8") quantizes on load; arguments with no counterpart here are accepted and said to
        be ignored; multi-device ones above 1 are refused.
    """

    def __init__(self, model: str | Qwen3_5Model | None = None, *, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 batch_buckets: Sequence[int] | None = None, compiler_options: dict | None = None, seed: int = 0,
                 speculative_config=None, tokenizer: str | None = None, rollback: str = "replay",
                 tensor_parallel_size: int = 1, enable_prefix_caching: bool = False,
                 prefix_block_size: int | None = None, prefix_cache_gb: float | None = None,
                 prefix_cache_host_gb: float = 0.0, batch_invariant: bool = False, **kwargs):
        engine_args = resolve_engine_args(kwargs)
        claim_device_memory(engine_args.gpu_memory_utilization)  # before anything starts the backend
        # make_mesh checks any other value (1.0 or True included) against the devices there are
        self.mesh = None if type(tensor_parallel_size) is int and tensor_parallel_size == 1 else \
            make_mesh(tensor_parallel_size)
        if model is None:
            model = str(default_model_dir())
        if not isinstance(model, Qwen3_5Model):
            model = local_checkpoint(model)  # a path or a cached repo id; anything else is named
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
        asked_seqs = max_num_seqs
        if max_num_seqs is None:  # vLLM's cap when memory sizes the batch; a small default otherwise
            max_num_seqs = MAX_NUM_SEQS_SIZED if engine_args.gpu_memory_utilization else DEFAULT_MAX_NUM_SEQS
        check_int("max_num_seqs", max_num_seqs, 1, 4096, "must be between 1 and 4096")
        batch_buckets = checked_batch_buckets(batch_buckets, max_num_seqs)
        check_compiler_options(compiler_options)
        quantize_to = None if loaded is not None else check_quantization(engine_args.quantization,
                                                                           checkpoint_methods(model))
        check_int("seed", seed, -(2**63), 2**63 - 1, "must fit in 64 bits")
        if max_model_len is not None:
            check_int("max_model_len", max_model_len, 2, INT32_MAX, f"must be from 2 to {INT32_MAX}")
        enable_compilation_cache()
        self.model_path = model
        t0 = time.perf_counter()
        self.model, self.cfg = (loaded, loaded.cfg) if loaded is not None else load_model(model, dtype, mesh=self.mesh)
        if loaded is None:
            log.info("loaded %s (%s, %d layers, %s) in %.1f s; each new batch or prompt size compiles once",
                     model, self.cfg.model_type, self.cfg.num_hidden_layers, dtype, time.perf_counter() - t0)
        if quantize_to is not None:
            quantize_projections(self.model, quantize_to)
        if self.mesh is not None and (loaded is not None or quantize_to is not None):
            shard_model(self.model, self.mesh)  # load_model placed what it loaded; these arrays are new
        limit = self.cfg.max_position_embeddings
        max_model_len = min(DEFAULT_MAX_MODEL_LEN, limit) if max_model_len is None else max_model_len
        if not 2 <= max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be between 2 and the model's limit {limit}")
        self.max_model_len = max_model_len
        self.compiler_options = compiler_options
        self.prefix_caching = prefix_caching_settings(enable_prefix_caching, prefix_block_size, prefix_cache_gb,
                                                      max_model_len)
        if (isinstance(prefix_cache_host_gb, bool) or not isinstance(prefix_cache_host_gb, int | float)
                or not 0 <= prefix_cache_host_gb < 1e6):
            raise ValueError(f"prefix_cache_host_gb={prefix_cache_host_gb!r} must be a number of gigabytes >= 0")
        self.prefix_cache_host_bytes = int(prefix_cache_host_gb * 1e9)
        if not isinstance(batch_invariant, bool):
            raise ValueError(f"batch_invariant={batch_invariant!r} must be True or False")
        self.batch_invariant = batch_invariant
        self._set_speculation(speculative_config, rollback, max_num_seqs, batch_buckets)
        if engine_args.gpu_memory_utilization is not None:
            self._size_batch(engine_args.gpu_memory_utilization, explicit=asked_seqs is not None)
        self._log_memory()
        self.metrics: dict = {}
        if tokenizer:
            tokenizer = local_checkpoint(tokenizer, "tokenizer")  # a file, a directory, or a cached repo id
        tok_path = Path(tokenizer) if tokenizer else Path(model) / "tokenizer.json" if model else None
        if tok_path is not None and tok_path.is_dir():
            tok_path = tok_path / "tokenizer.json"
        self.tokenizer = Tokenizer(tok_path) if tok_path is not None and tok_path.exists() else None
        if tokenizer and self.tokenizer is None:
            raise ValueError(f"tokenizer {tokenizer!r} has no tokenizer.json")
        if not tokenizer and gguf_file is not None:
            self.tokenizer = gguf_tokenizer(gguf_file)  # tokenizer.json beside it, else the GGUF's own vocabulary
        self.seed = seed
        self._requests = 0  # rows started: an unseeded row's seed
        self._request_ids = itertools.count()
        self.lifetime = LifetimeCounters()
        self.generation_defaults = generation_defaults(self.model_path)
        try:
            SamplingParams(**self.generation_defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{Path(self.model_path) / 'generation_config.json'}: {e}") from None

    def _set_speculation(self, speculative_config, rollback: str, max_num_seqs: int,
                         batch_buckets: tuple[int, ...] | None, draft=None) -> None:
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
        store = self._prefix_store(spec)
        plan = None if spec is None else SpecPlan(build_proposer(spec, self.cfg.vocab_size,
                                                                 cache_length(self.max_model_len, store), draft),
                                                  spec.num_speculative_tokens, rollback,
                                                  spec.draft_sample_method == "probabilistic")
        self.engine = Engine(self.model, max_model_len=self.max_model_len, max_num_seqs=max_num_seqs, plan=plan,
                             draft=draft, batch_buckets=batch_buckets, compiler_options=self.compiler_options,
                             mesh=self.mesh, prefix_cache=store, batch_invariant=self.batch_invariant)

    def _prefix_store(self, spec) -> PrefixCache | None:
        """A new, empty prefix store for an engine of this model and speculative config (None when
        prefix caching is off). Its root key names what its blocks depend on."""
        if self.prefix_caching is None:
            return None
        block_size, budget = self.prefix_caching
        budget = int(DEFAULT_PREFIX_CACHE_GB * 1e9) if budget is None else budget
        root = (f"{self.model_path or id(self.model)}|{jnp.dtype(self.model.dtype).name}|{spec!r}|{block_size}|"
                f"invariant={self.batch_invariant}")
        return PrefixCache(root, block_size, budget, self.prefix_cache_host_bytes)

    def _size_batch(self, utilization: float, *, explicit: bool) -> None:
        """vLLM's gpu_memory_utilization: the rows of caches that fit in that share of the device's
        memory beside what is loaded, capped at max_num_seqs; says what it chose."""
        asked = self.engine.max_num_seqs
        stats = device_memory()
        if not stats.get("bytes_limit"):
            log.info("gpu_memory_utilization=%s: the %s device reports no memory limit; max_num_seqs stays %d",
                     utilization, jax.default_backend(), asked)
            return
        row = self._row_bytes()
        budget = utilization * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        fit = int(budget // row)
        if fit < 1:
            raise ValueError(f"gpu_memory_utilization={utilization} leaves {budget / 1e9:.2f} GB beside the "
                             f"{stats.get('bytes_in_use', 0) / 1e9:.2f} GB loaded, less than one row of caches "
                             f"({row / 1e9:.3f} GB at max_model_len {self.max_model_len}); raise it or lower "
                             f"max_model_len")
        chosen = min(asked, fit)
        log.info("gpu_memory_utilization=%s: %.2f GB for caches at %.3f GB a row (max_model_len %d): max_num_seqs %d "
                 "(%s %d)", utilization, budget / 1e9, row / 1e9, self.max_model_len, chosen,
                 "asked" if explicit else "cap", asked)
        self.engine.max_num_seqs = chosen  # before anything compiles: it only bounds the batch buckets
        if self.prefix_caching is not None and self.prefix_caching[1] is None:  # the store takes what is left
            left = max(0, int(budget - chosen * row))
            self.prefix_caching = (self.prefix_caching[0], left)
            self.engine.prefix_cache.budget_bytes = left
            log.info("gpu_memory_utilization=%s: %.2f GB left for the prefix cache", utilization, left / 1e9)

    def _log_memory(self) -> None:
        """Say where the device's memory goes: weights, the batch's caches, the prefix store."""
        stats = device_memory()
        if not stats.get("bytes_limit") or not log.isEnabledFor(logging.INFO):
            return
        weights = sum(x.nbytes for x in self.engine.param_leaves)  # the target's and any drafter's
        row = self._row_bytes()
        store = self.engine.prefix_cache.budget_bytes if self.engine.prefix_cache is not None else 0
        log.info("device memory: %.2f GB the allocator may take; weights (with any drafter) %.2f GB, caches "
                 "%.2f GB (%d rows x %.3f GB at max_model_len %d), prefix store up to %.2f GB", stats["bytes_limit"] / 1e9, weights / 1e9,
                 row * self.engine.max_num_seqs / 1e9, self.engine.max_num_seqs, row / 1e9, self.max_model_len,
                 store / 1e9)

    def _row_bytes(self) -> int:
        """Device bytes a batch row adds: its `DecodeState` and a step's float32 logits, probabilities
        and draws over the k + 1 verified positions."""
        batch = assemble_batch([[0]], [SamplingParams()], [0], rows=1, prompt_len=self.engine.prompt_bucket(1),
                               max_model_len=self.max_model_len, eos=self.cfg.eos_token_id)
        state = self.engine.row_bytes(*batch.inputs(), jnp.asarray(batch.speculate), reference_shape(self.engine, 1))
        k = self.engine.plan.k if self.engine.plan else 0
        return state + 3 * (k + 1) * self.cfg.vocab_size * 4

    def with_speculation(self, speculative_config, *, rollback: str = "replay", draft=None) -> "LLM":
        """The same loaded weights with another speculative config (None: plain decoding), for
        comparing methods without reloading. Compiled executables are per config.

        draft: the method's drafter network already in memory (for example one made on the
        device by `bench.models.random_drafter`), used in place of loading the config's `model`.
        """
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback={rollback!r}; expected one of {', '.join(ROLLBACKS)}")
        other = copy.copy(self)
        other._set_speculation(speculative_config, rollback, self.engine.max_num_seqs, self.engine.batch_buckets,
                               draft)
        other.metrics, other._plain_engine, other.lifetime = {}, None, LifetimeCounters()
        return other

    # ------------------------------------------------------------------ inputs

    def _check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        """`_id_array`'s check, the ids returned as a new list of plain ints (the caller may extend
        its list for the next turn)."""
        return self._id_array(ids, what).tolist()

    def _id_array(self, ids: Sequence[int], what: str) -> np.ndarray:
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
        return self._prompt_ids(prompt, what).tolist()

    def _prompt_ids(self, prompt: str | Sequence[int], what: str) -> np.ndarray:
        """`tokenize`'s ids as the checked array [T] (`_id_array`)."""
        return self._id_array(self._encode(prompt, what) if isinstance(prompt, str) else prompt, what)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Full-sequence target logits: token_ids [T] -> np.ndarray [T, vocab] float32."""
        ids = self._check_ids(token_ids, "token_ids")
        return self.engine.logits(np.asarray(ids, np.int32))

    # ------------------------------------------------------------------ generation

    def _prompts(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        """vLLM's prompt forms -> (text or None, checked ids) each: a string, a {"prompt": text} or
        {"prompt_token_ids": ids} dict, or a list of these; or token-id lists via prompt_token_ids."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts (text, or vLLM's prompt dicts) or prompt_token_ids")
        if prompt_token_ids is not None:
            if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence | np.ndarray):
                raise ValueError(f"prompt_token_ids must be a list of token-id lists, got {prompt_token_ids!r}")
            return [(None, self._check_ids(p, f"prompt_token_ids[{i}]")) for i, p in enumerate(prompt_token_ids)]
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        out = []
        for i, item in enumerate(items):
            what = f"prompt {i}"
            if isinstance(item, dict):
                known = {"prompt", "prompt_token_ids"}
                if len(known & item.keys()) != 1 or item.keys() - known - {"multi_modal_data", "cache_salt"}:
                    raise ValueError(f"{what}: a prompt dict holds one of 'prompt' (text) or 'prompt_token_ids', "
                                     f"got keys {sorted(item)}")
                if item.get("multi_modal_data"):
                    raise ValueError(f"{what}: multi_modal_data is not supported; the models here read text only")
                if "prompt_token_ids" in item:
                    out.append((item.get("prompt"), self._check_ids(item["prompt_token_ids"], what)))
                    continue
                item = item["prompt"]
            out.append((item, self._check_ids(self._encode(item, what), what)))
        return out

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json sampling defaults
        (temperature, top_p, top_k), as vLLM applies when a request brings none."""
        return SamplingParams(**self.generation_defaults)

    def generate(self, prompts=None, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete each prompt: a string, vLLM's {"prompt": ...} / {"prompt_token_ids": [...]} dicts, a
        list of these, or token-id lists through `prompt_token_ids`.

        sampling_params: one for all prompts or one per prompt (default: `get_default_sampling_params()`).
        A request's n completions run as n rows. Rows run in batches of up to max_num_seqs. Returns one
        RequestOutput per prompt, in order.
        """
        requests = self._prompts(prompts, prompt_token_ids)
        params = self._params_per_prompt(sampling_params, len(requests), self.get_default_sampling_params())
        rows = [(r, child) for r, p in enumerate(params) for child in fan_out(p)]
        completions: list = []
        n = self.engine.max_num_seqs
        t0 = time.perf_counter()
        with tqdm(total=len(rows), desc="generating", unit="seq", disable=not use_tqdm or len(rows) < 2) as bar:
            for s in range(0, len(rows), n):
                chunk = rows[s:s + n]
                completions += self._run_batch([requests[r][1] for r, _ in chunk], [p for _, p in chunk])
                bar.update(len(chunk))
        by_request: list[list] = [[] for _ in requests]
        for (owner, _), completion in zip(rows, completions):
            by_request[owner].append(completion)
        outputs = []
        for (text, ids), mine, p in zip(requests, by_request, params):
            for i, (out, _) in enumerate(mine):
                out.index = i
            self._requests += 1
            metrics = mine[0][1] if len(mine) == 1 else {**mine[0][1], **merge_metrics([m for _, m in mine])}
            outputs.append(RequestOutput(str(self._requests - 1), text, ids, [c for c, _ in mine], metrics,
                                         prompt_logprobs=self._prompt_logprobs(ids, p)))
        self.metrics = aggregate_metrics(outputs)
        self.metrics["tokens_per_s"] = self.metrics["num_generated_tokens"] / (time.perf_counter() - t0)
        self.lifetime.add(outputs)
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered with the checkpoint's chat template (or `chat_template`, a Jinja source or
        file), then generated. chat_template_kwargs reach the template (Qwen's enable_thinking)."""
        each = conversations(messages)
        template = self._chat_template(chat_template)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict of template variables, got {chat_template_kwargs!r}")
        extra = {"add_generation_prompt": add_generation_prompt, **(chat_template_kwargs or {})}
        texts = [template.render(c, extra) for c in each]
        return self.generate(texts, sampling_params, use_tqdm=use_tqdm)

    @functools.cached_property
    def checkpoint_chat_template(self) -> ChatTemplate | None:
        """The checkpoint's own chat template, read and compiled once; None if it has none."""
        return ChatTemplate.of_checkpoint(self.model_path) if self.model_path else None

    def _chat_template(self, override: str | None) -> ChatTemplate:
        if override is not None:  # a file, or the template's source itself (it has Jinja's {{ }} or {% %})
            if not isinstance(override, str | os.PathLike):
                raise ValueError(f"chat_template must be Jinja source text or a file, got {override!r}")
            if Path(override).is_file():
                return ChatTemplate.of_checkpoint(self.model_path or "", override)
            if "{{" not in str(override) and "{%" not in str(override):
                raise ValueError(f"chat_template={str(override)!r} is no file and no Jinja source "
                                 f"(which has {{{{ ... }}}} or {{% ... %}})")
            return ChatTemplate(override)
        template = self.checkpoint_chat_template
        if template is None:
            raise ValueError(f"{self.model_path} has no chat template (no chat_template in its tokenizer_config.json, "
                             f"no chat_template.jinja); pass chat_template=, or call generate with the prompt text")
        return template

    def get_tokenizer(self) -> ChatTokenizer:
        """The checkpoint's tokenizer with its chat template (encode, decode, apply_chat_template)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer.json (pass tokenizer= a file or directory)")
        return ChatTokenizer(self.tokenizer, self.checkpoint_chat_template)

    def get_metrics(self) -> list:
        """vLLM's `LLM.get_metrics()`: counters over this LLM's lifetime under vLLM's names
        (`vllm:generation_tokens`, `vllm:spec_decode_num_drafts`, ..., and the per-position
        accepted counts as a `Vector`; with prefix caching `vllm:prefix_cache_queries` and
        `vllm:prefix_cache_hits`, in prompt tokens)."""
        store = self.engine.prefix_cache
        return self.lifetime.metrics(None if store is None else (store.queries, store.hits))

    # ------------------------------------------------------------------ the functional layer

    def prefill(self, prompt_token_ids: Sequence[Sequence[int]],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> DecodeState:
        """The explicit-state entry for notebooks and eval loops: pad up to max_num_seqs prompts
        to their buckets (batch rows and prompt length, powers of two) and prefill them.

        Returns the `DecodeState` pytree (`tokens` [B, L], `lengths` [B], `done` [B], caches,
        proposer state, `stats`); rows past the prompts are padding and start done. Step it with
        `decode`; row i's tokens are `tokens[i, len(prompt_i):lengths[i]]`.
        """
        # checked, as arrays: the batch is assembled from them without converting each id again
        ids = [self._prompt_ids(p, f"prompt_token_ids[{i}]") for i, p in enumerate(prompt_token_ids)]
        if not 1 <= len(ids) <= self.engine.max_num_seqs:
            raise ValueError(f"got {len(ids)} prompts; prefill takes 1 to max_num_seqs={self.engine.max_num_seqs}")
        return self.start_batch(ids, self._params_per_prompt(sampling_params, len(ids), SamplingParams()))[0]

    def _params_per_prompt(self, sampling_params, n: int, default: SamplingParams) -> list[SamplingParams]:
        """One SamplingParams, a list of one per prompt, or None (default) -> n of them, each
        checked against this model (`check_params`)."""
        sampling_params = default if sampling_params is None else sampling_params
        params = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else sampling_params
        if isinstance(params, (str, bytes, dict)) or not isinstance(params, Sequence) or not all(
                isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of one per prompt, got "
                             f"{str(sampling_params)[:80]}")
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts")
        for p in params:
            self.check_params(p)
        return list(params)

    def decode(self, state: DecodeState, steps: int = 1) -> DecodeState:
        """Run up to `steps` jitted (speculative) steps on a `prefill`ed state, on the device,
        stopping early when every row is done. The state is donated: use the returned one."""
        check_int("steps", steps, 1, INT32_MAX, "must be a positive number of steps")
        if not isinstance(state, DecodeState):
            raise ValueError(f"state must be the DecodeState prefill or decode returned, got {type(state).__name__}")
        do_sample = bool(jax.device_get(jnp.any(state.sampling.temperature > 0)))
        return self.engine.decode(state, steps, do_sample)

    def _row_seed(self, p: SamplingParams) -> int:
        self._requests += 1
        return p.seed if p.seed is not None else hash((self.seed, self._requests)) & 0x7FFFFFFF

    def start_batch(self, ids: Sequence[Sequence[int]], params: Sequence[SamplingParams], *,
                    stop_width: int | None = None, do_sample: bool | None = None,
                    processors: frozenset[str] = frozenset(), num_logprobs: int | None = None,
                    rows: int | None = None):
        """Pad a batch of checked prompt ids to the engine's buckets and prefill it (one
        `SamplingParams` a row). Returns (DecodeState, do_sample, each row's stop ids). The
        scheduler fixes stop_width (the stop_ids columns), do_sample, the logit processors carried
        (`RowSampling`'s optional fields, besides those a row uses) and num_logprobs kept per token (default:
        the most any row asks for) so that every row it prefills fits its live batch, and rows (default:
        the batch bucket of len(ids)) to 1 for a request joining it."""
        seeds = [self._row_seed(p) for p in params]
        batch = assemble_batch(ids, params, seeds, rows=rows or self.engine.batch_bucket(len(ids)),
                               prompt_len=self.engine.prompt_bucket(max(len(x) for x in ids)),
                               max_model_len=self.max_model_len, eos=self.cfg.eos_token_id, stop_width=stop_width,
                               vocab_size=self.cfg.vocab_size,
                               bad_words=[self.bad_word_forms(p) for p in params],
                               processors=processors)
        do_sample = batch.do_sample if do_sample is None else do_sample
        reference = proposer_reference(self.engine, batch, self._plain, do_sample)
        if num_logprobs is None:
            num_logprobs = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        state = self.engine.prefill(*batch.inputs(), batch.speculate, reference, do_sample, num_logprobs)
        return state, do_sample, batch.stops

    def bad_word_forms(self, p: SamplingParams) -> list[list[int]]:
        """A request's bad_words as the token sequences vLLM bans: each word with leading spaces
        stripped, and with one space before it when that starts with another token and is as many
        tokens long. Raises ValueError when a form is longer than MAX_BAD_WORD_LENGTH tokens or a
        request has more than MAX_BAD_WORDS forms of several tokens."""
        if not p.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError(f"bad_words need a tokenizer, and {self.model_path} has none; use logit_bias")
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
            raise ValueError(f"stop strings need a tokenizer, and {self.model_path} has none; use stop_token_ids")
        for name, ids in (("logit_bias", [int(t) for t in p.logit_bias or {}]),
                          ("allowed_token_ids", p.allowed_token_ids or []), ("stop_token_ids", p.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        return self.bad_word_forms(p)

    def _plain(self) -> Engine:
        """A plain-decoding engine on the same weights (the oracle's reference run), made once."""
        if getattr(self, "_plain_engine", None) is None:
            self._plain_engine = Engine(self.model, max_model_len=self.max_model_len,
                                        max_num_seqs=self.engine.max_num_seqs, batch_buckets=self.engine.batch_buckets,
                                        compiler_options=self.compiler_options, mesh=self.mesh,
                                        batch_invariant=self.batch_invariant)
        return self._plain_engine

    def _run_batch(self, ids, params) -> list[tuple[CompletionOutput, dict]]:
        """One batch of rows: each row's completion and metrics."""
        t0 = time.perf_counter()
        state, do_sample, stops = self.start_batch(ids, params)
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        state = self.engine.decode(state, self.max_model_len, do_sample)
        out_tokens, out_lengths, stats, steps, logprobs = jax.device_get(
            (state.tokens, state.lengths, state.stats, state.steps, state.logprobs))
        t2 = time.perf_counter()
        results = []
        for i, p in enumerate(params):
            gen = out_tokens[i, len(ids[i]):out_lengths[i]].tolist()
            out = self._completion(gen, p, stops[i])
            if p.logprobs is not None:
                self._attach_logprobs(out, logprobs, i, len(ids[i]), p)
            metrics = request_metrics(len(ids[i]), len(out.token_ids), t1 - t0, t2 - t1, stats, i)
            metrics["batch_decode_steps"] = int(steps)
            results.append((out, metrics))
        return results

    def _attach_logprobs(self, out: CompletionOutput, kept, row: int, start: int, p: SamplingParams) -> None:
        """vLLM's logprobs of a completion from the batch's `EmittedLogprobs` (on the host): per
        token, its own entry and the top `p.logprobs` ones; the cumulative logprob."""
        at = slice(start, start + len(out.token_ids))
        out.logprobs = logprob_entries(out.token_ids, kept.token[row, at], kept.rank[row, at], kept.top_ids[row, at],
                                       kept.top[row, at], p.logprobs, self._token_text if p.detokenize else None)
        out.cumulative_logprob = float(sum(kept.token[row, at]))

    def _prompt_logprobs(self, ids: list[int], p: SamplingParams) -> list | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then each token's entry and the
        top `p.prompt_logprobs` (`logprob_entries`), from the target's raw logits."""
        if p.prompt_logprobs is None:
            return None
        token, rank, top_ids, top = self.engine.prompt_logprobs(np.asarray(ids, np.int32), p.prompt_logprobs)
        return [None] + logprob_entries(ids[1:], token, rank, top_ids, top, p.prompt_logprobs,
                                        self._token_text if p.detokenize else None)

    def _token_text(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token], False)

    def _completion(self, gen: list[int], p: SamplingParams, stop_ids: list[int]) -> CompletionOutput:
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

    def generate_stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                        prompt_token_ids: Sequence[int] | None = None, steps_per_chunk: int = 1):
        """Yield a request's new token ids as they are accepted (the same jitted step as
        `generate`, run `steps_per_chunk` steps per device call). One request at a time."""
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompt (text) or prompt_token_ids")
        if steps_per_chunk < 1:
            raise ValueError(f"steps_per_chunk={steps_per_chunk} must be at least 1")
        ids = self.tokenize(prompt if prompt is not None else prompt_token_ids)
        params = self._params_per_prompt(sampling_params, 1, SamplingParams())
        state, do_sample, _ = self.start_batch([ids], params)
        sent = len(ids)
        while True:
            length, done = (int(x) for x in jax.device_get((state.lengths[0], state.done[0])))
            if length > sent:
                yield jax.device_get(state.tokens[0, sent:length]).tolist()
                sent = length
            if done:
                return
            state = self.engine.decode(state, steps_per_chunk, do_sample)
