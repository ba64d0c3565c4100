"""The tool-call parsers and the reasoning splitter on crafted text: whole, and streamed split at
every character boundary (and one character at a time), which must say the same."""

import itertools
import json

import pytest

from spec_jax.api.forced_tool_calls import ForcedCallParser, tool_choice_schema
from spec_jax.api.reasoning import ReasoningSplitter, prompt_opens_reasoning, split_reasoning
from spec_jax.api.tool_parsers import (HermesParser, Parsed, Qwen3CoderParser, convert_parameter, merge_deltas,
                                       parse_tool_calls)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "tags": {"type": "array"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
}}}}, {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def streamed(make, pieces):
    parser = make()
    content, deltas = "", []
    for piece in pieces:
        out = parser.feed(piece)
        content, deltas = content + out.content, deltas + out.tool_calls
    out = parser.finish()
    return content + out.content or None, merge_deltas(deltas + out.tool_calls)


def splits(text):
    """The text whole, cut at each boundary into two, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def call(name, arguments, index):
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
            "<parameter=note>\nnull\n</parameter>\n<parameter=extra>\nx < y > z\n</parameter>\n</function>\n"
            "</tool_call>")
WEATHER = {"city": "Paris", "days": 3, "metric": True, "tags": ["a", 1], "note": None, "extra": "x < y > z"}

QWEN3_CASES = [
    (XML_CALL, None, [call("get_weather", WEATHER, 0)]),
    ("Let me look.\n\n" + XML_CALL + "\n" + XML_CALL.replace("Paris", "Rome\nline 2") + "\n",
     "Let me look.", [call("get_weather", WEATHER, 0),
                      call("get_weather", {**WEATHER, "city": "Rome\nline 2"}, 1)]),
    ("<tool_call>\n<function=noop>\n</function>\n</tool_call>", None, [call("noop", {}, 0)]),
    ("No tools needed: 1 < 2 and <tool it is.", "No tools needed: 1 < 2 and <tool it is.", []),
    ("<tool_call> is how I would call one.", "<tool_call> is how I would call one.", []),
    ("text\n", "text\n", []),
    # cut short by max_tokens: the parameter in progress counts with what it has
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None, [call("get_weather", {"city": "Par"}, 0)]),
    ("<tool_call>\n<funct", "<tool_call>\n<funct", []),
]


@pytest.mark.parametrize("text, content, calls", QWEN3_CASES)
def test_qwen3_coder_whole_and_streamed_at_every_split(text, content, calls):
    assert parse_tool_calls(Qwen3CoderParser(TOOLS, call_id=ids()), text) == (content, calls)
    for pieces in splits(text):
        assert streamed(lambda: Qwen3CoderParser(TOOLS, call_id=ids()), pieces) == (content, calls), pieces


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'

HERMES_CASES = [
    (HERMES_CALL, None, [call("get_weather", {"city": "Paris", "days": 3}, 0)]),
    ("Sure.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Rome"), "Sure.",
     [call("get_weather", {"city": "Paris", "days": 3}, 0), call("get_weather", {"city": "Rome", "days": 3}, 1)]),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ('<tool_call>\n{"name": "noop"', '<tool_call>\n{"name": "noop"', []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_whole_and_streamed_at_every_split(text, content, calls):
    assert parse_tool_calls(HermesParser(TOOLS, call_id=ids()), text) == (content, calls)
    for pieces in splits(text):
        assert streamed(lambda: HermesParser(TOOLS, call_id=ids()), pieces) == (content, calls), pieces


def test_the_stream_names_the_call_before_its_arguments_arrive():
    parser = Qwen3CoderParser(TOOLS, call_id=ids())
    out = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa")
    assert out.tool_calls == [{"index": 0, "id": "call_0", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]
    arguments = parser.feed("ris\n</parameter>\n").tool_calls
    assert arguments == [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = XML_CALL + "\n" + XML_CALL
    assert parse_tool_calls(Qwen3CoderParser(TOOLS, limit=1, call_id=ids()), text) == (
        None, [call("get_weather", WEATHER, 0)])


@pytest.mark.parametrize("value, schema, want", [
    ("3", {"type": "integer"}, 3), ("x", {"type": "integer"}, "x"), ("2.5", {"type": "number"}, 2.5),
    ("2", {"type": "number"}, 2), ("False", {"type": "boolean"}, False), ("{\"a\": 1}", {"type": "object"}, {"a": 1}),
    ("{'a': 1}", {"type": "object"}, {"a": 1}), ("null", {"type": "string"}, "null"),
    ("None", {"type": "integer"}, None),
    ("3", None, "3"), ("[1,", {"type": "array"}, "[1,"),
])
def test_parameter_values_take_their_schema_type(value, schema, want):
    assert convert_parameter(value, schema) == want


REASONING_CASES = [
    # Qwen3.5/3.6: the prompt opened the block
    (True, "\nI think.\nMore.\n</think>\n\nThe answer.", "I think.\nMore.", "The answer."),
    (True, "Cut short by max_tokens", "Cut short by max_tokens", None),
    (True, "</think>\n\nOnly an answer", None, "Only an answer"),
    (True, "Hm, a call.\n" + XML_CALL, "Hm, a call.", XML_CALL),
    (True, "I mention <tool_call> in passing.</think>ok", "I mention <tool_call> in passing.", "ok"),
    # the older template: the model opens the block itself, or does not think at all
    (False, "<think>\nplan\n</think>\n\nanswer", "plan", "answer"),
    (False, "  <think>x</think>y", "x", "y"),
    (False, "\nplain answer <think> not a block", None, "\nplain answer <think> not a block"),
]


@pytest.mark.parametrize("opened, text, reasoning, content", REASONING_CASES)
def test_reasoning_whole_and_streamed_at_every_split(opened, text, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)
    for pieces in splits(text):
        splitter = ReasoningSplitter(opened)
        parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
        got = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
        assert got == (reasoning, content), pieces


def test_the_prompt_says_whether_reasoning_is_open():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_required_and_named_answers_read_back_as_calls():
    """tool_choice "required" / named: the constrained JSON answer, fed in pieces, becomes calls."""
    answer = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "noop", "parameters": {}}]'
    parser = ForcedCallParser(None, call_id=ids())
    assert [parser.feed(c) for c in answer] == [Parsed()] * len(answer)  # nothing until it is whole
    assert merge_deltas(parser.finish().tool_calls) == [call("get_weather", {"city": "Paris"}, 0), call("noop", {}, 1)]
    parser = ForcedCallParser("get_weather", call_id=ids())
    parser.feed('{"city": "Rome"}')
    assert merge_deltas(parser.finish().tool_calls) == [call("get_weather", {"city": "Rome"}, 0)]
    for named, text in ((None, '[]'), (None, '[{"name": "f"}]'), ("f", "[1]"), (None, "not json")):
        parser = ForcedCallParser(named)
        parser.feed(text)
        assert parser.finish() == Parsed(content=text)


def test_the_schemas_tool_choice_holds_the_answer_to():
    assert tool_choice_schema(TOOLS, "get_weather", True) == TOOLS[0]["function"]["parameters"]
    schema = tool_choice_schema(TOOLS, None, parallel=False)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["get_weather"], ["noop"]]
    assert "maxItems" not in tool_choice_schema(TOOLS, None, parallel=True)
