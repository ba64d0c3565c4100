"""The training loop every stage shares: its `Schedule` (AdamW's learning rate over a wall-clock
budget), `Graph` (float32 master weights run in the compute dtype, some parameters frozen) and `fit`,
which trains until the schedule ends and keeps the weights with the best held-out figure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from spec_jax.training.geometry import init_weights


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How one stage trains: AdamW at peak `lr` after `warmup` steps, cosine-decayed to a tenth
    over the time budget (or max_steps, whichever ends first)."""

    minutes: float
    batch: int
    lr: float
    warmup: int
    max_steps: int | None = None
    weight_decay: float = 0.1
    log_every: int = 50
    eval_every: int = 250

    def lr_at(self, step: int, elapsed_s: float) -> float:
        frac = elapsed_s / (60 * self.minutes) if self.minutes else 0.0
        if self.max_steps:
            frac = max(frac, step / self.max_steps)
        return self.lr * min(1.0, (step + 1) / self.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))

    def done(self, step: int, elapsed_s: float) -> bool:
        return (self.max_steps is not None and step >= self.max_steps) or elapsed_s >= 60 * self.minutes


class Graph:
    """A model's graph in the compute dtype, run from float32 master weights: `bind(params)`
    casts each master to its parameter's compute dtype (norms, A_log and dt_bias stay float32,
    as the model declares them) and merges. make(dtype) builds the module. Parameters matching
    `frozen` (an nnx filter) are not trained: they keep the values `init` gave them."""

    def __init__(self, make, dtype, frozen=nnx.Nothing):
        self.make = make
        self.trainable = nnx.All(nnx.Param, nnx.Not(frozen))
        self.graphdef, self.shapes, self.fixed = nnx.split(nnx.eval_shape(lambda: make(dtype)), self.trainable, ...)

    def init(self, seed: int, num_layers: int):
        """Fresh float32 master weights (see `init_weights`)."""
        _, params, self.fixed = nnx.split(init_weights(self.make(jnp.float32), seed, num_layers), self.trainable, ...)
        return params

    def cast(self, params):
        return jax.tree.map(lambda p, s: p.astype(s.dtype), params, self.shapes)

    def merge(self, cast_params):
        """The module from parameters already in the compute dtype (a frozen model's)."""
        return nnx.merge(self.graphdef, cast_params, self.fixed)

    def bind(self, params):
        return self.merge(self.cast(params))


def log(msg: str) -> None:
    print(msg, flush=True)


def decay_mask(params):
    """Weight decay on matrices only: not on norms, A_log, dt_bias or the conv taps."""
    def keep(path, _):
        names = [str(getattr(k, "key", "")) for k in path]
        return not any("norm" in n for n in names) and names[-2] not in ("A_log", "dt_bias", "conv1d")
    return jax.tree_util.tree_map_with_path(keep, params)


def fit(name: str, params, loss_fn, eval_fn, data, sched: Schedule, key, score_key: str, higher_is_better=False):
    """Train `params` with AdamW on loss_fn(params, data, key) -> (loss, metrics) until the
    schedule ends; eval_fn(params, data) -> metrics every `eval_every` steps. Returns the weights
    with the best metrics[score_key] and a log dict."""
    opt = optax.inject_hyperparams(lambda learning_rate: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=sched.weight_decay, mask=decay_mask(params))))(
        learning_rate=sched.lr)
    opt_state = opt.init(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, data, key, lr):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, data, key)
        opt_state.hyperparams["learning_rate"] = lr
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    evaluate = jax.jit(eval_fn)
    sign = -1.0 if higher_is_better else 1.0
    best, best_score, history = None, math.inf, []

    def run_eval(i, elapsed):
        nonlocal best, best_score
        m = {k: float(v) for k, v in evaluate(params, data).items()}
        history.append({"step": i, "s": round(elapsed, 1), **m})
        if sign * m[score_key] < best_score:
            best, best_score = jax.tree.map(jnp.copy, params), sign * m[score_key]
        log(f"[{name}] eval step {i}: " + " ".join(f"{k} {v:.4f}" for k, v in m.items()))

    t_compile = time.perf_counter()
    run_eval(0, 0.0)  # the untrained baseline
    i, t0, elapsed = 0, None, 0.0
    while not sched.done(i, elapsed):
        key, sub = jax.random.split(key)
        params, opt_state, metrics = step(params, opt_state, data, sub, jnp.float32(sched.lr_at(i, elapsed)))
        i += 1
        if t0 is None:  # the first step compiled: the budget starts now
            jax.block_until_ready(metrics)
            t0 = time.perf_counter()
            log(f"[{name}] compiled and evaluated in {t0 - t_compile:.1f}s")
        elapsed = time.perf_counter() - t0
        if i % sched.log_every == 0:
            m = {k: float(v) for k, v in metrics.items()}
            elapsed = time.perf_counter() - t0
            log(f"[{name}] step {i} {elapsed:.0f}s lr {sched.lr_at(i, elapsed):.2e} "
                + " ".join(f"{k} {v:.4f}" for k, v in m.items()) + f" ({i / max(elapsed, 1e-9):.1f} steps/s)")
        if i % sched.eval_every == 0:
            run_eval(i, elapsed)
    if not history or history[-1]["step"] != i:
        run_eval(i, elapsed)
    best_entry = min(history, key=lambda h: sign * h[score_key])
    log(f"[{name}] {i} steps in {elapsed:.0f}s; keeping step {best_entry['step']} "
        f"({score_key} {best_entry[score_key]:.4f})")
    return best, {"steps": i, "train_s": round(elapsed, 1), "best": best_entry, "evals": history}
