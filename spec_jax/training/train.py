"""Train the embedded default model, one stage after another, each on a wall-clock budget:

1. target: a Qwen3.5 GDN-hybrid (models/qwen3_5.py, its own forward) trained on the corpus with
   next-token loss plus its MTP head's loss on the token after next, jointly;
2. dflash: a DFlash block drafter distilled from the frozen target: the target greedily continues
   corpus prompts, and the drafter learns to predict those continuations block by block from the
   target's layer taps (so what it learns is what greedy verification accepts);
3. eagle3: an EAGLE-3 head on the same greedy continuations, trained as it drafts (training-time
   test): step 0 reads the target's taps, each later step its own previous output, for
   `--ttt-steps` chained drafts, under the attention mask the chained proposer's cache gives;
4. draft: a small plain Qwen3 for `draft_model`, distilled from the target's next-token
   distribution on the corpus.

Each stage trains until its `--minutes-*` budget is spent (compilation not counted; with
`--deadline-minutes` a stage gets less when the whole run would not end in time), keeps the
weights with the best held-out figure, and is exported at once into --out (target at the top,
`dflash/`, `eagle3/`, `draft/`), the layout of `spec_jax/assets/default/`.

    python -m spec_jax.training.corpus corpus.npz --tokenizer spec_jax/assets/default/tokenizer.json
    python -m spec_jax.training.train --out DIR --corpus corpus.npz --deadline-minutes 8
    python -m spec_jax.training.train --out DIR --corpus c.npz --tiny --max-steps 20   # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.dflash import DFlashDraft
from models.eagle3 import Eagle3Draft
from models.layers import KVCache, attend_masked
from models.qwen3 import Qwen3Model
from models.qwen3_5 import Qwen3_5Model, init_mtp_cache
from spec_jax.training import export
from spec_jax.training.corpus import EOS, KINDS, MASK, Corpus, build_corpus, load_corpus
from spec_jax.training.data import Windows, full_batch, greedy_continue, heldout_windows
from spec_jax.training.geometry import (count_params, dflash_config, draft_config, eagle3_config, init_weights,
                                        target_config)

STAGES = ("target", "dflash", "eagle3", "draft")


STAGE_OVERHEAD_S = 35  # a stage's compilation, evaluations and export, outside its training budget


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


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-position cross entropy: logits [..., V] float32, labels [...] -> [...]."""
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


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


# ----------------------------------------------------------------------------- target + MTP


def target_loss(model: Qwen3_5Model, windows: jax.Array, mtp_weight: float):
    """windows [B, T+1]: next-token loss on positions 0..T-1, plus the MTP head's loss: from the
    hidden state at p and the embedding of token p+1 it predicts token p+2."""
    B, T = windows.shape[0], windows.shape[1] - 1
    x, y = windows[:, :-1], windows[:, 1:]
    hidden = model(x, full_batch(B, T), model.init_cache(B, T), kv_len=T).hidden
    logits = model.logits(hidden)
    ce = cross_entropy(logits, y).mean()
    mtp_cache = init_mtp_cache(model.cfg, B, T - 1, model.dtype)
    mtp_hidden, _ = model.mtp(model.embed(x[:, 1:]), hidden[:, :-1], full_batch(B, T - 1), mtp_cache, kv_len=T - 1)
    mtp_logits = model.logits(mtp_hidden)
    ce_mtp = cross_entropy(mtp_logits, y[:, 1:]).mean()
    # What greedy MTP k=1 acceptance measures: the head's guess for p+2 against the target's at p+1.
    agree = (jnp.argmax(mtp_logits, -1) == jnp.argmax(logits[:, 1:], -1)).mean()
    return ce + mtp_weight * ce_mtp, {"loss": ce, "mtp_loss": ce_mtp, "mtp_agree": agree}


