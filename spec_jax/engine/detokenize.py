"""Token ids to text with stop strings, as vLLM cuts completions: a finished completion cut at its
first stop string (`cut_at_stop_string`), and a streamed one sent in safe increments (`TextDelta`).
`tokenizer`: anything with `decode(ids, skip_special_tokens)`."""

from __future__ import annotations


class TextDelta:
    """Turns one choice's token ids into text increments: holds back an incomplete UTF-8
    character and anything that could still become a stop string; cuts at a stop string."""

    def __init__(self, tokenizer, skip_special_tokens: bool, stops: list[str]):
        self.tokenizer, self.skip, self.stops = tokenizer, skip_special_tokens, stops
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False
        self.reason: str | None = None  # the stop string found
        self.kept: int | None = None  # once stopped: how many of ids the completion keeps

    def add(self, ids: list[int], final: bool) -> str:
        """Append ids; return the new text that is safe to send (all of it when final)."""
        self.ids += ids
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, self.skip)
        found = first_stop(text, self.stops, max(0, self.sent - max((len(s) for s in self.stops), default=0) + 1))
        if found is not None:
            self.kept = ids_through(self.tokenizer, self.ids, found[0] + len(found[1]), self.skip)
            text, self.stopped, self.reason, final = text[:found[0]], True, found[1], True
        safe = len(text) if final else len(text) - max((len(s) - 1 for s in self.stops), default=0)
        if not final and text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent:safe], safe
        return out


def first_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """(where, which) of the earliest stop string in text[start:] (the longest one at a tie), or None."""
    hits = [(i, -len(s), s) for s in stops if (i := text.find(s, start)) >= 0]
    return (min(hits)[0], min(hits)[2]) if hits else None


def cut_at_stop_string(tokenizer, ids: list[int], stops: list[str], skip_special_tokens: bool,
                       include_stop_str: bool) -> tuple[str, list[int], str | None]:
    """A finished completion cut at its first stop string, as vLLM returns it: (text, token ids, the
    stop string or None). The text ends before the stop string (or after it with include_stop_str);
    the ids end with the token that completed it."""
    text = tokenizer.decode(ids, skip_special_tokens)
    found = first_stop(text, stops)
    if found is None:
        return text, ids, None
    at, stop = found
    return (text[:at + len(stop) if include_stop_str else at], ids[:ids_through(tokenizer, ids, at + len(stop),
                                                                                skip_special_tokens)], stop)


def ids_through(tokenizer, ids: list[int], end: int, skip_special_tokens: bool) -> int:
    """The fewest of ids whose text reaches `end` characters (those that complete a stop string
    ending there): a binary search over decoded prefixes."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid], skip_special_tokens)) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo
