"""vLLM's prompt types (`vllm.inputs`): dicts that `LLM.generate` takes as prompts.

    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3]), TextPrompt(prompt="def f(")])
"""

from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the checkpoint's tokenizer."""

    prompt: str
    multi_modal_data: NotRequired[dict]  # refused when non-empty: the models here read text only
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A prompt as token ids."""

    prompt_token_ids: list[int]
    multi_modal_data: NotRequired[dict]
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