def train_target(corpus: Corpus, args, dtype, key):
    cfg = target_config(corpus.vocab_size, corpus.tokenizer.token_to_id(EOS), tiny=args.tiny)
    model = Graph(lambda dt: Qwen3_5Model(cfg, dtype=dt), dtype)
    params = model.init(args.seed, cfg.num_hidden_layers)
    log(f"[target] {count_params(model.bind(params)) / 1e6:.2f}M parameters")
    T = args.seq_len
    data = {"windows": Windows.from_corpus(corpus, args.prose_fraction),
            "heldout": {k: jnp.asarray(heldout_windows(corpus, k, args.eval_windows, T + 1)) for k in KINDS}}
    sched = Schedule(args.minutes_target, args.batch, args.lr_target, args.warmup, args.max_steps,
                     log_every=args.log_every, eval_every=args.eval_every)

    def loss_fn(params, data, key):
        return target_loss(model.bind(params), data["windows"].sample(key, sched.batch, T + 1), args.mtp_weight)

    def eval_fn(params, data):
        out = {}
        for kind, windows in data["heldout"].items():
            _, m = target_loss(model.bind(params), windows, args.mtp_weight)
            out.update({f"{kind}_{k}": v for k, v in m.items()})
        out["loss"] = sum(out[f"{k}_loss"] for k in KINDS) / len(KINDS)
        return out

    params, history = fit("target", params, loss_fn, eval_fn, data, sched, key, "loss")
    return cfg, params, history


# ----------------------------------------------------------------------------- greedy continuations


def target_continuations(target: Graph, params, prompts: np.ndarray, n_new: int, batch: int):
    """The target's greedy continuations of prompts [N, P], `batch` rows at a time -> [N, P+n_new]."""
    run = jax.jit(lambda p, x: greedy_continue(target.merge(p), x, n_new))
    out = [np.asarray(run(params, jnp.asarray(prompts[s:s + batch]))) for s in range(0, len(prompts), batch)]
    return np.concatenate(out)


@dataclasses.dataclass
class Continuations:
    """What the DFlash and EAGLE-3 drafters learn from: the frozen target (compute dtype), its
    greedy continuations of random corpus prompts (seqs [N, T]) and of held-out prompts
    (heldout [M, T]); the first `prompt_len` tokens of a row are the prompt."""

    target: Graph
    frozen: nnx.State
    seqs: np.ndarray
    heldout: np.ndarray
    prompt_len: int


def continuations(corpus: Corpus, tcfg, tparams, args, dtype, key) -> Continuations:
    target = Graph(lambda dt: Qwen3_5Model(tcfg, dtype=dt), dtype)
    frozen = target.cast(tparams)
    P, T = args.prompt_len, args.seq_len
    if args.prompts:  # drawn from a corpus's training split elsewhere (`corpus --prompts-out`)
        prompts = np.load(args.prompts)[:args.sequences, :P].astype(np.int32)
    else:
        windows = Windows.from_corpus(corpus, args.prose_fraction)
        prompts = np.asarray(jax.jit(Windows.sample, static_argnums=(2, 3))(windows, key, args.sequences, P))
    heldout = np.concatenate([heldout_windows(corpus, k, args.eval_windows, P) for k in KINDS])
    t0 = time.perf_counter()
    seqs = target_continuations(target, frozen, prompts, T - P, args.gen_batch)
    held_seqs = target_continuations(target, frozen, heldout, T - P, args.gen_batch)
    log(f"[continuations] {seqs.shape[0]} + {held_seqs.shape[0]} greedy continuations of {T - P} tokens "
        f"in {time.perf_counter() - t0:.1f}s")
    return Continuations(target, frozen, seqs, held_seqs, P)


# ----------------------------------------------------------------------------- DFlash


def dflash_loss(draft: DFlashDraft, target: Qwen3_5Model, seqs: jax.Array, anchors: jax.Array, gamma: float):
    """seqs [B, T]: target-generated sequences; anchors [B, A]: block starts. Each block is
    [seqs[a], MASK x (bs-1)] at positions a..a+bs-1 over the context of the target's taps at
    positions < a (as at inference), and learns seqs[a+1 .. a+bs-1]; position j's loss weighs
    exp(-(j-1)/gamma) since a draft counts only if every draft before it was accepted."""
    cfg = draft.cfg
    B, T = seqs.shape
    A, bs = anchors.shape[1], cfg.block_size
    out = target(seqs, full_batch(B, T), target.init_cache(B, T), kv_len=T, taps=cfg.target_layer_ids)
    ctx_k, ctx_v = draft.context_kv(out.taps, jnp.broadcast_to(jnp.arange(T), (B, T)))  # [layers, B, T, kv, d]
    positions = (anchors[..., None] + jnp.arange(bs)).reshape(B * A, bs)
    rows = jnp.repeat(jnp.arange(B), A)
    labels = seqs[rows[:, None], positions]  # [B*A, bs]: the anchor token, then the block's targets
    block = labels.at[:, 1:].set(cfg.mask_token_id)
    cache = (KVCache(ctx_k[:, rows], ctx_v[:, rows]),)  # one full-attention run: the drafter trained here
    h = draft.block(target.embed(block), positions, cache, anchors.reshape(-1))
    logits = target.logits(h[:, 1:])
    ce = cross_entropy(logits, labels[:, 1:])  # [B*A, bs-1]
    weights = jnp.exp(-jnp.arange(bs - 1) / gamma)
    correct = jnp.argmax(logits, -1) == labels[:, 1:]
    accepted = jnp.cumprod(correct, axis=1).sum(axis=1)  # drafts a greedy verifier would accept
    return (ce * weights).sum(-1).mean() / weights.sum(), {
        "loss": ce.mean(), "first_acc": correct[:, 0].mean(), "accept_len": 1.0 + accepted.mean()}


def draw_anchors(key, B: int, A: int, prompt_len: int, T: int, bs: int) -> jax.Array:
    """A anchors per row, from the last prompt token on (its block's labels are all generated)."""
    return jax.random.randint(key, (B, A), prompt_len - 1, T - bs + 1)


def train_dflash(corpus: Corpus, tcfg, data: Continuations, args, dtype, key):
    cfg = dflash_config(tcfg, corpus.tokenizer.token_to_id(MASK), tiny=args.tiny)
    draft = Graph(lambda dt: DFlashDraft(cfg, dtype=dt), dtype)
    params = draft.init(args.seed + 1, cfg.num_hidden_layers)
    log(f"[dflash] {count_params(draft.bind(params)) / 1e6:.2f}M parameters (embedding and lm_head shared)")
    P, T, bs = data.prompt_len, args.seq_len, cfg.block_size
    arrays = {"target": data.frozen, "seqs": jnp.asarray(data.seqs), "heldout": jnp.asarray(data.heldout),
              "heldout_anchors": draw_anchors(jax.random.key(1), len(data.heldout), args.anchors, P, T, bs)}
    sched = Schedule(args.minutes_dflash, args.batch_dflash, args.lr_dflash, args.warmup, args.max_steps,
                     log_every=args.log_every, eval_every=args.eval_every)

    def loss_fn(params, arrays, key):
        k_rows, k_anchors = jax.random.split(key)
        rows = jax.random.randint(k_rows, (sched.batch,), 0, arrays["seqs"].shape[0])
        anchors = draw_anchors(k_anchors, sched.batch, args.anchors, P, T, bs)
        return dflash_loss(draft.bind(params), data.target.merge(arrays["target"]), arrays["seqs"][rows], anchors,
                           args.gamma)

    def eval_fn(params, arrays):
        return dflash_loss(draft.bind(params), data.target.merge(arrays["target"]), arrays["heldout"],
                           arrays["heldout_anchors"], args.gamma)[1]

    params, history = fit("dflash", params, loss_fn, eval_fn, arrays, sched, key, "accept_len", higher_is_better=True)
    return cfg, params, history


# ----------------------------------------------------------------------------- EAGLE-3


def draft_vocabulary(seqs: np.ndarray, prompt_len: int, size: int, vocab_size: int) -> np.ndarray:
    """The `size` target ids the target emits most often in its continuations, ascending (a
    sorted table keeps d2t's offsets monotone and every draft id's target id distinct)."""
    counts = np.bincount(seqs[:, prompt_len:].ravel(), minlength=vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[:size]).astype(np.int64)


