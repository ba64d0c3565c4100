"""The offline API, shaped like vLLM's: `LLM` turns vLLM's argument forms into an `EngineConfig`,
loads the checkpoint and drives an `EngineCore` (its request and result types are in
`spec_jax.engine.params`).

    llm = LLM(model="path/to/checkpoint", dtype="bfloat16", max_model_len=4096, max_num_seqs=8)
    outs = llm.generate(["prompt"], SamplingParams(max_tokens=64, temperature=0.0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text, outs[0].metrics
    llm.logits([1, 2, 3])  # np.ndarray [T, vocab]
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from models.qwen3_5 import Qwen3_5Model
from models.tensor_parallel import make_mesh, shard_model
from spec_jax.api.chat import ChatTemplate, ChatTokenizer, conversations, tokenizer_config
from spec_jax.api.engine_args import check_quantization, checkpoint_methods
from spec_jax.api.engine_args import resolve as resolve_engine_args
from spec_jax.default_model import default_model_dir
from spec_jax.engine.config import EngineConfig
from spec_jax.engine.core import start_engine
from spec_jax.engine.memory import claim_device_memory
from spec_jax.engine.metrics import LifetimeCounters, aggregate_metrics, merge_metrics
from spec_jax.engine.params import (INT32_MAX, RequestOutput, SamplingParams, check_int, fan_out,
                                    generation_defaults)
from spec_jax.engine.runner import enable_compilation_cache
from spec_jax.engine.spec_config import NEEDS_MODEL, SpeculativeConfig, parse_speculative_config
from spec_jax.engine.state import DecodeState
from spec_jax.loading import load_model
from spec_jax.loading.drafters import load_draft
from spec_jax.loading.gguf import find_gguf, gguf_tokenizer
from spec_jax.loading.hub import local_checkpoint
from spec_jax.loading.quantized import quantize_projections
from spec_jax.loading.source import resolve_dtype
from spec_jax.loading.tokenizer import Tokenizer

log = logging.getLogger("spec_jax")

DEFAULT_MAX_NUM_SEQS = 8
MAX_NUM_SEQS_SIZED = 256  # vLLM's default max_num_seqs: the cap when gpu_memory_utilization sizes the batch


def bucket_list(buckets) -> tuple[int, ...] | None:
    """batch_buckets as a tuple (read once: a generator is fine); ValueError unless it is a
    non-empty list (each bucket is checked by `EngineConfig`)."""
    if buckets is None:
        return None
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise ValueError(f"batch_buckets must be a non-empty list of row counts, got {buckets!r}")
    buckets = tuple(buckets)
    if not buckets:
        raise ValueError("batch_buckets must be a non-empty list of row counts, got an empty one")
    return buckets


def option_pairs(options: dict | None) -> tuple[tuple[str, object], ...]:
    """compiler_options, a dict of XLA option names to values, as the config's pairs."""
    if options is None:
        return ()
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"compiler_options must be a dict of XLA option names to values, got {options!r}")
    return tuple(options.items())


