"""Structured output and tool calls after the reasoning, on a model that thinks (`scripted_model`:
its template opens `<think>` unless enable_thinking is false), with ngram speculation on: offline
through `LLM(reasoning_parser="qwen3")` and on the server (`--reasoning-parser qwen3`) through the
real `openai` client. The model reasons freely, then the answer follows the schema; greedy output
equals speculation off; with thinking off the grammar holds from the first token; forced tool
calls come after the reasoning; tool calls written inside the reasoning stay reasoning."""

import dataclasses
import json

import jsonschema
import openai
import pytest
from helpers import FIXED_K
from live_server import live_server
from scripted_model import ANSWER_TURN, CALL_TURN, write_scripted_checkpoint

from spec_jax import LLM, SamplingParams
from spec_jax.api.chat_output import ChatChoiceText
from spec_jax.api.chat_requests import ChatParsers
from spec_jax.api.reasoning import split_reasoning
from spec_jax.api.server import Server, build_app
from spec_jax.api.tool_parsers import TOOL_CALL_PARSERS, merge_deltas
from spec_jax.engine.structured import StructuredOutputsParams

WEATHER = {"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}, "degrees": {"enum": [22, 23]}},
           "required": ["sky", "degrees"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, **FIXED_K}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    d = tmp_path_factory.mktemp("scripted_reasoning")
    ids = write_scripted_checkpoint(d)
    llm = LLM(model=str(d), dtype="float32", max_model_len=512, max_num_seqs=2, batch_buckets=[2],
              speculative_config=NGRAM, reasoning_parser="qwen3")
    return d, ids, llm


def ban_the_call(ids) -> dict:
    """logit_bias that sends the script from <think> to its answer turn (`It is sunny.</think>`)."""
    return {ids[CALL_TURN[0]]: -100}


# ----------------------------------------------------------------------------- offline


def test_offline_the_model_reasons_then_answers_in_the_schema(scripted):
    d, ids, llm = scripted
    params = SamplingParams(temperature=0, max_tokens=60, logit_bias=ban_the_call(ids),
                            structured_outputs=StructuredOutputsParams(json=WEATHER))
    on = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    reasoning, content = split_reasoning(on.text, in_reasoning=True)
    assert reasoning == ANSWER_TURN[0] and on.text.startswith(ANSWER_TURN[0] + ANSWER_TURN[1])
    jsonschema.validate(json.loads(content), WEATHER)
    assert on.finish_reason == "stop"
    off = llm.chat(QUESTION, dataclasses.replace(params, speculative=False), use_tqdm=False)[0]
    assert off.outputs[0].token_ids == on.token_ids


def test_offline_with_thinking_off_the_grammar_holds_from_the_first_token(scripted):
    d, ids, llm = scripted
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=WEATHER))
    out = llm.chat(QUESTION, params, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0].outputs[0]
    assert out.text.startswith("{") and "</think>" not in out.text  # the script's next token is a call: forbidden
    jsonschema.validate(json.loads(out.text), WEATHER)


def test_an_engine_and_a_server_that_disagree_on_the_reasoning_parser_are_refused(scripted):
    d, ids, llm = scripted
    with pytest.raises(ValueError, match="reasoning_parser=None but the engine's grammars follow "
                                         "reasoning_parser='qwen3'"):
        Server(llm, parsers=ChatParsers())
    with pytest.raises(ValueError, match="reasoning_parser='deepseek_r1' is not built; accepted: None, 'qwen3'"):
        LLM(model=str(d), reasoning_parser="deepseek_r1")


@pytest.mark.parametrize("parser, call", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>"),
])
def test_tool_calls_are_parsed_after_the_reasoning_only(parser, call):
    """A hermes call inside the thought is thought; after </think> it is a call. (Qwen3.6 may open a
    qwen3_coder call before closing its thought: that call's header ends the reasoning.)"""
    thought = f"Maybe {call} later." if parser == "hermes" else "I will call."
    text = ChatChoiceText(True, TOOL_CALL_PARSERS[parser](TOOLS))
    whole = text.feed(f"{thought}\n</think>\n\n{call}")
    whole.add(text.finish())
    assert whole.reasoning == thought and not whole.content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in merge_deltas(whole.tool_calls)
            ] == [("get_weather", {"city": "Paris"})]


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def served(scripted):
    d, ids, llm = scripted
    server = Server(llm, served_model_name="scripted", steps_per_chunk=2,
                    parsers=ChatParsers(tool_call_parser="qwen3_coder", enable_auto_tool_choice=True,
                                        reasoning_parser="qwen3"))
    with live_server(build_app(server)) as url:
        yield ids, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def ask(client, speculative=True, **fields):
    extra = {"return_token_ids": True, "speculative": speculative, **fields.pop("extra_body", {})}
    return client.chat.completions.create(model="scripted", messages=QUESTION, temperature=0, extra_body=extra,
                                          **{"max_tokens": 60, **fields})


FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}


def test_response_format_after_the_reasoning_and_speculation_changes_nothing(served):
    ids, client = served
    bias = {str(t): b for t, b in ban_the_call(ids).items()}
    on = ask(client, response_format=FORMAT, logit_bias=bias).choices[0]
    assert on.message.model_extra["reasoning_content"] == ANSWER_TURN[0] and on.finish_reason == "stop"
    jsonschema.validate(json.loads(on.message.content), WEATHER)
    off = ask(client, speculative=False, response_format=FORMAT, logit_bias=bias).choices[0]
    assert off.model_extra["token_ids"] == on.model_extra["token_ids"]
    deltas = [c.choices[0].delta for c in ask(client, response_format=FORMAT, logit_bias=bias, stream=True)
              if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == ANSWER_TURN[0]
    assert "".join(d.content or "" for d in deltas) == on.message.content


def test_with_thinking_off_the_schema_holds_from_the_first_token(served):
    ids, client = served
    choice = ask(client, response_format=FORMAT, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                 ).choices[0]
    assert choice.message.model_extra.get("reasoning_content") is None and choice.message.content.startswith("{")
    jsonschema.validate(json.loads(choice.message.content), WEATHER)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_come_after_the_reasoning(served, tool_choice):
    """Unbanned, the script thinks `Need the weather.` and closes the thought: the calls' schema holds
    from there, so the call parses and its arguments validate; speculation changes nothing."""
    ids, client = served
    forced = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}  # one call, then "]"
    on = ask(client, **forced).choices[0]
    assert on.message.model_extra["reasoning_content"] == CALL_TURN[0] and on.finish_reason == "tool_calls"
    [call] = on.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    off = ask(client, speculative=False, **forced).choices[0]
    assert off.model_extra["token_ids"] == on.model_extra["token_ids"]


def test_structural_tag_is_a_400_naming_the_field(served):
    ids, client = served
    tag = {"type": "structural_tag", "structures": [{"begin": "<function=get_weather>", "schema": CITY,
                                                     "end": "</function>"}], "triggers": ["<function="]}
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, response_format=tag, max_tokens=4)
    assert e.value.body["param"] == "response_format.type" and "structural_tag" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}}, max_tokens=4)
    assert e.value.body["param"] == "structured_outputs" and "structural_tag" in e.value.body["message"]
