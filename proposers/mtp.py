"""MTP drafting: the target's own multi-token-prediction head (`Qwen3_5Model.mtp`), chained for
k > 1 as vLLM does (`chained_head`): draft row p takes (token p+1, the target's post-norm hidden
at p) and predicts token p+2; the chain feeds back the head's post-norm output.

With a reduced draft vocabulary (`DraftVocabHead`, the config's `draft_vocab_size`) the drafts'
logits come from the first n rows of the lm_head, held as an array of their own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.qwen3_5 import Qwen3_5Model, init_mtp_cache
from proposers.chained_head import ChainedHeadProposer


class DraftVocabHead(nnx.Module):
    """The target's lm_head cut to token ids 0..n-1, copied into an array of its own (a slice of
    the full head would be copied out of it every step inside the decode loop)."""

    def __init__(self, model: Qwen3_5Model, n: int):
        V = model.cfg.vocab_size
        if not 1 <= n <= V:
            raise ValueError(f"draft_vocab_size={n} must be between 1 and the model's vocab_size {V}")
        full = model.embed_tokens[...] if model.lm_head is None else model.lm_head.weight[...]
        self.weight = nnx.Param(full[:n])
        self.vocab_size = V

    def __call__(self, hidden: jax.Array) -> jax.Array:
        """Post-norm hidden [..., H] -> float32 logits [..., V], -inf past the first n ids."""
        w = self.weight[...]
        logits = jnp.einsum("...h,vh->...v", hidden.astype(w.dtype), w, preferred_element_type=jnp.float32)
        pad = [(0, 0)] * (logits.ndim - 1) + [(0, self.vocab_size - w.shape[0])]
        return jnp.pad(logits, pad, constant_values=-jnp.inf)


@dataclasses.dataclass(frozen=True)
class MTPProposer(ChainedHeadProposer):
    """`draft` is None (the full lm_head) or a `DraftVocabHead`."""

    def init_cache(self, model, draft, batch, max_len):
        return init_mtp_cache(model.cfg, batch, max_len, model.dtype)

    def embed(self, model, draft, tokens):
        return model.embed(tokens)

    def features(self, model, draft, target):
        return target.hidden

    def head(self, model, draft, embedded, hidden, batch, cache, kv_len):
        return model.mtp(embedded, hidden, batch, cache, kv_len=kv_len)

    def logits(self, model, draft, out):
        return model.logits(out) if draft is None else draft(out)
