"""Reasoning kept apart from the answer: vLLM's `--reasoning-parser qwen3`.

Qwen3.5/3.6 think inside `<think>...</think>`. Their chat template opens the block in the prompt
(`<|im_start|>assistant\\n<think>\\n`) unless `enable_thinking` is false, so the output holds only
the closing tag; Qwen3's older template lets the model write both. `ReasoningSplitter` reads the
generated text as it arrives and hands back what is reasoning and what is the answer, holding back
only text that may still turn out to be a tag. The newlines that frame the block belong to the
template (it writes them back when the turn is rendered again), so they are in neither part.
"""

from __future__ import annotations

import re

from spec_jax.engine.reasoning_grammar import THINK_CLOSE, THINK_OPEN, reasoning_start

# Qwen3.5/3.6 may start a tool call without closing the thought first: a <tool_call> followed by a
# <function=...> header ends the reasoning, and the call is the answer's.
TOOL_CALL_OPEN, FUNCTION_OPEN = "<tool_call>", "<function="


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a `<think>` block open, so the output starts in reasoning."""
    return reasoning_start(prompt) == "open"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Generated text -> (reasoning, content), fed piece by piece: `feed` returns the parts it can
    already tell, `finish` the rest. Feeding the whole text at once gives what any split gives.

    in_reasoning: the prompt opened the block (`prompt_opens_reasoning`). Either way a leading
    `<think>` in the output opens it (the older template)."""

    def __init__(self, in_reasoning: bool):
        self.state = "start"
        self.default_reasoning = in_reasoning
        self.buffer = ""
        self.strip_newlines = True  # at the start of the reasoning, and of the answer after </think>

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while True:
            if self.state == "start" and not self._start(final):
                break
            if self.state == "reasoning":
                said, done = self._reasoning(final)
                reasoning += said
                if not done:
                    break
            if self.state == "content":
                content += self._content()
                break
        return reasoning, content

    def _start(self, final: bool) -> bool:
        """Before any output: an opening tag (after blank space) starts reasoning; otherwise the
        prompt decides. False while the start may still be a tag."""
        head = self.buffer.lstrip()
        if head.startswith(THINK_OPEN):
            self.buffer, self.state = head[len(THINK_OPEN):], "reasoning"
            return True
        if THINK_OPEN.startswith(head) and not final:
            return False
        self.state = "reasoning" if self.default_reasoning else "content"
        if self.state == "content":
            self.strip_newlines = False  # the answer's own leading text: nothing framed it
        return True

    def _reasoning(self, final: bool) -> tuple[str, bool]:
        """Reasoning text up to the block's end (True once the answer starts), holding back a
        possible tag and the newlines that may frame the end."""
        if self.strip_newlines:
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return "", False
            self.strip_newlines = False
        end, call = self.buffer.find(THINK_CLOSE), implicit_end(self.buffer)
        if end >= 0 and (call is None or end < call):
            said, self.buffer = self.buffer[:end].rstrip("\n"), self.buffer[end + len(THINK_CLOSE):]
            self.state, self.strip_newlines = "content", True
            return said, True
        if call is not None:
            said, self.buffer = self.buffer[:call].rstrip("\n"), self.buffer[call:]
            self.state, self.strip_newlines = "content", False
            return said, True
        if final:
            said, self.buffer = self.buffer, ""
            return said, False
        hold = max(partial_suffix(self.buffer, THINK_CLOSE), partial_suffix(self.buffer, TOOL_CALL_OPEN),
                   pending_call(self.buffer))
        keep = len(self.buffer) - hold
        keep = len(self.buffer[:keep].rstrip("\n"))  # newlines that may precede </think>
        said, self.buffer = self.buffer[:keep], self.buffer[keep:]
        return said, False

    def _content(self) -> str:
        if self.strip_newlines:
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return ""
            self.strip_newlines = False
        said, self.buffer = self.buffer, ""
        return said


CALL_HEADER = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*" + re.escape(FUNCTION_OPEN))


def implicit_end(text: str) -> int | None:
    """Where a `<tool_call>` that opens a real call (its `<function=` header follows) starts in
    `text`; None if there is none yet."""
    match = CALL_HEADER.search(text)
    return match.start() if match else None


def pending_call(text: str) -> int:
    """Length of the end of `text` that is a `<tool_call>` whose header has not arrived yet (the
    tag, blank space, and a start of `<function=`): held back until it is known."""
    at = text.rfind(TOOL_CALL_OPEN)
    if at < 0:
        return 0
    after = text[at + len(TOOL_CALL_OPEN):].lstrip()
    return len(text) - at if FUNCTION_OPEN.startswith(after) else 0


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """The whole output's (reasoning, content), None for an empty part (vLLM's nulls)."""
    splitter = ReasoningSplitter(in_reasoning)
    parts = [a + b for a, b in zip(splitter.feed(text), splitter.finish())]
    return parts[0] or None, parts[1] or None
