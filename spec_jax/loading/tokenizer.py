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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """text -> ids (with the tokenizer's post-processor's tokens when add_special_tokens). Through
        encode_batch, which releases the GIL where encode does not: a long prompt tokenized in a
        server's worker thread leaves its event loop serving. Raises ValueError for text that is
        no valid Unicode (a lone UTF-16 surrogate)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text holds {text[e.start:e.end]!r} at character {e.start}, a lone UTF-16 "
                             f"surrogate: send valid Unicode text") from None
        return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
