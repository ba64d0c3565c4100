"""Each stage's loss, from a batch to (loss, metrics): the target's next-token and MTP loss
(`target_loss`), the DFlash drafter's block loss over the target's taps (`dflash_loss`), the EAGLE-3
head's chained training-time-test loss (`eagle3_steps`, `eagle3_loss`) and the draft model's
distillation (`draft_loss`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.dflash import DFlashDraft
from models.eagle3 import Eagle3Draft
from models.layers import KVCache, attend_masked
from models.qwen3 import Qwen3Model
from models.qwen3_5 import Qwen3_5Model, init_mtp_cache
from spec_jax.training.data import full_batch


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-position cross entropy: logits [..., V] float32, labels [...] -> [...]."""
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked



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
