"""Log-probabilities in OpenAI's response shapes: chat's `{"content": [...]}`, completions'
`{tokens, token_logprobs, top_logprobs, text_offset}` (with `echo`, the prompt's tokens first, the
first of them without a logprob), and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from spec_jax.engine.params import Logprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM reports this floor instead


def value(entry: Logprob) -> float:
    return max(entry.logprob, LOGPROB_FLOOR)


def top(entry: dict[int, Logprob], num: int, token: int) -> dict[int, Logprob]:
    """An entry cut to its `num` best-ranked tokens and `token`'s own."""
    return {t: x for t, x in entry.items() if t == token or (x.rank is not None and x.rank <= num)}


class LogprobsFormat:
    """A choice's logprobs in OpenAI's shapes. tokenizer: decodes each token's text (None: the
    text is `token_id:N`); num: how many top entries each token shows."""

    def __init__(self, tokenizer, chat: bool, num: int):
        self.tokenizer, self.chat, self.num = tokenizer, chat, num

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token], False) if self.tokenizer is not None else f"token_id:{token}"

    def span(self, token_ids: list[int]) -> int:
        """Characters the tokens' texts take: where the next token's text_offset starts after them."""
        return sum(len(self.text(t)) for t in token_ids)

    def __call__(self, token_ids: list[int], entries: list[dict[int, Logprob] | None], offset: int = 0) -> dict:
        """token_ids with their `logprob_entries` (None for a prompt's first token, which has
        none); offset: where the first token's text starts in the returned text (text_offset)."""
        if self.chat:
            def item(token, entry):
                text = self.text(token)
                return {"token": text, "logprob": value(entry), "bytes": list(text.encode())}

            return {"content": [{**item(t, e[t]), "top_logprobs": [item(u, x) for u, x in sorted(
                e.items(), key=lambda kv: kv[1].rank)[:self.num]]} for t, e in zip(token_ids, entries)]}
        tokens = [self.text(t) for t in token_ids]
        offsets = [offset + sum(map(len, tokens[:j])) for j in range(len(tokens))]
        return {"tokens": tokens,
                "token_logprobs": [None if e is None else value(e[t]) for t, e in zip(token_ids, entries)],
                "top_logprobs": [None if e is None else {self.text(u): value(x) for u, x in top(e, self.num, t).items()}
                                 for t, e in zip(token_ids, entries)],
                "text_offset": offsets}


def prompt_logprobs_json(token_ids: list[int], entries: list[dict[int, Logprob] | None], num: int) -> list:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} with the top `num` and the token's own."""
    return [None if e is None else {str(u): {"logprob": value(x), "rank": x.rank, "decoded_token": x.decoded_token}
                                    for u, x in top(e, num, t).items()} for t, e in zip(token_ids, entries)]