def ttt_mask(T: int, step: int) -> jax.Array:
    """Which keys a step-`step` query at row p sees, over the keys of steps 0..step ([T, (step+1) T]):
    the chained proposer's cache at that draft holds the target-fed rows up to p - step and, in the
    slots after them, the K/V each earlier chained step wrote, its own last (slot p)."""
    p = jnp.arange(T)[:, None]
    q = jnp.arange(T)[None, :]
    blocks = [q <= p - step] + [q == p - step + i for i in range(1, step + 1)]
    return jnp.concatenate(blocks, axis=1)


def eagle3_steps(draft: Eagle3Draft, target: Qwen3_5Model, seqs: jax.Array, steps: int):
    """The head run as it drafts, on seqs [B, T]. Row p reads token p+1 and predicts token p+2;
    step 0 reads fc(the target's taps at p), step j > 0 the head's own step j-1 output at row
    p-1, as the proposer chains. Returns the pre-norm outputs of every step [steps, B, T, H]."""
    cfg, layer = draft.cfg, draft.layers[0]
    B, T = seqs.shape
    taps = target(seqs, full_batch(B, T), target.init_cache(B, T), kv_len=T, taps=cfg.target_layer_ids).taps
    next_tokens = jnp.pad(seqs[:, 1:], ((0, 0), (0, 1)))
    embedded = layer.input_layernorm(draft.embed(next_tokens, target.embed).astype(draft.dtype))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    hidden = draft.fc(taps.astype(draft.dtype))
    keys, values, outs = [], [], []
    for j in range(steps):
        normed = layer.hidden_norm(hidden)
        residual = normed if cfg.norm_before_residual else hidden
        q, _, k, v = layer.self_attn.project_heads(jnp.concatenate([embedded, normed], axis=-1), positions)
        keys.append(k)
        values.append(v)
        visible = jnp.broadcast_to(ttt_mask(T, j), (B, T, (j + 1) * T))
        o = attend_masked(q, jnp.concatenate(keys, axis=1), jnp.concatenate(values, axis=1), visible)
        h = residual + layer.self_attn.output(o, None)
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(out)
        hidden = jnp.pad(out[:, :-1], ((0, 0), (1, 0), (0, 0)))  # row p chains on row p-1's output
    return jnp.stack(outs)


def eagle3_loss(draft: Eagle3Draft, target: Qwen3_5Model, seqs: jax.Array, t2d: jax.Array, prompt_len: int,
                steps: int, decay: float):
    """Cross entropy of every step's draft-vocabulary logits against the greedy token p+2 (mapped
    by t2d [V] to a draft id, -1 off the draft vocabulary: such rows cannot be drafted and are
    left out), over rows whose label was generated; step j weighs decay**j. accept_len: from a
    row p, the drafts a greedy verifier accepts of the chain step 0 at p, step 1 at p+1, ..."""
    B, T = seqs.shape
    outs = eagle3_steps(draft, target, seqs, steps)
    logits = draft.lm_head(draft.norm(outs)).astype(jnp.float32)  # [steps, B, T, Vd]
    labels = jnp.pad(seqs[:, 2:], ((0, 0), (0, 2)))  # row p: token p+2
    draft_labels = t2d[labels]
    rows = jnp.arange(T)
    ce = cross_entropy(logits, jnp.broadcast_to(jnp.maximum(draft_labels, 0), logits.shape[:-1]))  # [steps, B, T]
    losses, correct = [], []
    for j in range(steps):
        valid = (rows >= max(j, prompt_len - 2)) & (rows < T - 2)  # a chain, and a generated label
        counted = valid[None] & (draft_labels >= 0)
        losses.append((ce[j] * counted).sum() / jnp.maximum(counted.sum(), 1))
        hit = (jnp.argmax(logits[j], -1) == draft_labels) & valid[None]
        correct.append(jnp.pad(hit[:, j:], ((0, 0), (0, j))))  # aligned to the chain's start row
    weights = decay ** jnp.arange(steps)
    correct = jnp.stack(correct, axis=-1)  # [B, T, steps]: chain from row p, step j right
    starts = (rows >= prompt_len - 2) & (rows < T - 2 - steps)
    accepted = jnp.cumprod(correct, axis=-1).sum(-1)
    metrics = {f"acc_{j}": (correct[..., j] * starts).sum() / (B * starts.sum()) for j in range(steps)}
    metrics["accept_len"] = 1.0 + (accepted * starts).sum() / (B * starts.sum())
    loss = (jnp.stack(losses) * weights).sum() / weights.sum()
    return loss, {"loss": loss, **metrics}


