"""tool_choice "required" and a named function, as vLLM answers them: the answer is constrained
to JSON by a schema (`tool_choice_schema`) and read back as calls (`ForcedCallParser`), whatever
--tool-call-parser says.

* "required": a JSON array of at least one `{"name": ..., "parameters": {...}}` (those two keys
  only: the rest would be dropped), each name one of the tools' with that tool's parameter schema
  (at most one item with parallel_tool_calls false);
* a named function: the JSON object of that function's arguments.

The server holds the answer to the schema with structured output (`chat_requests.chat_constraint`)."""

from __future__ import annotations

import json
from typing import Callable

from spec_jax.api.tool_parsers import Parsed, new_call_id

ANY_OBJECT = {"type": "object"}


def parameters_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or ANY_OBJECT


def tool_choice_schema(tools: list[dict], named: str | None, parallel: bool) -> dict:
    """The JSON schema the answer is held to: the named function's parameters, or (named None,
    "required") the array of calls."""
    if named is not None:
        return parameters_of(next(t for t in tools if t["function"]["name"] == named))
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": parameters_of(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class ForcedCallParser:
    """Reads a constrained answer back as OpenAI tool-call deltas once it is whole (it is JSON, so
    its parts mean nothing alone). named: the function tool_choice names (None: "required").
    Text that does not parse stays content."""

    def __init__(self, named: str | None, call_id: Callable[[], str] = new_call_id):
        self.named, self.call_id = named, call_id
        self.text = ""

    def feed(self, text: str) -> Parsed:
        self.text += text
        return Parsed()

    def finish(self) -> Parsed:
        calls = forced_calls(self.text, self.named)
        if calls is None:
            return Parsed(content=self.text)
        return Parsed(tool_calls=[{"index": i, "id": self.call_id(), "type": "function",
                                   "function": {"name": name, "arguments": arguments}}
                                  for i, (name, arguments) in enumerate(calls)])


def forced_calls(text: str, named: str | None) -> list[tuple[str, str]] | None:
    """(name, arguments as JSON text) of each call in a constrained answer; None if it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if named is not None:
        return [(named, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None
    if not isinstance(value, list) or not value or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict)
            for c in value):
        return None
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
