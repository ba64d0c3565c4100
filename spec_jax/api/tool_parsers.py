"""Tool calls read out of a model's answer, in the formats vLLM's `--tool-call-parser` names:

* `qwen3_coder` (Qwen3-Coder, Qwen3.5, Qwen3.6): XML inside the tool-call tags,

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

  each parameter's text converted to the type the tool's JSON schema gives it;
* `hermes` (Qwen2.5, Qwen3, Hermes): a JSON object `{"name": ..., "arguments": {...}}` inside the tags.

A parser is fed the answer as it arrives and returns what it can already tell: content text and
OpenAI tool-call deltas (`{"index", "id", "type", "function": {"name", "arguments"}}` first, then
`{"index", "function": {"arguments": piece}}`), so a stream and a whole response say the same.
Blank space that only separates the text from the calls is formatting, not content. A block that
does not parse as a call stays in the content, as written.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import uuid
from typing import Callable

from spec_jax.api.reasoning import partial_suffix

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass
class Parsed:
    """What one piece of the answer gave: content text and tool-call deltas, in order."""

    content: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)

    def add(self, other: Parsed) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


def parameter_schemas(tools: list[dict]) -> dict[str, dict]:
    """function name -> its parameters' JSON schemas (`properties`), from OpenAI tool objects."""
    out = {}
    for tool in tools:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties")
        out[function.get("name")] = properties if isinstance(properties, dict) else {}
    return out


class ToolCallParser:
    """The shared part of both formats: text outside the tool-call tags is content; what is inside
    goes to the format's `_block`. limit: the most calls kept (1 for parallel_tool_calls=false);
    blocks past it are neither calls nor content."""

    def __init__(self, tools: list[dict], limit: int | None = None, call_id: Callable[[], str] = new_call_id):
        self.schemas = parameter_schemas(tools)
        self.limit, self.call_id = limit, call_id
        self.buffer = ""
        self.inside = False
        self.after_block = False  # blank space after a block is formatting
        self.calls = 0  # calls started
        self.out = Parsed()

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        return self._run(final=False)

    def finish(self) -> Parsed:
        return self._run(final=True)

    def _run(self, final: bool) -> Parsed:
        self.out = Parsed()
        while self._inside(final) if self.inside else self._outside(final):
            pass
        return self.out

    def _outside(self, final: bool) -> bool:
        """Content up to the next tool-call tag; True when a block starts."""
        at = self.buffer.find(START)
        if at >= 0:
            self._say(self.buffer[:at], before_block=True)
            self.buffer, self.inside = self.buffer[at + len(START):], True
            self._open_block()
            return True
        if final:
            self._say(self.buffer, before_block=False)
            self.buffer = ""
            return False
        keep = len(self.buffer) - partial_suffix(self.buffer, START)
        keep = len(self.buffer[:keep].rstrip())  # blank space that may precede a block
        self._say(self.buffer[:keep], before_block=False)
        self.buffer = self.buffer[keep:]
        return False

    def _say(self, text: str, before_block: bool) -> None:
        if self.after_block:
            text = text.lstrip()
            self.after_block = not text
        if before_block:
            text = text.rstrip()
        self.out.content += text

    def _inside(self, final: bool) -> bool:
        """Parse the open block; True when it is done (the text after it is read next)."""
        done = self._block(final)
        if done:
            self.inside = False
        return done

    def _as_content(self) -> None:
        """The block opened is no call: its tag is content, and what follows is read as text."""
        self.out.content += START
        self.inside, self.after_block = False, False

    def _keeps(self) -> bool:
        return self.limit is None or self.calls <= self.limit

    def _start_call(self, name: str) -> None:
        self.calls += 1
        if self._keeps():
            self.out.tool_calls.append({"index": self.calls - 1, "id": self.call_id(), "type": "function",
                                        "function": {"name": name, "arguments": ""}})

    def _arguments(self, text: str) -> None:
        if self._keeps() and text:
            self.out.tool_calls.append({"index": self.calls - 1, "function": {"arguments": text}})

    def _open_block(self) -> None:
        """Called as a block opens."""

    def _block(self, final: bool) -> bool:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: a call once its block closes."""

    def _block(self, final: bool) -> bool:
        end = self.buffer.find(END)
        if end < 0 and not final:
            return False
        body = self.buffer if end < 0 else self.buffer[:end]
        call = hermes_call(body) if end >= 0 else None
        if call is None:
            self._as_content()
            return True
        self.buffer = self.buffer[end + len(END):]
        self._start_call(call[0])
        self._arguments(call[1])
        self.after_block = True
        return True


def hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a hermes block's body; None if it is no call."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # already JSON text
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


class Qwen3CoderParser(ToolCallParser):
    """`<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`: the
    call's name as soon as its header is read, each argument as its parameter closes."""

    def _open_block(self) -> None:
        self.name: str | None = None
        self.arguments = 0  # arguments sent for the call in progress
        self.function_closed = False

    def _block(self, final: bool) -> bool:
        if self.name is None and not self._header(final):
            return self.inside is False
        while not self.function_closed:
            if not self._parameter(final):
                if not final:
                    return False
                self._close_function()
        text = self.buffer.lstrip()
        if text.startswith(END) or final or (text and not END.startswith(text)):
            self.buffer = text[len(END):] if text.startswith(END) else text
            self.after_block = True
            return True
        return False

    def _header(self, final: bool) -> bool:
        """Read `<function=NAME>`; False while it has not arrived (or, when it cannot, the block is
        content: `inside` is cleared)."""
        text = self.buffer.lstrip()
        if not text.startswith(FUNCTION):
            if final or not FUNCTION.startswith(text):
                self._as_content()
            return False
        end = text.find(">")
        if end < 0:
            if final:
                self._as_content()
            return False
        self.name = text[len(FUNCTION):end]
        self.buffer = text[end + 1:]
        self._start_call(self.name)
        return True

    def _parameter(self, final: bool) -> bool:
        """Read one `<parameter=P>VALUE</parameter>` (or `</function>`); False while incomplete.
        At the end of the output a parameter cut short counts with the value it has."""
        text = self.buffer.lstrip()
        if text.startswith(FUNCTION_END):
            self.buffer = text[len(FUNCTION_END):]
            self._close_function()
            return True
        if not text.startswith(PARAMETER):
            if text and not PARAMETER.startswith(text) and not FUNCTION_END.startswith(text):
                self.buffer = skip_to_tag(text)  # stray text inside a function is not an argument
                return bool(self.buffer) or final
            return False
        head = text.find(">")
        end = text.find(PARAMETER_END, head + 1) if head >= 0 else -1
        if end < 0 and not (final and head >= 0):
            return False
        name, value = text[len(PARAMETER):head], text[head + 1:end if end >= 0 else len(text)]
        self.buffer = text[end + len(PARAMETER_END):] if end >= 0 else ""
        self._add_argument(name, value)
        return True

    def _add_argument(self, name: str, value: str) -> None:
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        typed = convert_parameter(value, (self.schemas.get(self.name) or {}).get(name))
        pair = f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(typed, ensure_ascii=False)}"
        self._arguments(("{" if self.arguments == 0 else ", ") + pair)
        self.arguments += 1

    def _close_function(self) -> None:
        self._arguments("{}" if self.arguments == 0 else "}")
        self.function_closed = True