def train_eagle3(corpus: Corpus, tcfg, data: Continuations, args, dtype, key):
    ids = draft_vocabulary(data.seqs, data.prompt_len, args.eagle3_vocab, tcfg.vocab_size)
    cfg = eagle3_config(tcfg, len(ids), tiny=args.tiny)
    t2d = np.full((tcfg.vocab_size,), -1, np.int32)
    t2d[ids] = np.arange(len(ids))
    draft = Graph(lambda dt: Eagle3Draft(cfg, dtype=dt), dtype, frozen=nnx.PathContains("d2t"))
    params = draft.init(args.seed + 3, 1)
    log(f"[eagle3] {count_params(draft.bind(params)) / 1e6:.2f}M parameters (embedding shared); draft vocabulary "
        f"{len(ids)} ids cover {np.isin(data.seqs[:, data.prompt_len:], ids).mean():.3f} of generated tokens")
    arrays = {"target": data.frozen, "seqs": jnp.asarray(data.seqs), "heldout": jnp.asarray(data.heldout),
              "t2d": jnp.asarray(t2d)}
    sched = Schedule(args.minutes_eagle3, args.batch_eagle3, args.lr_eagle3, args.warmup, args.max_steps,
                     log_every=args.log_every, eval_every=args.eval_every)

    def loss_fn(params, arrays, key):
        rows = jax.random.randint(key, (sched.batch,), 0, arrays["seqs"].shape[0])
        return eagle3_loss(draft.bind(params), data.target.merge(arrays["target"]), arrays["seqs"][rows],
                           arrays["t2d"], data.prompt_len, args.ttt_steps, args.ttt_decay)

    def eval_fn(params, arrays):
        return eagle3_loss(draft.bind(params), data.target.merge(arrays["target"]), arrays["heldout"], arrays["t2d"],
                           data.prompt_len, args.ttt_steps, args.ttt_decay)[1]

    params, history = fit("eagle3", params, loss_fn, eval_fn, arrays, sched, key, "accept_len", higher_is_better=True)
    return cfg, params, ids - np.arange(len(ids)), history


# ----------------------------------------------------------------------------- draft model


def draft_loss(draft: Qwen3Model, target: Qwen3_5Model, windows: jax.Array):
    """Distillation: cross entropy of the draft against the target's next-token distribution."""
    B, T = windows.shape
    batch = full_batch(B, T)
    t_hidden = target(windows, batch, target.init_cache(B, T), kv_len=T).hidden
    t_logits = target.logits(t_hidden)
    d_hidden = draft(windows, batch, draft.init_cache(B, T), kv_len=T).hidden
    d_logits = draft.logits(d_hidden)
    loss = -(jax.nn.softmax(t_logits) * jax.nn.log_softmax(d_logits)).sum(-1).mean()
    agree = (jnp.argmax(d_logits, -1) == jnp.argmax(t_logits, -1)).mean()
    return loss, {"loss": loss, "agree": agree}


def train_draft(corpus: Corpus, tcfg, tparams, args, dtype, key):
    cfg = draft_config(corpus.vocab_size, corpus.tokenizer.token_to_id(EOS), tiny=args.tiny)
    target = Graph(lambda dt: Qwen3_5Model(tcfg, dtype=dt), dtype)
    draft = Graph(lambda dt: Qwen3Model(cfg, dtype=dt), dtype)
    params = draft.init(args.seed + 2, cfg.num_hidden_layers)
    log(f"[draft] {count_params(draft.bind(params)) / 1e6:.2f}M parameters")
    T = args.seq_len
    data = {"target": target.cast(tparams), "windows": Windows.from_corpus(corpus, args.prose_fraction),
            "heldout": jnp.asarray(np.concatenate([heldout_windows(corpus, k, args.eval_windows, T) for k in KINDS]))}
    sched = Schedule(args.minutes_draft, args.batch, args.lr_draft, args.warmup, args.max_steps,
                     log_every=args.log_every, eval_every=args.eval_every)

    def loss_fn(params, data, key):
        return draft_loss(draft.bind(params), target.merge(data["target"]), data["windows"].sample(key, sched.batch, T))

    def eval_fn(params, data):
        return draft_loss(draft.bind(params), target.merge(data["target"]), data["heldout"])[1]

    params, history = fit("draft", params, loss_fn, eval_fn, data, sched, key, "loss")
    return cfg, params, history


