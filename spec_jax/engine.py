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

import dataclasses
import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.qwen3_5 import CHUNK, Batch, Qwen3_5Config, Qwen3_5Model, init_cache
from spec_jax.sampling import RowSampling, sample_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The decode state of B rows.

    tokens: [B, L] int32 prompt then generated tokens. lengths: [B] tokens in `tokens`; the
    caches hold the first lengths - 1 of them (the newest token is fed by the next step).
    prompt_lengths, max_lengths: [B] (a row stops when lengths reaches max_lengths).
    done: [B] bool. stop_ids: [B, S] int32 (-1 pads). sampling: per-row `RowSampling`.
    cache: the model's `ModelCache`. steps: [] int32 decode steps run so far.
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


def append_tokens(state: DecodeState, new: jax.Array, cache) -> DecodeState:
    """Write one new token per live row, then update stop conditions. new: [B] int32."""
    live = ~state.done
    rows = jnp.arange(new.shape[0])
    tokens = state.tokens.at[rows, state.lengths].set(jnp.where(live, new, state.tokens[rows, state.lengths]), mode="drop")
    lengths = state.lengths + live.astype(jnp.int32)
    stopped = jnp.any(new[:, None] == state.stop_ids, axis=-1) | (lengths >= state.max_lengths)
    return dataclasses.replace(state, tokens=tokens, lengths=lengths, done=state.done | (live & stopped), cache=cache)


def prefill(model: Qwen3_5Model, prompts, prompt_lengths, max_lengths, stop_ids, sampling: RowSampling, done,
            *, cache_len: int, do_sample: bool) -> DecodeState:
    """Run the prompts and sample each row's first token.

    prompts: [B, T] int32, right-padded; prompt_lengths: [B] (>= 1); max_lengths: [B];
    stop_ids: [B, S]; done: [B] bool (True for padding rows of the batch bucket).
    Returns the `DecodeState` with the caches holding each prompt.
    """
    B, T = prompts.shape
    cache = init_cache(model.cfg, B, cache_len, model.dtype)
    batch = Batch(start=jnp.zeros((B,), jnp.int32), n_valid=prompt_lengths)
    hidden, cache = model(prompts, batch, cache, kv_len=T)
    last = hidden[jnp.arange(B), prompt_lengths - 1]
    first = sample_tokens(model.logits(last), sampling, prompt_lengths, do_sample=do_sample)
    tokens = jnp.zeros((B, cache_len), jnp.int32).at[:, :T].set(prompts)
    state = DecodeState(tokens, prompt_lengths, prompt_lengths, max_lengths, done, stop_ids, sampling, cache,
                        jnp.zeros((), jnp.int32))
    return append_tokens(state, first, cache)


def decode_step(model: Qwen3_5Model, state: DecodeState, *, do_sample: bool) -> DecodeState:
    """Feed each live row's newest token and sample the next one."""
    B, L = state.tokens.shape
    rows = jnp.arange(B)
    newest = state.tokens[rows, state.lengths - 1][:, None]
    batch = Batch(start=state.lengths - 1, n_valid=(~state.done).astype(jnp.int32))
    hidden, cache = model(newest, batch, state.cache, kv_len=L)
    nxt = sample_tokens(model.logits(hidden[:, 0]), state.sampling, state.lengths, do_sample=do_sample)
    state = append_tokens(state, nxt, cache)
    return dataclasses.replace(state, steps=state.steps + 1)


def decode_loop(model: Qwen3_5Model, state: DecodeState, max_steps, *, do_sample: bool) -> DecodeState:
    """`decode_step` in a `lax.while_loop` until every row is done or `max_steps` more steps ran.
    max_steps is a traced scalar, so streaming in chunks reuses one executable."""
    stop_at = state.steps + max_steps

    def cond(s):
        return jnp.any(~s.done) & (s.steps < stop_at)

    return jax.lax.while_loop(cond, partial(decode_step, model, do_sample=do_sample), state)


def forward_logits(model: Qwen3_5Model, tokens, length, *, cache_len: int):
    """Full-sequence logits of one right-padded sequence: tokens [1, T], length [1] -> [1, T, V]."""
    cache = init_cache(model.cfg, 1, cache_len, model.dtype)
    batch = Batch(start=jnp.zeros((1,), jnp.int32), n_valid=length)
    hidden, _ = model(tokens, batch, cache, kv_len=tokens.shape[1])
    return model.logits(hidden)


# ----------------------------------------------------------------------------- compilation


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at hi."""
    return min(max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1))))), hi)


def enable_compilation_cache() -> None:
    """Persist compiled executables across processes (override the folder with SPEC_JAX_XLA_CACHE)."""
    folder = os.environ.get("SPEC_JAX_XLA_CACHE", os.path.expanduser("~/.cache/spec_jax/xla"))
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


class Engine:
    """A loaded model plus its ahead-of-time compiled executables, keyed by shape bucket."""

    def __init__(self, model: Qwen3_5Model, *, max_model_len: int, max_num_seqs: int):
        self.cfg: Qwen3_5Config = model.cfg
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.cache_len = -(-max_model_len // CHUNK) * CHUNK
        self.graphdef, self.params = nnx.split(model)
        self.executables = {}

    def batch_bucket(self, n: int) -> int:
        return bucket(n, 1, self.max_num_seqs)

    def prompt_bucket(self, n: int) -> int:
        return bucket(n, CHUNK, self.cache_len)

    def _compiled(self, name, fn, *args, static=(), donate=()):
        """AOT-compile `fn(model, *args)` once per (name, shapes, static) and run it."""
        shapes = tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args))
        key = (name, shapes, static)
        if key not in self.executables:
            graphdef = self.graphdef

            def run(params, *a):
                return fn(nnx.merge(graphdef, params), *a)

            jitted = jax.jit(run, donate_argnums=tuple(i + 1 for i in donate))
            self.executables[key] = jitted.lower(self.params, *args).compile()
        return self.executables[key](self.params, *args)

    def prefill(self, prompts, prompt_lengths, max_lengths, stop_ids, sampling, done, do_sample: bool) -> DecodeState:
        fn = partial(prefill, cache_len=self.cache_len, do_sample=do_sample)
        return self._compiled("prefill", fn, prompts, prompt_lengths, max_lengths, stop_ids, sampling, done,
                              static=(do_sample,))

    def decode(self, state: DecodeState, max_steps: int, do_sample: bool) -> DecodeState:
        fn = partial(decode_loop, do_sample=do_sample)
        return self._compiled("decode", fn, state, jnp.asarray(max_steps, jnp.int32), static=(do_sample,), donate=(0,))

    def logits(self, token_ids: np.ndarray) -> np.ndarray:
        T = len(token_ids)
        Tb = self.prompt_bucket(T)
        tokens = np.zeros((1, Tb), np.int32)
        tokens[0, :T] = token_ids
        fn = partial(forward_logits, cache_len=Tb)
        out = self._compiled("logits", fn, jnp.asarray(tokens), jnp.asarray([T], jnp.int32))
        return np.asarray(out[0, :T])
