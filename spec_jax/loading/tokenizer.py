"""A checkpoint's `tokenizer.json`, through HF `tokenizers`."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """Text <-> token ids with the checkpoint's own tokenizer."""

    def __init__(self, path: str | Path):
        try:
            self.hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"cannot read tokenizer {str(path)!r}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
