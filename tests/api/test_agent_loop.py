"""A tool-using agent's loop through the real `openai` client against `spec-jax serve` with
`--enable-auto-tool-choice --tool-call-parser qwen3_coder --reasoning-parser qwen3` and ngram
speculation on: the model thinks and calls a tool, the client runs it and sends the result back,
the model answers. The model follows a script (`scripted_model`): its output is real greedy
output, parsed by the server; each turn equals the same turn with speculation off."""

import json

import httpx
import openai
import pytest
from helpers import FIXED_K
from live_server import live_server
from scripted_model import ANSWER_TURN, CALL_TURN, write_scripted_checkpoint

from spec_jax import LLM
from spec_jax.api.chat_requests import ChatParsers
from spec_jax.api.server import Server, build_app

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("scripted")
    ids = write_scripted_checkpoint(d)
    llm = LLM(model=str(d), dtype="float32", max_model_len=512, max_num_seqs=2, batch_buckets=[2],
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, **FIXED_K}, reasoning_parser="qwen3")
    server = Server(llm, served_model_name="scripted", steps_per_chunk=2, api_key="sesame",
                    parsers=ChatParsers(tool_call_parser="qwen3_coder", enable_auto_tool_choice=True,
                                        reasoning_parser="qwen3"))
    with live_server(build_app(server)) as url:
        yield url, ids, openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0)


def ask(client, messages, speculative=True, **fields):
    extra = {"return_token_ids": True, "speculative": speculative, **fields.pop("extra_body", {})}
    return client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS, temperature=0,
                                          extra_body=extra, **{"max_tokens": 40, **fields})


def test_call_tool_result_answer_with_speculation_equal_to_without(agent_server):
    url, ids, client = agent_server
    first = ask(client, QUESTION)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == CALL_TURN[0]
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")

    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()],
                           "reasoning_content": choice.message.model_extra["reasoning_content"]},
                          {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22 C"}]
    ban_the_call = {"logit_bias": {str(ids[CALL_TURN[0]]): -100}}
    second = ask(client, history, **ban_the_call)
    prompt_ids = second.model_extra["prompt_token_ids"][0]
    prompt = httpx.post(f"{url}/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
            in prompt and "<tool_response>\nsunny, 22 C\n</tool_response>" in prompt)  # the template rendered both
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert (answer.message.model_extra["reasoning_content"], answer.message.content) == (ANSWER_TURN[0],
                                                                                         ANSWER_TURN[2])
    # the same turns with speculation off for the request: the same tokens
    for got, messages, fields in ((first, QUESTION, {}), (second, history, ban_the_call)):
        plain = ask(client, messages, speculative=False, **fields)
        assert plain.choices[0].model_extra["token_ids"] == got.choices[0].model_extra["token_ids"]
    # unbanned, the model calls again: the n-gram drafter finds the call in the history, its drafts
    # are accepted, and the call is the same
    before = accepted_drafts(url)
    again = ask(client, history).choices[0]
    assert [c.function for c in again.message.tool_calls] == [call.function]
    assert accepted_drafts(url) > before


def accepted_drafts(url) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    line = next(line for line in lines if line.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    return float(line.split()[-1])


def test_a_streamed_turn_says_what_the_whole_one_says(agent_server):
    url, ids, client = agent_server
    whole = ask(client, QUESTION).choices[0]
    chunks = list(ask(client, QUESTION, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == whole.message.model_extra["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert "".join(t.function.arguments or "" for t in calls) == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_thinking_off(agent_server):
    """tool_choice none: the call stays text (the template still lists the tools); enable_thinking
    false reaches the template, whose prompt then closes the reasoning (it ends with the script's
    `\n</think>\n\n`): the model goes straight to the call, with no reasoning_content."""
    url, ids, client = agent_server
    r = ask(client, QUESTION, tool_choice="none").choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls
    assert r.message.content.startswith("<tool_call>\n<function=get_weather>")
    r = ask(client, QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0]
    assert r.message.model_extra.get("reasoning_content") is None and r.message.content is None
    assert r.model_extra["token_ids"][0] == ids[CALL_TURN[2]] and r.message.tool_calls[0].function.name == "get_weather"


def test_preserve_thinking_reaches_the_template(agent_server):
    """An assistant turn before the last user message keeps its reasoning in the prompt only with
    preserve_thinking (the template's rule, as Qwen3.6's)."""
    url, ids, client = agent_server
    history = QUESTION + [{"role": "assistant", "content": "Sunny.", "reasoning_content": "I looked."},
                          {"role": "user", "content": "And tomorrow?"}]

    def prompt(**kwargs):
        r = ask(client, history, max_tokens=1, extra_body={"chat_template_kwargs": kwargs})
        return httpx.post(f"{url}/detokenize", json={"tokens": r.model_extra["prompt_token_ids"][0]}).json()["prompt"]

    assert "I looked." in prompt(preserve_thinking=True) and "I looked." not in prompt()


def test_parallel_tool_calls_and_the_refused_choices(agent_server):
    url, ids, client = agent_server
    r = ask(client, QUESTION, parallel_tool_calls=False).choices[0]
    assert len(r.message.tool_calls) == 1
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        ask(client, QUESTION, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="functions"):
        ask(client, QUESTION, extra_body={"functions": [TOOLS[0]["function"]]})


def test_the_api_key_guards_v1_and_leaves_health_open(agent_server):
    url, ids, client = agent_server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["scripted"]
