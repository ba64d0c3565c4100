"""The four stages, each from the corpus (and the target) to trained weights and a log: the target
(`train_target`), the greedy continuations the drafters learn from (`continuations`), the DFlash
drafter (`train_dflash`), the EAGLE-3 head (`train_eagle3`) and the draft model (`train_draft`).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.dflash import DFlashDraft
from models.eagle3 import Eagle3Draft
from models.qwen3 import Qwen3Model
from models.qwen3_5 import Qwen3_5Model
from spec_jax.training.corpus import EOS, KINDS, MASK, Corpus
from spec_jax.training.data import Windows, greedy_continue, heldout_windows
from spec_jax.training.geometry import count_params, dflash_config, draft_config, eagle3_config, target_config
from spec_jax.training.losses import dflash_loss, draft_loss, eagle3_loss, target_loss
from spec_jax.training.loop import Graph, Schedule, fit, log


# ----------------------------------------------------------------------------- target + MTP


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
