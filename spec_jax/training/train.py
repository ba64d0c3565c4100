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
`dflash/`, `eagle3/`, `draft/`), the layout of `spec_jax/assets/default/`. This module is the
command line and the run's order; the stages are in stages.py, their losses in losses.py, the loop
they share in loop.py.

    python -m spec_jax.training.corpus corpus.npz --tokenizer spec_jax/assets/default/tokenizer.json
    python -m spec_jax.training.train --out DIR --corpus corpus.npz --deadline-minutes 8
    python -m spec_jax.training.train --out DIR --corpus c.npz --tiny --max-steps 20   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from spec_jax.training import export
from spec_jax.training.corpus import build_corpus, load_corpus
from spec_jax.training.loop import log
from spec_jax.training.stages import continuations, train_dflash, train_draft, train_eagle3, train_target

STAGES = ("target", "dflash", "eagle3", "draft")


STAGE_OVERHEAD_S = 35  # a stage's compilation, evaluations and export, outside its training budget


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
