"""Structured output and forced tool calls on the server, through the real `openai` client, on the
default model (its real tokenizer, so the grammar masks are a deployment's) with ngram
speculation on: response_format json_schema, guided_choice and guided_regex hold; a malformed
constraint or two constraints are a 400 naming the field; tool_choice "required" and a named
function answer with calls whose arguments follow the tool's parameters; a structured request's
greedy output equals the same request with speculation off."""

import json
import re

import httpx
import jsonschema
import openai
import pytest
from helpers import FIXED_K
from live_server import live_server

from spec_jax import LLM
from spec_jax.api.server import Server, build_app

CHATML = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CAR = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 10},
                                        "car_type": {"enum": ["sedan", "SUV", "Truck"]}},
       "required": ["brand", "car_type"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Generate a JSON with the brand and car_type of a car:"}]
EMAIL = r"[a-z]{1,8}@[a-z]{1,6}\.com"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    template = tmp_path_factory.mktemp("structured") / "chat.jinja"
    template.write_text(CHATML)
    llm = LLM(dtype="float32", max_model_len=512, max_num_seqs=2, batch_buckets=[2],
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, **FIXED_K})
    with live_server(build_app(Server(llm, served_model_name="m", chat_template=str(template),
                                      steps_per_chunk=2))) as url:
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def drafted(url: str) -> float:
    """Draft tokens the server's scheduler has proposed so far (its Prometheus counter)."""
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^vllm:spec_decode_num_draft_tokens_total\S* (\S+)$", text, re.M).group(1))


def chat(client, speculative=True, **fields):
    extra = {"return_token_ids": True, "speculative": speculative, **fields.pop("extra_body", {})}
    return client.chat.completions.create(model="m", messages=ASK, temperature=0, extra_body=extra,
                                          **{"max_tokens": 80, **fields})


def test_response_format_json_schema_validates_and_speculation_changes_nothing(served):
    url, client = served
    fmt = {"type": "json_schema", "json_schema": {"name": "car", "schema": CAR, "strict": True}}
    before = drafted(url)
    on = chat(client, response_format=fmt).choices[0]
    jsonschema.validate(json.loads(on.message.content), CAR)
    assert on.finish_reason == "stop"
    assert drafted(url) > before  # speculation ran on the constrained row
    off = chat(client, speculative=False, response_format=fmt).choices[0]
    assert off.model_extra["token_ids"] == on.model_extra["token_ids"]
    obj = chat(client, response_format={"type": "json_object"}).choices[0]
    assert obj.message.content.startswith("{")  # this model's object outruns max_tokens: whole only at "stop"
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)


def test_guided_choice_and_regex_on_completions_and_streamed(served):
    url, client = served
    choices = ["Positive", "Negative", "Neutral"]
    r = client.completions.create(model="m", prompt="Classify: the engine is wonderful!", max_tokens=20,
                                  temperature=0, extra_body={"guided_choice": choices})
    assert r.choices[0].text in choices
    r = client.completions.create(model="m", prompt="The email of Alan Turing is", max_tokens=30, temperature=0,
                                  extra_body={"guided_regex": EMAIL})
    assert re.fullmatch(EMAIL, r.choices[0].text), r.choices[0].text
    stream = client.completions.create(model="m", prompt="The email of Alan Turing is", max_tokens=30,
                                       temperature=0, stream=True, extra_body={"guided_regex": EMAIL})
    assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
    r = chat(client, extra_body={"structured_outputs": {"choice": choices}}).choices[0]
    assert r.message.content in choices


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"}, "response_format"),
    ({"guided_regex": "a+", "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "guided_regex"),
], ids=["bad-schema", "bad-regex", "choice-not-list", "two-guided", "format-and-guided", "format-and-required",
        "regex-and-named"])
def test_a_malformed_or_second_constraint_is_a_400_naming_the_field(served, fields, param):
    url, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=ASK, max_tokens=4, extra_body=fields)
    assert e.value.body["param"] == param and param in e.value.body["message"], e.value.body


def check_calls(calls, names) -> None:
    """Each call names one of `names` and its arguments validate against that tool's parameters."""
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_and_named_answer_with_valid_calls(served, stream):
    url, client = served
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})):
        for parallel in (True, False):
            r = client.chat.completions.create(model="m", messages=ask, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=parallel, temperature=0, max_tokens=120,
                                               stream=stream)
            if stream:
                chunks = [c.choices[0] for c in r if c.choices]
                deltas = [d for c in chunks for d in c.delta.tool_calls or []]
                assert not "".join(c.delta.content or "" for c in chunks)
                finish = chunks[-1].finish_reason
                calls = [openai.types.chat.ChatCompletionMessageToolCall(
                    id=d.id, type="function", function={"name": d.function.name, "arguments": d.function.arguments})
                    for d in deltas]
            else:
                message, finish = r.choices[0].message, r.choices[0].finish_reason
                assert message.content is None
                calls = message.tool_calls
            assert finish == "tool_calls"
            check_calls(calls, names)
            if not parallel:
                assert len(calls) == 1
