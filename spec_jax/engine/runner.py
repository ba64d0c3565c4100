"""The `Runner`: a loaded model (and drafter) with its ahead-of-time compiled programs.

Each program is compiled once per key: its name, the shapes, dtypes and structure of its arguments,
its static arguments (the `SpecPlan` included, so a program never runs under another plan than the
one it was traced with) and, over a mesh, its arguments' shardings. Shapes are bucketed by the
caller (`EngineCore`): batch rows, and prompt length T a power of two from 64 (the GDN chunk) up
to the cache length L, which is fixed per runner (`EngineConfig.cache_len`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import Var
from jax.sharding import Mesh

from pallas_kernels.gdn_chunked import CHUNK
from models.qwen3_5 import ForwardOut, Qwen3_5Config, Qwen3_5Model
from models.tensor_parallel import replicate
from pallas_kernels.batch_invariant import batch_invariant, invariant_tile_rows
from spec_jax.engine.config import EngineConfig
from spec_jax.engine.prefix_cache import PrefixCache
from spec_jax.engine.prefix_programs import prefill_blocks
from spec_jax.engine.state import DecodeState, SpecPlan, insert_row, with_processors
from spec_jax.engine.step import decode_loop, forward_logits, prefill, prompt_logprobs, start_decode

log = logging.getLogger("spec_jax")

# hook(name, call) -> call(): sees each program call (`Runner.watching`).
Hook = Callable[[str, Callable[[], Any]], Any]


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at hi."""
    return min(max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1))))), hi)


def enable_compilation_cache() -> None:
    """Persist compiled executables across processes (override the folder with SPEC_JAX_XLA_CACHE):
    those that took a second or more to compile, unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS
    says otherwise."""
    folder = os.environ.get("SPEC_JAX_XLA_CACHE", os.path.expanduser("~/.cache/spec_jax/xla"))
    jax.config.update("jax_compilation_cache_dir", folder)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


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


def use_layout(networks: Sequence[Any], layout: str) -> None:
    """Put the target (first) and a drafter in `layout` (`EngineConfig.LAYOUTS`), in place."""
    if layout == "rolled":
        return
    target, *drafters = networks
    target.use_decode_layout(fuse=layout == "decode")
    for network in drafters:
        if hasattr(network, "use_decode_layout"):
            network.use_decode_layout()


class Runner:
    """A loaded model plus its ahead-of-time compiled programs (see the module's docstring)."""

    def __init__(self, model: Qwen3_5Model, draft, config: EngineConfig, mesh: Mesh | None = None):
        """draft: the proposer's own network (an NNX model), if its method has one. config: a
        resolved `EngineConfig` (`for_model`); its layout and GDN state dtype are applied to the
        networks, in place.
        mesh: the tensor-parallel mesh the target was sharded over (`models.tensor_parallel`);
        every program is compiled over it and the drafter's weights are copied to each device."""
        use_layout((model, draft), config.layout)
        model.use_state_dtype(config.state_dtype(model.cfg))
        self.cfg: Qwen3_5Config = model.cfg
        self.dtype = model.dtype
        self.cache_len = config.cache_len
        self.compiler_options = config.xla_options
        self.invariant_rows = invariant_tile_rows() if config.batch_invariant else None
        self.mesh = mesh
        self.graphdef, self.params = nnx.split((model, draft))
        if mesh is not None:
            self.params = replicate(self.params, mesh)
        # Programs take the parameters as one flat list: flattening the nnx State (a Variable
        # node per leaf) on every call costs about a millisecond of host time.
        self.param_leaves, self.param_tree = jax.tree.flatten(self.params)
        self.executables = {}
        self.hook: Hook | None = None

    def prompt_bucket(self, n: int) -> int:
        """The prompt length a prompt of n tokens is padded to."""
        return bucket(n, CHUNK, self.cache_len)

    @contextlib.contextmanager
    def watching(self, hook: Hook):
        """Within this block every program call runs as hook(name, call), call() running the
        program and returning its outputs: a benchmark times programs, a test counts them."""
        self.hook = hook
        try:
            yield
        finally:
            self.hook = None

    def run(self, name, fn, *args, static=(), donate=(), options=None):
        """AOT-compile `fn(model, draft, *args)` once per (name, shapes, static) and run it; over a
        mesh, once per shardings too: the same state may come sharded two ways (its processors'
        fields made by `with_processors`, or by a program), and a program runs only the shardings
        it was compiled for. static: everything else `fn` was made with that changes the program
        (the plan, sampling). options: XLA options of this program, under the config's compiler_options."""
        leaves, structure = jax.tree.flatten(args)
        key = (name, structure, tuple((a.shape, a.dtype) for a in leaves), static)
        if self.mesh is not None:
            key += (tuple(getattr(a, "sharding", None) for a in leaves),)
        if key not in self.executables:
            t0 = time.perf_counter()
            self.executables[key] = self._compile(name, fn, args, donate, options)
            log.info("compiled %s for %s in %.1f s", name, describe_shapes(args), time.perf_counter() - t0)
        program, params = self.executables[key]
        call = partial(program, params, *args)
        return call() if self.hook is None else self.hook(name, call)

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

    def state_bytes(self, plan: SpecPlan | None, *inputs) -> int:
        """Device bytes of the `DecodeState` a prefill of these one-row `inputs` (`prefill`'s
        arguments) returns (caches, proposer state, token buffer): what each further batch row
        costs. Traced, not compiled or run."""
        fn = partial(prefill, cache_len=self.cache_len, do_sample=False, plan=plan)
        with self.tracing():
            state = jax.eval_shape(self._on_params(fn), self.param_leaves, *inputs)
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)
                   if hasattr(leaf, "dtype") and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))

    def prefill(self, plan: SpecPlan | None, store: PrefixCache | None, prompts, prompt_lengths, max_lengths,
                stop_ids, sampling, done, speculate, do_sample: bool, num_logprobs: int | None = None,
                grammars=None) -> DecodeState:
        """`prefill` of a batch (its arguments) under `plan`; with a prefix store, block by block per row.
        grammars: the `GrammarRows` of rows whose sampling carries grammar ids."""
        static = (plan, do_sample, num_logprobs, grammars)
        rest = (max_lengths, stop_ids, sampling, done, speculate)
        if store is None:
            fn = partial(prefill, cache_len=self.cache_len, do_sample=do_sample, plan=plan, num_logprobs=num_logprobs,
                         grammars=grammars)
            return self.run("prefill", fn, prompts, prompt_lengths, *rest, static=static)
        cache, last_blocks, hidden, taps, prompts = prefill_blocks(self, plan, store, prompts, prompt_lengths, done)
        start = partial(start_decode, cache_len=self.cache_len, do_sample=do_sample, plan=plan,
                        num_logprobs=num_logprobs, grammars=grammars)

        def fn(model, draft, cache, last_blocks, hidden, taps, prompts, prompt_lengths, *a):
            # a row's last prompt position lies in the last block its prefill ran
            last = last_blocks[jnp.arange(prompts.shape[0]), (prompt_lengths - 1) % last_blocks.shape[1]]
            return start(model, draft, ForwardOut(hidden, cache, taps), last, prompts, prompt_lengths, *a)

        # The caches go in donated: the state takes them over instead of a copy.
        return self.run("start_decode", fn, cache, last_blocks, hidden, taps, prompts, prompt_lengths, *rest,
                        static=static, donate=(0,))

    def decode(self, plan: SpecPlan | None, state: DecodeState, max_steps: int, do_sample: bool,
               grammars=None, step_times=None) -> DecodeState:
        """Up to max_steps steps of `decode_loop` under `plan` on `state` (donated); grammars: the
        `GrammarRows` of rows whose sampling carries grammar ids; step_times [W]: an adaptive plan's
        cost model (`adaptive.StepTimes`), data to the program."""
        fn = partial(decode_loop, do_sample=do_sample, plan=plan, grammars=grammars)
        times = None if step_times is None else jnp.asarray(step_times, jnp.float32)
        return self.run("decode", fn, state, jnp.asarray(max_steps, jnp.int32), times,
                        static=(plan, do_sample, grammars), donate=(0,))

    def insert(self, state: DecodeState, row: int, new: DecodeState) -> DecodeState:
        """Continuous batching: put a one-row prefill `new` into slot `row` of the live `state`
        (donated). One executable per state layout: `new`'s shapes do not depend on the prompt bucket."""
        fn = lambda model, draft, *a: insert_row(*a)  # noqa: E731
        return self.run("insert", fn, state, jnp.asarray(row, jnp.int32), new, donate=(0,))

    def with_processors(self, state: DecodeState, names: frozenset[str], num_logprobs: int | None) -> DecodeState:
        """`with_processors` for this model's vocabulary."""
        return with_processors(state, names, num_logprobs, self.cfg.vocab_size)

    def prompt_logprobs(self, token_ids: np.ndarray, num: int) -> tuple[np.ndarray, ...]:
        """`prompt_logprobs` of a prompt token_ids [T] on the host: arrays for tokens 1..T-1."""
        tokens, length = self._one_row(token_ids)
        out = self.run("prompt_logprobs", partial(prompt_logprobs, num=num), tokens, length, static=(num,))
        return tuple(np.asarray(x[:len(token_ids) - 1]) for x in out)

    def logits(self, token_ids: np.ndarray) -> np.ndarray:
        """Full-sequence target logits: token_ids [T] -> [T, vocab] float32 on the host."""
        tokens, length = self._one_row(token_ids)
        out = self.run("logits", partial(forward_logits, cache_len=tokens.shape[1]), tokens, length)
        return np.asarray(out[0, :len(token_ids)])

    def _one_row(self, token_ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """token_ids [T] as one row padded to its prompt bucket: tokens [1, Tb], length [1]."""
        T = len(token_ids)
        tokens = np.zeros((1, self.prompt_bucket(T)), np.int32)
        tokens[0, :T] = token_ids
        return jnp.asarray(tokens), jnp.asarray([T], jnp.int32)