# ----------------------------------------------------------------------------- command line


def load_target(model_dir: str):
    """An exported target as float32 masters: (cfg, params)."""
    from spec_jax.loading import load_model

    model, cfg = load_model(model_dir, "float32")
    return cfg, nnx.state(model)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m spec_jax.training.train", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="export directory (target, dflash/, eagle3/, draft/)")
    ap.add_argument("--corpus", required=True, help="tokenized corpus .npz (built here when missing)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary when the corpus is built")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json for a corpus built here (else a BPE is trained)")
    ap.add_argument("--tiny", action="store_true", help="tiny geometries and corpus (CPU smoke runs)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    ap.add_argument("--target-from", default=None, help="skip target training: use this exported target")
    ap.add_argument("--minutes-target", type=float, default=4.5)
    ap.add_argument("--minutes-dflash", type=float, default=1.3)
    ap.add_argument("--minutes-eagle3", type=float, default=0.6)
    ap.add_argument("--minutes-draft", type=float, default=0.35)
    ap.add_argument("--deadline-minutes", type=float, default=None,
                    help="the whole run's wall-clock limit: a stage's budget shrinks to leave the later stages theirs")
    ap.add_argument("--max-steps", type=int, default=None, help="cap every stage's steps (tests)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="compute dtype (masters are float32); auto: bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64, help="sequences per step (target and draft)")
    ap.add_argument("--batch-dflash", type=int, default=32, help="generated sequences per DFlash step")
    ap.add_argument("--batch-eagle3", type=int, default=32, help="generated sequences per EAGLE-3 step")
    ap.add_argument("--anchors", type=int, default=16, help="DFlash blocks per sequence per step")
    ap.add_argument("--prompt-len", type=int, default=64, help="corpus prompt the target continues for the drafters")
    ap.add_argument("--sequences", type=int, default=12288, help="greedy continuations the drafters train on")
    ap.add_argument("--prompts", default=None,
                    help="an .npy of [N, >= prompt-len] training prompts to continue, instead of the corpus's windows")
    ap.add_argument("--gen-batch", type=int, default=4096)
    ap.add_argument("--lr-target", type=float, default=2e-3)
    ap.add_argument("--lr-dflash", type=float, default=1e-3)
    ap.add_argument("--lr-eagle3", type=float, default=1e-3)
    ap.add_argument("--lr-draft", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--gamma", type=float, default=4.0, help="DFlash loss decay over block positions")
    ap.add_argument("--ttt-steps", type=int, default=3, help="EAGLE-3 chained drafts trained (training-time test)")
    ap.add_argument("--ttt-decay", type=float, default=0.8, help="EAGLE-3 loss weight decay per chained step")
    ap.add_argument("--eagle3-vocab", type=int, default=2048, help="EAGLE-3 draft vocabulary (most emitted ids)")
    ap.add_argument("--prose-fraction", type=float, default=0.25, help="share of windows drawn from prose")
    ap.add_argument("--eval-windows", type=int, default=32, help="held-out windows per kind")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    if ap.parse_known_args(argv)[0].tiny:  # tiny defaults; flags given still win
        ap.set_defaults(vocab=512, seq_len=64, prompt_len=16, batch=4, batch_dflash=4, batch_eagle3=4, anchors=4,
                        sequences=16, gen_batch=16, eagle3_vocab=128, eval_windows=4, warmup=5, log_every=10,
                        eval_every=10)
    args = ap.parse_args(argv)
    bad = set(args.stages.split(",")) - set(STAGES)
    if bad:
        ap.error(f"--stages has unknown stage {sorted(bad)[0]!r}; expected some of {', '.join(STAGES)}")
    if not 0 < args.prompt_len < args.seq_len - 8:
        ap.error(f"--prompt-len {args.prompt_len} must be positive and leave room for a block before --seq-len "
                 f"{args.seq_len}")
    return args


def fit_deadline(args, stages: list[str], started: float) -> None:
    """With --deadline-minutes, shrink the next stage's `minutes_<stage>` so that it and every
    stage after it (budget plus STAGE_OVERHEAD_S each) still end before the deadline."""
    if args.deadline_minutes is None or not stages:
        return
    left_s = 60 * args.deadline_minutes - (time.perf_counter() - started)
    later_s = sum(60 * getattr(args, f"minutes_{s}") + STAGE_OVERHEAD_S for s in stages[1:])
    name = f"minutes_{stages[0]}"
    fits = max(0.1, (left_s - later_s - STAGE_OVERHEAD_S) / 60)
    if fits < getattr(args, name):
        log(f"[deadline] {stages[0]}: {getattr(args, name):.2f} -> {fits:.2f} minutes")
        setattr(args, name, fits)


def main(argv=None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    stages = [s for s in STAGES if s in args.stages.split(",")]
    out = Path(args.out)
    corpus_path = Path(args.corpus)
    if corpus_path.exists():
        corpus = load_corpus(corpus_path)
    else:  # before JAX starts its threads: the corpus is read by forked workers
        log(f"building the corpus into {corpus_path} ...")
        tok_json = Path(args.tokenizer).read_text() if args.tokenizer else None
        corpus = build_corpus(corpus_path, args.vocab, 200_000 if args.tiny else None, tok_json)
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}.get(
        args.dtype, jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
    log(f"devices: {jax.devices()}; compute dtype {jnp.dtype(dtype).name}")
    log("corpus: " + ", ".join(f"{k} {s} {len(a):,}" for (k, s), a in corpus.streams.items()) + " tokens")
    key = jax.random.key(args.seed)
    report = {"args": vars(args), "device": jax.devices()[0].device_kind}
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "training_log.json"  # a later run of some stages updates the earlier run's log
    earlier = json.loads(log_path.read_text()) if log_path.exists() else {}

    def exported(stage: str, path: Path) -> None:  # the log is rewritten after every stage: a killed run keeps it
        log_path.write_text(json.dumps({**earlier, **report}, indent=1, default=str) + "\n")
        log(f"exported the {stage} to {path}")

    if args.target_from:
        tcfg, tparams = load_target(args.target_from)
    elif "target" in stages:
        fit_deadline(args, stages, started)
        tcfg, tparams, report["target"] = train_target(corpus, args, dtype, jax.random.fold_in(key, 0))
        exported("target", export.export_target(out, tcfg, tparams, corpus.tokenizer_json))
    else:
        tcfg, tparams = load_target(str(out))
    drafters = [s for s in stages if s in ("dflash", "eagle3")]
    data = continuations(corpus, tcfg, tparams, args, dtype, jax.random.fold_in(key, 4)) if drafters else None
    if "dflash" in stages:
        fit_deadline(args, stages[stages.index("dflash"):], started)
        cfg, params, report["dflash"] = train_dflash(corpus, tcfg, data, args, dtype, jax.random.fold_in(key, 1))
        exported("DFlash drafter", export.export_dflash(out / "dflash", cfg, params))
    if "eagle3" in stages:
        fit_deadline(args, stages[stages.index("eagle3"):], started)
        cfg, params, d2t, report["eagle3"] = train_eagle3(corpus, tcfg, data, args, dtype, jax.random.fold_in(key, 3))
        exported("EAGLE-3 head", export.export_eagle3(out / "eagle3", cfg, params, d2t))
    if "draft" in stages:
        fit_deadline(args, stages[stages.index("draft"):], started)
        cfg, params, report["draft"] = train_draft(corpus, tcfg, tparams, args, dtype, jax.random.fold_in(key, 2))
        exported("draft model", export.export_draft(out / "draft", cfg, params))
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    log(f"export: {sum(sizes.values()) / 1e6:.1f} MB in {len(sizes)} files, largest "
        f"{max(sizes.values()) / 1e6:.1f} MB; {time.perf_counter() - started:.0f}s in all")

if __name__ == "__main__":
    main()
