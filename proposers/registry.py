"""Which proposer each speculative method runs, built from a parsed speculative config (vLLM's
field names: `method`, `num_speculative_tokens`, `prompt_lookup_min/max`, ...) and the method's
drafter network, if it has one. Loading that network from a checkpoint is
`spec_jax.loading.drafters.load_draft`'s job; here only its config is read.

    proposer = build_proposer(spec, vocab_size, cache_len, draft)
"""

from __future__ import annotations

from typing import Any, Callable

from proposers.combined import CombinedProposer
from proposers.dflash import DFlashProposer
from proposers.dflash2 import DFlash2Proposer
from proposers.draft_model import DraftModelProposer
from proposers.dspark import DSparkProposer
from proposers.eagle3 import Eagle3Proposer
from proposers.mtp import DraftVocabHead, MTPProposer
from proposers.ngram import NgramProposer
from proposers.suffix import SuffixProposer


def _block_drafter(spec, k: int, draft) -> DFlashProposer:
    """DFlash drafts block_size - 1 tokens; DSpark at least block_size (a shorter block drafts wrong tokens)."""
    d = draft.cfg
    if d.method != spec.method:
        raise ValueError(f"{spec.model!r} is a {d.method} drafter, not {spec.method}; set method to {d.method!r}")
    scales = (d.input_embedding_scale, d.output_multiplier, d.final_logit_softcapping)
    if spec.method == "dflash":
        if k != d.block_size - 1:
            raise ValueError(f"num_speculative_tokens={k} but the DFlash drafter {spec.model!r} drafts "
                             f"block_size - 1 = {d.block_size - 1} tokens per block; set num_speculative_tokens "
                             f"to {d.block_size - 1}")
        make = DFlash2Proposer if d.selector_rank else DFlashProposer
        return make(k, d.target_layer_ids, d.mask_token_id, *scales)
    if k < d.block_size:
        raise ValueError(f"num_speculative_tokens={k} is below the DSpark drafter's block_size {d.block_size}; "
                         f"a shorter block drafts wrong tokens, so set it to at least {d.block_size}")
    return DSparkProposer(k, d.target_layer_ids, d.mask_token_id, *scales, sample_from_anchor=d.sample_from_anchor)


def suffix_proposer(spec, k: int) -> SuffixProposer:
    return SuffixProposer(k, spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_spec_factor,
                          spec.suffix_decoding_min_token_prob, spec.suffix_decoding_max_cached_requests,
                          spec.suffix_decoding_cache_tokens)


# method -> (spec, k, draft network, vocab_size, cache_len) -> proposer
BUILDERS: dict[str, Callable[..., Any]] = {
    "ngram": lambda spec, k, draft, V, L: NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max),
    "mtp": lambda spec, k, draft, V, L: MTPProposer(k),
    "draft_model": lambda spec, k, draft, V, L: DraftModelProposer(k, L),
    "eagle3": lambda spec, k, draft, V, L: Eagle3Proposer(k, draft.cfg.target_layer_ids),
    "dflash": lambda spec, k, draft, V, L: _block_drafter(spec, k, draft),
    "dspark": lambda spec, k, draft, V, L: _block_drafter(spec, k, draft),
    "suffix": lambda spec, k, draft, V, L: suffix_proposer(spec, k),
}


def build_proposer(spec, vocab_size: int, cache_len: int, draft=None):
    """The proposer for a parsed speculative config. `draft` is the method's network (loaded, or
    made by `target_drafter`). `enable_suffix_decoding` puts suffix decoding beside it
    (`CombinedProposer`)."""
    if spec.method not in BUILDERS:
        raise ValueError(f"speculative method {spec.method!r} has no proposer; built: {', '.join(BUILDERS)}")
    proposer = BUILDERS[spec.method](spec, spec.num_speculative_tokens, draft, vocab_size, cache_len)
    if spec.enable_suffix_decoding:  # suffix drafts up to the tree depth, the model drafter its own k
        proposer = CombinedProposer(proposer, suffix_proposer(spec, spec.suffix_decoding_max_tree_depth))
    return proposer


def target_drafter(spec, model):
    """A drafter network cut from the target itself, for methods that have one: MTP with a
    reduced draft vocabulary (`DraftVocabHead`); else None."""
    if spec.method == "mtp" and spec.draft_vocab_size is not None:
        return DraftVocabHead(model, spec.draft_vocab_size)
    return None