def skip_to_tag(text: str) -> str:
    """`text` from its first `<parameter=` or `</function>` on ("" if neither is there yet)."""
    found = [i for i in (text.find(PARAMETER), text.find(FUNCTION_END)) if i >= 0]
    return text[min(found):] if found else ""


STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def convert_parameter(value: str, schema) -> object:
    """A qwen3_coder parameter's text as the JSON value its schema's type says (the text itself for
    strings, unknown parameters, or text that does not read as that type)."""
    if not isinstance(schema, dict):
        return value
    kind = schema.get("type")
    if kind is None and isinstance(schema.get("anyOf"), list):
        kinds = [o.get("type") for o in schema["anyOf"] if isinstance(o, dict)]
        kind = next((k for k in kinds if k not in (None, "null")), "string")
        if "null" in kinds and value.lower() in ("null", "none"):
            return None
    kind = str(kind if kind is not None else "string").lower()
    if kind in STRING_TYPES:
        return value
    if value.lower() in ("null", "none"):
        return None
    try:
        if kind.startswith(("int", "uint", "long", "short")):
            return int(value)
        if kind.startswith(("num", "float", "double")):
            number = float(value)
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind in ("boolean", "bool"):
            return {"true": True, "false": False}[value.strip().lower()]
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return ast.literal_eval(value)
    except (ValueError, KeyError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


TOOL_CALL_PARSERS = {"qwen3_coder": Qwen3CoderParser, "hermes": HermesParser}


def parse_tool_calls(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict]]:
    """A whole answer's (content or None, complete OpenAI tool calls)."""
    parsed = parser.feed(text)
    parsed.add(parser.finish())
    return parsed.content or None, merge_deltas(parsed.tool_calls)


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas joined into whole calls, as a client assembles them."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": None, "type": "function",
                                                 "function": {"name": None, "arguments": ""}})
        call["id"] = delta.get("id", call["id"])
        function = delta.get("function", {})
        call["function"]["name"] = function.get("name", call["function"]["name"])
        call["function"]["arguments"] += function.get("arguments", "")
    return [calls[i] for i in sorted(calls)]
