"""A chat request's tools, as vLLM's server reads them: `tools`, `tool_choice`,
`parallel_tool_calls` and the messages' own `tool_calls`, checked (a wrong shape is a 400 naming
the field), handed to the chat template, and turned into the parser that reads the calls out of
the answer (`ChatParsers`: the server's `--enable-auto-tool-choice --tool-call-parser` and
`--reasoning-parser`)."""

from __future__ import annotations

import dataclasses
import json

from spec_jax.api.forced_tool_calls import ForcedCallParser, tool_choice_schema
from spec_jax.api.openai_requests import APIError, ChatBody, Constraint, structured_output
from spec_jax.engine.reasoning_grammar import REASONING_PARSERS
from spec_jax.api.tool_parsers import TOOL_CALL_PARSERS, ToolCallParser
from spec_jax.engine.structured import StructuredOutputsParams

TOOL_FORM = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
CALL_FORM = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}'
NAMED_FORM = '{"type": "function", "function": {"name": ...}}'


@dataclasses.dataclass(frozen=True)
class ChatParsers:
    """How the server reads chat answers: vLLM's --enable-auto-tool-choice, --tool-call-parser and
    --reasoning-parser (None: the text stays content)."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r} is not built; accepted: "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(TOOL_CALL_PARSERS)})")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not built; accepted: "
                             f"{', '.join(REASONING_PARSERS)}")


def check_tools(body: ChatBody) -> None:
    """What a chat template may loop over besides messages, in OpenAI's shapes: `tools` (or
    chat_template_kwargs' `tools`, not both) a list of tool objects, each message's `tool_calls` a
    list of call objects. Anything else is a 400 naming the field."""
    given = (body.chat_template_kwargs or {}).get("tools")
    if given is not None and body.tools is not None:
        raise APIError(400, "tools are given twice, as tools and as chat_template_kwargs.tools; send them as tools",
                       param="tools")
    if body.tools is not None:
        check_functions(body.tools, "tools", "tools", TOOL_FORM, calls=False)
    if given is not None:
        check_functions(given, "chat_template_kwargs.tools", "chat_template_kwargs", TOOL_FORM, calls=False)
    for i, message in enumerate(body.messages):
        if message.get("tool_calls") is not None:
            check_functions(message["tool_calls"], f"messages[{i}].tool_calls", "messages", CALL_FORM, calls=True)


def check_functions(items, where: str, param: str, form: str, *, calls: bool) -> None:
    """items must be a list of objects `form`, each with a `function` object that has a string
    name (and, for calls, arguments as JSON text or an object); else a 400 naming the part at
    fault, under `param`."""
    def refuse(path: str, rule: str, value):
        raise APIError(400, f"{path} must be {rule}, got {json.dumps(value)[:80]}", param=param)

    if not isinstance(items, list):
        refuse(where, f"a list of {form}", items)
    for j, item in enumerate(items):
        if not isinstance(item, dict):
            refuse(f"{where}[{j}]", f"an object {form}", item)
        function = item.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            refuse(f"{where}[{j}].function", "an object with a string name", function)
        if calls and not isinstance(function.get("arguments", ""), str | dict):
            refuse(f"{where}[{j}].function.arguments", "JSON text or an object", function["arguments"])


def tool_choice(body: ChatBody, parsers: ChatParsers) -> str:
    """The request's tool_choice checked: "none", "auto" (OpenAI's default when tools are given),
    "required", or "named" (the function is `named_function(body)`)."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if isinstance(choice, dict):
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(
                function.get("name"), str):
            raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or {NAMED_FORM}, got "
                                f"{json.dumps(choice)[:80]}", param="tool_choice")
        names = [t["function"]["name"] for t in body.tools or []]
        if function["name"] not in names:
            raise APIError(400, f"tool_choice names the function {function['name']!r}, which is not among the "
                                f"tools ({', '.join(map(repr, names)) or 'none given'})", param="tool_choice")
        choice = "named"
    if choice not in ("none", "auto", "required", "named"):
        raise APIError(400, f"tool_choice={choice!r} must be 'none', 'auto', 'required' or {NAMED_FORM}",
                       param="tool_choice")
    if choice != "none" and not body.tools:
        raise APIError(400, f"tool_choice={body.tool_choice!r} needs tools", param="tool_choice")
    if choice == "auto" and not parsers.enable_auto_tool_choice:
        raise APIError(400, '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                            f"--tool-call-parser ({', '.join(TOOL_CALL_PARSERS)})", param="tool_choice")
    return choice


def named_function(body: ChatBody) -> str | None:
    """The function a named tool_choice names (None for the other choices)."""
    return body.tool_choice["function"]["name"] if isinstance(body.tool_choice, dict) else None


def chat_constraint(body: ChatBody, choice: str) -> Constraint | None:
    """The chat answer's constraint: for tool_choice "required" or a named function the JSON schema
    of the calls (`forced_tool_calls.tool_choice_schema`, as vLLM does), else the request's
    structured output. Both asking is a 400 naming the structured-output field."""
    asked = structured_output(body)
    if choice not in ("required", "named"):
        return asked
    if asked is not None:
        raise APIError(400, f"{asked.field} asks for a constraint, and so does tool_choice="
                            f"{json.dumps(body.tool_choice)} (the answer is held to the calls' schema); send one",
                       param=asked.field)
    schema = tool_choice_schema(body.tools, named_function(body), body.parallel_tool_calls)
    return Constraint("tool_choice", StructuredOutputsParams(json=schema))


def tool_call_parser(body: ChatBody, parsers: ChatParsers, choice: str) -> ToolCallParser | ForcedCallParser | None:
    """The parser reading this request's calls out of the answer; None when tool_choice is "none"."""
    if choice == "none":
        return None
    if choice in ("required", "named"):
        return ForcedCallParser(named_function(body))
    return TOOL_CALL_PARSERS[parsers.tool_call_parser](body.tools, limit=None if body.parallel_tool_calls else 1)


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as chat templates expect them (HF's convention): each call's `arguments` an
    object, parsed from the JSON text OpenAI sends. Arguments that are no JSON object are a 400."""
    out = []
    for i, message in enumerate(messages):
        if message.get("tool_calls"):
            calls = []
            for j, call in enumerate(message["tool_calls"]):
                arguments = call["function"].get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments or "{}")
                    except json.JSONDecodeError as e:
                        raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {e}",
                                       param="messages") from None
                if not isinstance(arguments, dict):
                    raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object, "
                                        f"got {json.dumps(arguments)[:80]}", param="messages")
                calls.append({**call, "function": {**call["function"], "arguments": arguments}})
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out
