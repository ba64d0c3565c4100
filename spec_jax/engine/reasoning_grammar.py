"""Structured output that starts after the reasoning (vLLM's `reasoning_parser` engine argument).

A reasoning model thinks inside `<think>...</think>` before it answers. With a reasoning parser the
request's grammar holds the answer only: the grammar the matcher runs is the request's wrapped in
one that first lets any text through up to the first `</think>`, then the newlines that frame the
block, then the request's own grammar (`after_reasoning`). Being one llguidance grammar, it keeps
speculation exact as any other: drafts are masked per verify position and the matcher advances
over accepted tokens only, across the end of the reasoning too.

Where the output starts is read from the prompt (`reasoning_start`):

* "open": the prompt leaves a `<think>` block open (Qwen3.5/3.6's template with thinking on);
* "closed": its last tag closes one (thinking off: the template writes an empty block), so the
  answer starts at the first token, constrained from there;
* "absent": it has neither tag (Qwen3's older template, where the model opens the block itself),
  so the output may start with a whole `<think>...</think>` block before the answer.
"""

from __future__ import annotations

import json

REASONING_PARSERS = ("qwen3",)
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
STARTS = ("open", "closed", "absent")
ANSWER = "answer"  # the name the request's grammar is referenced by, when it has none


def reasoning_start(prompt: str) -> str:
    """Where a prompt leaves the output: one of `STARTS` (see the module's docstring)."""
    opened, closed = prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)
    if opened < 0 and closed < 0:
        return "absent"
    return "open" if opened > closed else "closed"


def tag(text: str, special: frozenset[str]) -> str:
    """A tag in Lark: the special token's own syntax when the tokenizer holds it as one (its
    bytes are then no text a regex could match), else the text."""
    return text if text in special else json.dumps(text)


def wrapper_lark(start: str, answer: str, special: frozenset[str]) -> str:
    """The Lark grammar of the reasoning before the answer, the subgrammar `@answer`."""
    close, escaped = tag(THINK_CLOSE, special), THINK_CLOSE.replace("/", "\\/")
    if THINK_CLOSE in special:  # the tag's text spelled out is no end, and so kept out of the reasoning
        lines = [f"reasoning: REASONING {close}", f"REASONING: /(?s:.*)/ & ~/(?s:.*){escaped}(?s:.*)/"]
    else:  # lazy: the reasoning ends at the first </think> however the model spells it in tokens
        lines = [f"reasoning[lazy]: /(?s:.*){escaped}/"]
    if start == "open":
        head = "start: reasoning SEP? @" + answer
    else:
        head = f"start: think? @{answer}"
        lines.append(f"think: {tag(THINK_OPEN, special)} reasoning SEP?")
    return "\n".join([head, *lines, "SEP: /\\n+/", ""])


def subgrammars(grammar: str, name: str) -> tuple[list[dict], dict]:
    """A grammar (llguidance's Lark text, or its JSON list of grammars) as the list of grammars it
    is, the first named (`name` unless it has a name), and the list's other fields (max_tokens)."""
    text = grammar.lstrip()
    if text.startswith("{"):
        top = json.loads(text)
        grammars = [dict(g) for g in top["grammars"]]
        rest = {key: value for key, value in top.items() if key != "grammars"}
    else:
        grammars, rest = [{"lark_grammar": grammar}], {}
    grammars[0]["name"] = grammars[0].get("name") or name
    return grammars, rest


def after_reasoning(grammar: str, start: str, special: frozenset[str] = frozenset()) -> str:
    """The llguidance grammar that holds the output to `grammar` once the reasoning has ended, for
    an output that starts as `start` says (one of `STARTS`; "closed": `grammar` itself). special:
    the texts the tokenizer holds as special tokens."""
    if start not in STARTS:
        raise ValueError(f"reasoning start {start!r}; expected one of {', '.join(STARTS)}")
    if start == "closed":
        return grammar
    inner, rest = subgrammars(grammar, ANSWER)
    wrapper = {"lark_grammar": wrapper_lark(start, inner[0]["name"], special)}
    return json.dumps({**rest, "grammars": [wrapper, *inner]})
