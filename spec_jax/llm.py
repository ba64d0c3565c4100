"""The offline API, shaped like vLLM's: `LLM`, `SamplingParams`, `RequestOutput`.

    llm = LLM(model="path/to/checkpoint", dtype="bfloat16", max_model_len=4096, max_num_seqs=8)
    outs = llm.generate(["prompt"], SamplingParams(max_tokens=64, temperature=0.0))
    outs[0].outputs[0].token_ids, outs[0].outputs[0].text, outs[0].metrics
    llm.logits([1, 2, 3])  # np.ndarray [T, vocab]
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from spec_jax.checkpoint import load_model, resolve_dtype
from spec_jax.engine import Engine, enable_compilation_cache
from spec_jax.sampling import RowSampling
from spec_jax.tokenizer import Tokenizer

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

    def __post_init__(self):
        if self.n != 1:
            raise ValueError(f"n={self.n}: only n=1 (one completion per prompt) is supported")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 or 0 (off) or a positive count")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens={self.max_tokens} must be a positive number of tokens (or None)")


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
      model: checkpoint directory (HF safetensors); None runs the embedded default model.
      dtype: "bfloat16", "float32" or "auto" (bfloat16 on GPU, float32 on CPU).
      max_model_len: the longest prompt + completion (default 4096, or the model's limit if lower);
        it sizes the KV cache.
      max_num_seqs: batch rows per step; more prompts run in several batches.
      seed: base seed for requests that do not set their own.
      speculative_config: vLLM's `--speculative-config` (dict or JSON); None runs plain decoding.
      tokenizer: a `tokenizer.json` path (default: the checkpoint's, if it has one).
    """

    def __init__(self, model: str | None = None, *, dtype: str = "auto", max_model_len: int | None = None,
                 max_num_seqs: int = 8, seed: int = 0, speculative_config=None, tokenizer: str | None = None):
        if model is None:
            from spec_jax.default_model import default_model_dir
            model = str(default_model_dir())
        if dtype == "auto":
            dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
        resolve_dtype(dtype)
        if speculative_config is not None:
            raise ValueError("speculative_config is not supported yet; pass None for plain decoding")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be at least 1")
        enable_compilation_cache()
        self.model_path = model
        self.model, self.cfg = load_model(model, dtype)
        limit = self.cfg.max_position_embeddings
        max_model_len = max_model_len or min(DEFAULT_MAX_MODEL_LEN, limit)
        if not 2 <= max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be between 2 and the model's limit {limit}")
        self.max_model_len = max_model_len
        self.engine = Engine(self.model, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
        tok_path = Path(tokenizer) if tokenizer else Path(model) / "tokenizer.json"
        self.tokenizer = Tokenizer(tok_path) if tok_path.exists() else None
        if tokenizer and self.tokenizer is None:
            raise ValueError(f"tokenizer file {tokenizer!r} does not exist")
        self.seed = seed
        self._requests = 0

    # ------------------------------------------------------------------ inputs

    def _check_ids(self, ids: Sequence[int], what: str) -> list[int]:
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
            ids = [self._check_ids(p, f"prompt_token_ids[{i}]") for i, p in enumerate(prompt_token_ids)]
            prompts = [None] * len(ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(ids) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} sampling_params for {len(ids)} prompts")
        outputs = []
        n = self.engine.max_num_seqs
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
            for s in range(0, len(ids), n):
                outputs += self._run_batch(prompts[s:s + n], ids[s:s + n], params[s:s + n])
                bar.update(len(ids[s:s + n]))
        return outputs

    def _row_seed(self, p: SamplingParams) -> int:
        self._requests += 1
        return p.seed if p.seed is not None else hash((self.seed, self._requests)) & 0x7FFFFFFF

    def _run_batch(self, prompts, ids, params) -> list[RequestOutput]:
        n = len(ids)
        B = self.engine.batch_bucket(n)
        T = self.engine.prompt_bucket(max(len(x) for x in ids))
        tokens = np.zeros((B, T), np.int32)
        lengths = np.ones((B,), np.int32)
        max_lengths = np.full((B,), 2, np.int32)
        eos = list(self.cfg.eos_token_id)
        stops = [list(p.stop_token_ids or []) + ([] if p.ignore_eos else eos) for p in params]
        stop_ids = np.full((B, max(1, max(len(s) for s in stops))), -1, np.int32)
        for i, (x, p, st) in enumerate(zip(ids, params, stops)):
            tokens[i, :len(x)] = x
            lengths[i] = len(x)
            budget = p.max_tokens if p.max_tokens is not None else self.max_model_len
            max_lengths[i] = min(len(x) + budget, self.max_model_len)
            stop_ids[i, :len(st)] = st
        done = np.arange(B) >= n  # padding rows of the bucket never run
        temperature = np.zeros((B,), np.float32)
        temperature[:n] = [p.temperature for p in params]
        top_k = np.zeros((B,), np.int32)
        top_k[:n] = [max(p.top_k, 0) for p in params]
        top_p = np.ones((B,), np.float32)
        top_p[:n] = [p.top_p for p in params]
        keys = jax.random.split(jax.random.key(0), B)
        keys = keys.at[:n].set(jnp.stack([jax.random.key(self._row_seed(p)) for p in params]))
        sampling = RowSampling(jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p), keys)
        do_sample = bool((temperature > 0).any())

        t0 = time.perf_counter()
        state = self.engine.prefill(jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(max_lengths),
                                    jnp.asarray(stop_ids), sampling, jnp.asarray(done), do_sample)
        jax.block_until_ready(state.tokens)
        t1 = time.perf_counter()
        state = self.engine.decode(state, self.max_model_len, do_sample)
        out_tokens, out_lengths = jax.device_get((state.tokens, state.lengths))
        t2 = time.perf_counter()

        results = []
        for i in range(n):
            gen = out_tokens[i, lengths[i]:out_lengths[i]].tolist()
            finish = "stop" if gen and gen[-1] in stops[i] else "length"
            text = self.tokenizer.decode(gen, params[i].skip_special_tokens) if self.tokenizer else ""
            decode_s = t2 - t1
            metrics = {
                "num_prompt_tokens": len(ids[i]), "num_generated_tokens": len(gen),
                "prefill_s": t1 - t0, "decode_s": decode_s,
                "tpot_s": decode_s / max(len(gen) - 1, 1),
                "tokens_per_s": len(gen) / max(t2 - t0, 1e-9),
            }
            results.append(RequestOutput(str(self._requests - n + i), prompts[i], ids[i],
                                         [CompletionOutput(0, text, gen, finish)], metrics))
        return results
