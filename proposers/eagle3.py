"""EAGLE-3 drafting (`chained_head`): the head reads three target layers' outputs through `fc`
with the next token, and chains on its own pre-norm output for k > 1, like MTP."""

from __future__ import annotations

import dataclasses

from proposers.chained_head import ChainedHeadProposer


@dataclasses.dataclass(frozen=True)
class Eagle3Proposer(ChainedHeadProposer):
    """taps: the target layers whose outputs the head reads (`ForwardOut.taps`)."""

    taps: tuple[int, ...]

    def init_cache(self, model, draft, batch, max_len):
        return draft.init_cache(batch, max_len, self.k)

    def embed(self, model, draft, tokens):
        return draft.embed(tokens, model.embed)

    def features(self, model, draft, target):
        return draft.fc(target.taps)

    def head(self, model, draft, embedded, hidden, batch, cache, kv_len):
        return draft.run(embedded, hidden, batch, cache, kv_len)

    def logits(self, model, draft, out):
        return draft.logits(out)