def gigabytes(name: str, value, *, positive: bool) -> int | None:
    """A size in GB (vLLM's unit) as bytes; None stays None. ValueError naming `name` unless a
    number, positive (or >= 0), below a million."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value if positive else 0 <= value) \
            or not value < 1e6:
        rule = "a positive number of gigabytes" if positive else "a number of gigabytes >= 0"
        raise ValueError(f"{name}={value!r} must be {rule}")
    return int(value * 1e9)


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
        are copied whole to each. Must divide the head counts and the MLP width; a multiple of the KV
        (or GDN key) heads above their count copies them (`models/head_copies.py`).
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
      layout: how the networks hold their layers (`spec_jax.engine.config.LAYOUTS`): "decode", "unfused"
        or "rolled"; default "decode" on the GPU, "rolled" elsewhere.
      batch_invariant: compute the target so that a token's logits are bitwise the same whatever
        shares its pass (decode, verify, prefill, any batch): greedy output with speculation then
        equals plain decoding token for token, in any dtype (`pallas_kernels/batch_invariant.py`),
        dense and MoE models alike.
      grammar_drafts: with structured outputs, draft the tokens a grammar forces (and EOS once it
        ended) where the proposer has none or drafted a forbidden one; False only to measure what
        that gives (`bench.structured`).
      **kwargs: vLLM's other engine arguments (`engine_args`): `gpu_memory_utilization` sizes
        max_num_seqs to the device memory left for caches, `quantization` checks the checkpoint's
        or ("fp8") quantizes on load; arguments with no counterpart here are accepted and said to
        be ignored; multi-device ones above 1 are refused; `reasoning_parser` ("qwen3") holds
        structured output to the answer, after the reasoning (`spec_jax.engine.reasoning_grammar`);
        `mamba_ssm_cache_dtype` ("auto", "float32", "bfloat16", "float16") is the dtype the GDN
        state is cached in (`EngineConfig`).
    """

    def __init__(self, model: str | Qwen3_5Model | None = None, *, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int | None = None,
                 batch_buckets: Sequence[int] | None = None, compiler_options: dict | None = None, seed: int = 0,
                 speculative_config=None, tokenizer: str | None = None, rollback: str = "replay",
                 tensor_parallel_size: int = 1, enable_prefix_caching: bool = False,
                 prefix_block_size: int | None = None, prefix_cache_gb: float | None = None,
                 prefix_cache_host_gb: float = 0.0, layout: str | None = None, batch_invariant: bool = False,
                 grammar_drafts: bool = True, **kwargs):
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
        spec = parse_speculative_config(speculative_config, target_model=model)  # fail fast, before loading
        gguf_file = find_gguf(model) if model is not None else None
        if gguf_file is not None and spec is not None and spec.method == "dspark":
            raise ValueError(f"speculative method 'dspark' needs a safetensors target, not the GGUF file {model!r}")
        if max_num_seqs is None:  # vLLM's cap when memory sizes the batch; a small default otherwise
            max_num_seqs = MAX_NUM_SEQS_SIZED if engine_args.gpu_memory_utilization else DEFAULT_MAX_NUM_SEQS
        config = EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, batch_buckets=bucket_list(batch_buckets),
            compiler_options=option_pairs(compiler_options), layout=layout,
            tensor_parallel_size=1 if self.mesh is None else self.mesh.size,
            enable_prefix_caching=enable_prefix_caching, prefix_block_size=prefix_block_size,
            prefix_cache_bytes=gigabytes("prefix_cache_gb", prefix_cache_gb, positive=True),
            prefix_cache_host_bytes=gigabytes("prefix_cache_host_gb", prefix_cache_host_gb, positive=False),
            batch_invariant=batch_invariant, rollback=rollback, speculative=spec, seed=seed,
            gpu_memory_utilization=engine_args.gpu_memory_utilization, grammar_drafts=grammar_drafts,
            reasoning_parser=engine_args.reasoning_parser, mamba_ssm_cache_dtype=engine_args.mamba_ssm_cache_dtype)
        quantize_to = None if loaded is not None else check_quantization(engine_args.quantization,
                                                                           checkpoint_methods(model))
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
            self.cfg = self.model.cfg  # with the heads it copied for the mesh
        tokenizer = self._tokenizer(tokenizer, gguf_file)
        self.engine = start_engine(self.model, config, draft=self._draft(spec), tokenizer=tokenizer,
                                   name=self.model_path, mesh=self.mesh)
        self.metrics: dict = {}
        self.lifetime = LifetimeCounters()
        self.generation_defaults = generation_defaults(self.model_path)
        try:
            SamplingParams(**self.generation_defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{Path(self.model_path) / 'generation_config.json'}: {e}") from None

    def _tokenizer(self, given: str | None, gguf_file) -> Tokenizer | None:
        """The tokenizer `given` (a file, a directory, or a cached repo id), else the checkpoint's
        tokenizer.json, else a GGUF's own vocabulary; None when there is none."""
        if given:
            given = local_checkpoint(given, "tokenizer")
        path = Path(given) if given else Path(self.model_path) / "tokenizer.json" if self.model_path else None
        if path is not None and path.is_dir():
            path = path / "tokenizer.json"
        found = Tokenizer(path) if path is not None and path.exists() else None
        if given and found is None:
            raise ValueError(f"tokenizer {given!r} has no tokenizer.json")
        if not given and gguf_file is not None:
            return gguf_tokenizer(gguf_file)  # tokenizer.json beside it, else the GGUF's own vocabulary
        return found

    def _draft(self, spec: SpeculativeConfig | None, draft=None):
        """The method's drafter network: `draft` (one already in memory), else loaded from its
        checkpoint when the method has one; None for methods that draft without one (or cut theirs
        from the target: `proposers.registry.target_drafter`)."""
        if draft is not None and (spec is None or spec.method not in NEEDS_MODEL):
            raise ValueError(f"a draft network was given but speculative method "
                             f"{spec.method if spec else None!r} runs none; methods with one: {', '.join(NEEDS_MODEL)}")
        if draft is None and spec is not None and spec.method in NEEDS_MODEL:
            draft = load_draft(spec, self.cfg, self.model.dtype)
        return draft

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """vLLM's `LLM.set_tokenizer`: this LLM encodes and decodes with `tokenizer` (anything with
        encode / decode) from now on; a copy of it made before keeps the old one."""
        self.engine = self.engine.with_tokenizer(tokenizer)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        return self.engine.config.speculative

    def with_speculation(self, speculative_config, *, rollback: str = "replay", draft=None) -> "LLM":
        """The same loaded weights with another speculative config (None: plain decoding), for
        comparing methods without reloading. Compiled executables are per config, except that a
        config which changes only the synthetic acceptance rates keeps this LLM's drafter, proposer
        and programs (`EngineCore.with_rates`: the rates are data).

        draft: the method's drafter network already in memory (for example one made on the
        device by `bench.models.random_drafter`), used in place of loading the config's `model`.
        A proposer of one's own goes in the config's `proposer` field (`SpeculativeConfig`).
        """
        spec = parse_speculative_config(speculative_config, target_model=self.model_path,
                                        target_has_mtp=self.model.mtp is not None)
        other = copy.copy(self)
        if draft is None and self.engine.keeps_step(spec, rollback):
            other.engine = self.engine.with_rates(spec)
        else:
            other.engine = self.engine.with_speculation(spec, rollback, draft=self._draft(spec, draft))
        other.metrics, other.lifetime = {}, LifetimeCounters()
        return other

    # ------------------------------------------------------------------ inputs

    def _check_ids(self, ids: Sequence[int], what: str) -> list[int]:
        """`EngineCore.check_ids`, the ids returned as a new list of plain ints (the caller may
        extend its list for the next turn)."""
        return self.engine.check_ids(ids, what).tolist()

    def _encode(self, prompt: str, what: str) -> list[int]:
        return self.engine.encode(prompt, what)

    def tokenize(self, prompt: str | Sequence[int], what: str = "prompt") -> list[int]:
        """A prompt's token ids, checked: text through the checkpoint's tokenizer, ids as given.
        Raises ValueError naming `what` for an empty prompt, an id outside the vocabulary, or a
        prompt that leaves no room for a generated token under max_model_len."""
        return self.engine.prompt_ids(prompt, what).tolist()

    def check_params(self, p: SamplingParams) -> list[list[int]]:
        """`EngineCore.check_params`: ValueError naming a field this model cannot take."""
        return self.engine.check_params(p)

    def bad_word_forms(self, p: SamplingParams) -> list[list[int]]:
        """`EngineCore.bad_word_forms`: a request's bad_words as the token sequences vLLM bans."""
        return self.engine.bad_word_forms(p)

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
                completions += self.engine.run_batch([requests[r][1] for r, _ in chunk], [p for _, p in chunk])
                bar.update(len(chunk))
        by_request: list[list] = [[] for _ in requests]
        for (owner, _), completion in zip(rows, completions):
            by_request[owner].append(completion)
        outputs = []
        for (text, ids), mine, p in zip(requests, by_request, params):
            for i, (out, _) in enumerate(mine):
                out.index = i
            request_id = self.engine.next_request()
            metrics = mine[0][1] if len(mine) == 1 else {**mine[0][1], **merge_metrics([m for _, m in mine])}
            outputs.append(RequestOutput(str(request_id), text, ids, [c for c, _ in mine], metrics,
                                         prompt_logprobs=self.engine.prompt_logprobs(ids, p),
                                         num_cached_tokens=mine[0][1]["num_cached_tokens"]))
        self.metrics = aggregate_metrics(outputs)
        self.metrics["tokens_per_s"] = self.metrics["num_generated_tokens"] / (time.perf_counter() - t0)
        self.lifetime.add(outputs)
        return outputs

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered with the checkpoint's chat template (or `chat_template`, a Jinja source or
        file), then generated. chat_template_kwargs reach the template (Qwen's enable_thinking), as
        do `tools`; continue_final_message: the prompt ends inside the last message, for the model
        to continue it (add_generation_prompt must then be False)."""
        each = conversations(messages)
        template = self._chat_template(chat_template)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict of template variables, got {chat_template_kwargs!r}")
        extra = {"add_generation_prompt": add_generation_prompt, **({"tools": tools} if tools is not None else {}),
                 **(chat_template_kwargs or {})}
        texts = [template.render(c, extra, continue_final_message) for c in each]
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
        """The checkpoint's tokenizer with its chat template, answering HF's common calls
        (`ChatTokenizer`); one given to `set_tokenizer` is returned as given, as vLLM does."""
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer.json (pass tokenizer= a file or directory)")
        if not isinstance(self.tokenizer, Tokenizer):
            return self.tokenizer
        return ChatTokenizer(self.tokenizer, self.checkpoint_chat_template,
                             tokenizer_config(self.model_path) if self.model_path else {})

    def reset_prefix_cache(self) -> bool:
        """vLLM's `LLM.reset_prefix_cache()`: forget every cached prefix block (the lifetime
        counters stay). False when prefix caching is off."""
        return self.engine.reset_prefix_cache()

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
        ids = [self.engine.prompt_ids(p, f"prompt_token_ids[{i}]") for i, p in enumerate(prompt_token_ids)]
        if not 1 <= len(ids) <= self.engine.max_num_seqs:
            raise ValueError(f"got {len(ids)} prompts; prefill takes 1 to max_num_seqs={self.engine.max_num_seqs}")
        return self.engine.start(ids, self._params_per_prompt(sampling_params, len(ids), SamplingParams()))[0]

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
        state, do_sample, _ = self.engine.start([ids], params)
        held, sent = self.engine.grammar_ids(state), len(ids)
        try:
            while True:
                length, done = (int(x) for x in jax.device_get((state.lengths[0], state.done[0])))
                if length > sent:
                    yield jax.device_get(state.tokens[0, sent:length]).tolist()
                    sent = length
                if done:
                    return
                state = self.engine.decode(state, steps_per_chunk, do_sample)
        finally:
            self.engine.release(held)  # its grammar's matcher, if it has one
