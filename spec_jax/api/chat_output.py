"""What a chat choice's generated text becomes in OpenAI's message: the reasoning
(`reasoning_content`, with `--reasoning-parser`), the answer (`content`) and the tool calls read
out of the answer (`tool_calls`, with `--enable-auto-tool-choice --tool-call-parser`). Tool calls
are parsed only after the reasoning ends, so a call written while thinking stays thought.
"""

from __future__ import annotations

import dataclasses

from spec_jax.api.forced_tool_calls import ForcedCallParser
from spec_jax.api.reasoning import ReasoningSplitter
from spec_jax.api.tool_parsers import ToolCallParser, merge_deltas


@dataclasses.dataclass
class ChatDelta:
    """One piece of a choice's message: reasoning and content text, tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)

    def add(self, other: ChatDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls

    def stream_fields(self) -> dict:
        """The delta of a streamed chunk: only the parts this piece has."""
        out = {}
        if self.reasoning:
            out["reasoning_content"] = out["reasoning"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class ChatChoiceText:
    """Splits one choice's text as it arrives. reasoning: None without a reasoning parser, else
    whether the prompt left the reasoning open; tools: the tool-call parser (None: no parsing)."""

    def __init__(self, reasoning: bool | None, tools: ToolCallParser | ForcedCallParser | None):
        self.splitter = None if reasoning is None else ReasoningSplitter(reasoning)
        self.tools = tools
        self.called = False  # whether any tool call was read

    def feed(self, text: str) -> ChatDelta:
        return self._route(*(self.splitter.feed(text) if self.splitter else ("", text)), final=False)

    def finish(self) -> ChatDelta:
        return self._route(*(self.splitter.finish() if self.splitter else ("", "")), final=True)

    def _route(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        if self.tools is None:
            return ChatDelta(reasoning, content)
        parsed = self.tools.feed(content)
        if final:
            parsed.add(self.tools.finish())
        self.called = self.called or bool(parsed.tool_calls)
        return ChatDelta(reasoning, parsed.content, parsed.tool_calls)


def chat_message(whole: ChatDelta) -> dict:
    """A whole choice's OpenAI message (vLLM's shape: content null when there is none beside the calls)."""
    content = whole.content or (None if whole.reasoning or whole.tool_calls else "")
    message: dict = {"role": "assistant", "content": content}
    if whole.reasoning:
        message["reasoning_content"] = message["reasoning"] = whole.reasoning
    if whole.tool_calls:
        message["tool_calls"] = merge_deltas(whole.tool_calls)
    return message
