"""The OpenAI-compatible server on a loopback port, driven by the real `openai` client and raw
HTTP; the continuous-batching scheduler under it, with speculation."""

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import json
import os
import re
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from bench.server_soak import rss_mb, soak
from helpers import TINY
from live_server import live_server
from fastapi.testclient import TestClient

from spec_jax import LLM, SamplingParams
from spec_jax.api.chat import ChatTemplate, RequestError, read_chat_template
from spec_jax.api.scheduler import Scheduler
from spec_jax.api.server import Server, build_app
from spec_jax.default_model import train_tokenizer
from spec_jax.loading.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def served(tiny_llm, tmp_path_factory):
    """The tiny model (4 slots, max_model_len 256) with a tokenizer and a chat template, served
    by uvicorn in a thread on a free loopback port."""
    d = tmp_path_factory.mktemp("server")
    train_tokenizer(TINY.vocab_size).save(str(d / "tokenizer.json"))
    (d / "chat.jinja").write_text(CHATML)
    llm = copy.copy(tiny_llm)  # shares the loaded model and its compiled executables
    llm.set_tokenizer(Tokenizer(d / "tokenizer.json"))
    server = Server(llm, served_model_name="tiny", chat_template=str(d / "chat.jinja"), steps_per_chunk=1)
    with live_server(build_app(server)) as url:
        yield url, llm, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def metrics(url) -> dict[str, float]:
    """/metrics parsed: every sample line is `name{labels} value`."""
    return parse_metrics(httpx.get(f"{url}/metrics").text)


def parse_metrics(text: str) -> dict[str, float]:
    """Each sample under its name and labels, the model_name label (on every sample) left out:
    vLLM's names (`vllm:...`) and spec_jax's own (`spec_jax_...`)."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) (vllm:|spec_jax_)\w+ .+", line), line
            continue
        name, labels, value = re.fullmatch(r"((?:vllm:|spec_jax_)\w+)\{model_name=\"[^\"]*\"(,\w+=\"\w+\")?\} (\S+)",
                                           line).groups()
        out[name + (f"{{{labels[1:]}}}" if labels else "")] = float(value)
    return out


def reference(llm, prompts, params):
    """LLM.generate on each prompt alone (text or token ids): batch-1 executables the other
    tests compile too."""
    return [llm.generate(prompts=p, sampling_params=s, use_tqdm=False)[0] if isinstance(p, str) else
            llm.generate(prompt_token_ids=[p], sampling_params=s, use_tqdm=False)[0] for p, s in zip(prompts, params)]


def test_completions_and_chat_equal_generate(served):
    url, llm, client = served
    messages = [[{"role": "user", "content": "Write a loop"}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]]
    chats = [ChatTemplate(CHATML).render(m) for m in messages]
    texts = ["def fibonacci(n):", "import os\nfor"]
    ref = [o.outputs[0] for o in reference(llm, texts + chats, [SamplingParams(max_tokens=12, temperature=0.0)] * 4)]
    def ids(c):
        return c.model_extra["token_ids"]

    r = client.completions.create(model="tiny", prompt=texts[0], max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert (r.choices[0].text, ids(r.choices[0])) == (ref[0].text, ref[0].token_ids)
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(texts[0])) and r.usage.completion_tokens == 12

    stop = ref[0].text[6:9]  # a stop string cuts the text before its first occurrence
    r = client.completions.create(model="tiny", prompt=texts[0], max_tokens=12, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref[0].text[:ref[0].text.find(stop)], "stop")

    chunks = list(client.completions.create(model="tiny", prompt=texts[1], max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref[1].text
    assert sum((ids(c.choices[0]) for c in chunks[:-1]), []) == ref[1].token_ids
    assert chunks[-2].choices[0].finish_reason == ref[1].finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref[1].token_ids)

    r = client.chat.completions.create(model="tiny", messages=messages[0], max_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref[2].text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode(chats[0]))

    stream = client.chat.completions.create(model="tiny", messages=messages[1], max_tokens=12, temperature=0,
                                            stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == ref[3].text


def test_penalties_bias_and_logprobs_equal_generate(served):
    """Penalties, min_p, min_tokens, logit_bias and logprobs through both endpoints give
    LLM.generate's tokens and logprobs, and a plain request running beside them keeps its own
    output (the live batch widens for them and narrows after)."""
    url, llm, client = served
    text, plain_text = "def fibonacci(n):", "import os\nfor"
    ids = llm.tokenize(text)
    fields = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3, min_p=0.05, min_tokens=4,
                  logit_bias={str(ids[-1]): 4.0, "7": -100.0})
    want, plain = reference(llm, [text, plain_text], [SamplingParams(max_tokens=10, temperature=0.0, logprobs=3,
                                                                     **fields),
                                                      SamplingParams(max_tokens=24, temperature=0.0)])
    want, plain = want.outputs[0], plain.outputs[0]
    got = {}

    def run_plain():
        got["plain"] = client.completions.create(model="tiny", prompt=plain_text, max_tokens=24, temperature=0)

    thread = threading.Thread(target=run_plain)
    thread.start()
    extra = {k: fields[k] for k in ("repetition_penalty", "min_p", "min_tokens")} | {"return_token_ids": True}
    r = client.completions.create(model="tiny", prompt=text, max_tokens=10, temperature=0, logprobs=3,
                                  presence_penalty=fields["presence_penalty"],
                                  frequency_penalty=fields["frequency_penalty"], logit_bias=fields["logit_bias"],
                                  extra_body=extra)
    thread.join(timeout=300)
    assert got["plain"].choices[0].text == plain.text
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want.token_ids and c.text == want.text
    assert c.logprobs.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(want.token_ids, want.logprobs)],
                                                      abs=1e-4)
    assert c.logprobs.tokens == [llm.tokenizer.decode([t], False) for t in want.token_ids]
    assert [sorted(d.values()) for d in c.logprobs.top_logprobs] == [
        pytest.approx(sorted(x.logprob for x in e.values()), abs=1e-4) for e in want.logprobs]
    assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset == sorted(c.logprobs.text_offset)

    messages = [{"role": "user", "content": "Write a loop"}]  # the same fields: the same executables
    openai_fields = {k: fields[k] for k in ("presence_penalty", "frequency_penalty", "logit_bias")}
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body=extra, **openai_fields)
    want = reference(llm, [ChatTemplate(CHATML).render(messages)],
                     [SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, **fields)])[0].outputs[0]
    content = chat.choices[0].logprobs.content
    assert [x.logprob for x in content] == pytest.approx(
        [e[t].logprob for t, e in zip(want.token_ids, want.logprobs)], abs=1e-4)
    assert [len(x.top_logprobs) for x in content] == [3] * len(want.token_ids)
    assert all(bytes(x.bytes).decode(errors="replace") == x.token for x in content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True, extra_body=extra,
                                            **openai_fields)
    streamed = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [(x.token, x.logprob) for x in streamed] == [(x.token, x.logprob) for x in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)


def test_sixteen_concurrent_streaming_clients(served):
    """More clients than slots: they queue, reuse freed slots, and each gets exactly its own
    greedy or seeded-sampled output."""
    url, llm, client = served
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, TINY.vocab_size, rng.integers(2, 50)).tolist() for _ in range(16)]
    settings = [dict(max_tokens=int(rng.integers(4, 40)), temperature=float(rng.choice([0.0, 0.8])),
                     top_p=float(rng.choice([1.0, 0.9])), top_k=int(rng.choice([0, 20])),
                     seed=int(rng.integers(1 << 20)))
                for _ in prompts]
    ref = reference(llm, prompts, [SamplingParams(**s) for s in settings])
    before = metrics(url)
    got = [None] * 16

    def run_client(i):
        s = dict(settings[i])
        extra = {"top_k": s.pop("top_k"), "return_token_ids": True}
        stream = client.completions.create(model="tiny", prompt=prompts[i], stream=True, extra_body=extra, **s)
        chunks = [c.choices[0] for c in stream]
        got[i] = sum((c.model_extra["token_ids"] for c in chunks), []), chunks[-1].finish_reason

    threads = [threading.Thread(target=run_client, args=(i,)) for i in range(16)]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    assert got == [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in ref]
    after = metrics(url)
    def finished(m):
        return sum(m[f'vllm:request_success_total{{finished_reason="{r}"}}'] for r in ("stop", "length"))

    assert finished(after) - finished(before) == 16
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == sum(len(o.outputs[0].token_ids) for o in ref)
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0


def test_a_dropped_client_frees_its_slot(served):
    url, llm, client = served
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    before = metrics(url)
    max_tokens = llm.max_model_len - 2
    stream = client.completions.create(model="tiny", prompt=[5], max_tokens=max_tokens, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.time() + 60
    while metrics(url)[aborted] == before[aborted]:
        assert time.time() < deadline, "the server never cancelled the dropped request"
        time.sleep(0.02)
    after = metrics(url)
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < max_tokens
    r = client.completions.create(model="tiny", prompt=[5], max_tokens=3, temperature=0)  # the slot serves again
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def test_abandoned_non_streaming_requests_free_their_slots(served):
    """Clients that time out and hang up mid-request (more of them than there are slots) are
    cancelled, so a request sent after them is served at once."""
    url, llm, client = served
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    before = metrics(url)
    body = {"model": "tiny", "prompt": [5], "max_tokens": llm.max_model_len - 2, "temperature": 0, "ignore_eos": True}

    def abandon():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.5))

    threads = [threading.Thread(target=abandon) for _ in range(6)]  # 4 slots: 2 wait in the queue
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 60
    while metrics(url)[aborted] < before[aborted] + 6:
        cancelled = metrics(url)[aborted] - before[aborted]
        assert time.time() < deadline, f"{cancelled:.0f} of 6 abandoned requests cancelled"
        time.sleep(0.05)
    assert metrics(url)["vllm:num_requests_running"] == 0
    t = time.perf_counter()
    r = client.completions.create(model="tiny", prompt=[5], max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1 and time.perf_counter() - t < 10


BAD = [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature", None),
    ({"prompt": "x", "n": 0}, 400, "n", None),
    ({"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": [1] * 300}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": [1] * 100, "max_tokens": 200}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": [TINY.vocab_size]}, 400, "prompt", None),
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
    ({"prompt": "x", "logit_bias": {str(TINY.vocab_size): 1.0}}, 400, "logit_bias", None),
    ({"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ({"prompt": "x", "stop_token_ids": list(range(17))}, 400, "stop_token_ids", None),
    ({"max_tokens": 3}, 400, "prompt", None),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ({"prompt": "x", "top_k": 2**40}, 400, "top_k", None),  # past int32 on the device
    ({"prompt": "x", "top_k": 2**70}, 400, "top_k", None),
    ({"prompt": "x", "seed": 2**70}, 400, "seed", None),
    ({"prompt": "x", "stop_token_ids": [2**40]}, 400, "stop_token_ids", None),
    ({"prompt": "x", "stop_token_ids": [TINY.vocab_size]}, 400, "stop_token_ids", None),
    ({"prompt": "x", "n": 2.0}, 400, "n", None),  # no coercion: a count is an integer
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ({"prompt": [True]}, 400, "prompt", None),  # one of several forms: the field, not pydantic's branch
    ({"prompt": 5}, 400, "prompt", None),
    ({"prompt": "x", "stop": [1, 2]}, 400, "stop", None),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    ({"prompt": "x", "max_tokens": None, "min_tokens": 2**31 - 1}, 400, "min_tokens", None),
    ({"prompt": ["x"] * 3, "n": 2000}, 400, "n", None),  # 6000 completions in one request
    ({"prompt": ["x", ""]}, 400, "prompt[1]", None),
]


@pytest.mark.parametrize("body,status,param,code", BAD, ids=lambda x: None)
def test_bad_completion_requests_get_error_bodies(served, body, status, param, code):
    url = served[0]
    r = httpx.post(f"{url}/v1/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == status and set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["param"] == param and error["code"] == code


def test_non_finite_temperature_is_refused(served):
    r = httpx.post(f"{served[0]}/v1/completions", content=b'{"model": "tiny", "prompt": "x", "temperature": 1e999}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"


@pytest.mark.parametrize("content, status, rendered", [
    ([{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}], 200, "hi\nthere"),
    (None, 200, ""),
    ("plain", 200, "plain"),
    (5, 400, None),
    ([{"type": "image_url", "image_url": {"url": "http://x"}}], 400, None),
])
def test_chat_content_parts_are_flattened_as_openai_does(served, content, status, rendered):
    url, llm, _ = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    if status == 200:
        expected = llm.tokenizer.encode(f"<|im_start|>user\n{rendered}<|im_end|>\n<|im_start|>assistant\n")
        assert r.json()["prompt_token_ids"] == [expected]
    else:
        assert r.json()["error"]["param"] == "messages" and "messages[0].content" in r.json()["error"]["message"]


def test_chat_template_kwargs_may_not_clash(served):
    url = served[0]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "chat_template_kwargs": {"add_generation_prompt": False},
                                                        "return_token_ids": True})
    assert r.status_code == 200 and not served[1].tokenizer.decode(r.json()["prompt_token_ids"][0]).endswith(
        "assistant\n")


def test_malformed_bodies_and_unknown_routes(served):
    url, _, client = served
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(f"{url}/v1/nothing").status_code == 404
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=-1)


def test_bodies_that_are_no_json_object_say_what_is_expected(served):
    url = served[0]
    r = httpx.post(f"{url}/v1/completions")
    assert r.status_code == 400 and "body is empty" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/completions", data={"prompt": "x"})  # form-encoded, as curl -d sends it
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    assert httpx.head(f"{url}/health").status_code == 200
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "a\\ud800b"}',  # JSON's escape of a lone surrogate
                   headers={"Content-Type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt" and "surrogate" in error["message"]


def test_a_seed_at_the_top_of_its_range_fans_out(served):
    r = httpx.post(f"{served[0]}/v1/completions", json={"prompt": "x", "max_tokens": 2, "seed": 2**63 - 1, "n": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_a_stop_string_cuts_token_ids_logprobs_and_usage_and_counts_as_stop(served):
    """The completion ends with the token that completes the stop string (as LLM.generate's), in
    its token_ids, logprobs and usage, streamed or not, though the scheduler hands over 8 tokens a
    chunk; /metrics counts it as "stop"."""
    llm = served[1]
    body = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = llm.generate(prompts=body["prompt"], sampling_params=greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 3:len(text) // 3 + 2]
    assert stop.strip(), text
    want = llm.generate(prompts=body["prompt"], use_tqdm=False, sampling_params=dataclasses.replace(
        greedy, stop=[stop], logprobs=1))[0].outputs[0]
    assert len(want.token_ids) < 24 - 8
    body |= {"stop": [stop], "logprobs": 1, "return_token_ids": True}
    stopped = 'vllm:request_success_total{finished_reason="stop"}'
    with TestClient(build_app(Server(llm, steps_per_chunk=8))) as client:
        before = parse_metrics(client.get("/metrics").text)
        r = client.post("/v1/completions", json=body).json()
        c = r["choices"][0]
        assert c["text"] == want.text and c["finish_reason"] == "stop" and c["token_ids"] == want.token_ids
        assert len(c["logprobs"]["tokens"]) == len(want.token_ids) == r["usage"]["completion_tokens"]
        with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        streamed = [x for ch in chunks for x in ch["choices"]]
        assert [t for x in streamed for t in x.get("token_ids", [])] == want.token_ids
        assert "".join(x["text"] for x in streamed) == want.text
        offsets = [o for x in streamed if x["logprobs"] for o in x["logprobs"]["text_offset"]]
        assert offsets == c["logprobs"]["text_offset"]  # streamed offsets count the tokens' texts too
        held_back = body | {"stop": ["Q" * 12]}  # never met, but 11 characters wait behind each chunk
        whole = client.post("/v1/completions", json=held_back).json()["choices"][0]["logprobs"]["text_offset"]
        with client.stream("POST", "/v1/completions", json=held_back | {"stream": True}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert [o for ch in chunks for x in ch["choices"] if x["logprobs"] for o in x["logprobs"]["text_offset"]
                ] == whole and len(whole) == 24
        deadline = time.time() + 30
        while parse_metrics(client.get("/metrics").text)[stopped] < before[stopped] + 2 and time.time() < deadline:
            time.sleep(0.1)
        after = parse_metrics(client.get("/metrics").text)
    assert after[stopped] == before[stopped] + 2
    aborted = 'vllm:request_success_total{finished_reason="abort"}'
    assert after[aborted] == before[aborted]


def test_models_health_metrics(served):
    url, llm, client = served
    assert httpx.get(f"{url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]
    m = metrics(url)
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:spec_decode_num_drafts_total",
                 "spec_jax_spec_decode_acceptance_rate", "spec_jax_spec_decode_mean_acceptance_length"):
        assert name in m
    assert 'model_name="tiny"' in httpx.get(f"{url}/metrics").text


def test_chat_without_a_template_is_refused(tiny_llm, tiny_dir):
    assert read_chat_template(tiny_dir) is None
    with TestClient(build_app(Server(tiny_llm))) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_chat_template_from_tokenizer_config(tmp_path):
    """HF's conventions: a list of named templates, tojson, raise_exception, bos/eos strings."""
    template = ("{{ bos_token }}{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                "{{ raise_exception('bad role ' + m.role) }}{% endif %}{{ m.role }}:{{ m.content | tojson }}"
                "{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
         "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]}))
    chat = ChatTemplate(read_chat_template(tmp_path), "<s>", "</s>")
    assert chat.render([{"role": "user", "content": "é"}]) == '<s>user:"é"</s>'
    with pytest.raises(RequestError, match="bad role tool"):
        chat.render([{"role": "tool", "content": "x"}])


ECHO_SPEC = {"method": "mtp", "num_speculative_tokens": 3}  # test_speculative compiles the same


def test_scheduler_speculates_per_slot(echo_dir):
    """Eight requests through four slots with MTP drafting, two with penalties and logprobs:
    tokens, logprobs and each request's draft and acceptance counts equal LLM.generate's; the
    totals add up. At a fixed k: adaptive verification chooses from the batch around a request
    and the measured step times, so only its tokens would match."""
    llm = LLM(model=str(echo_dir), dtype="float32", max_model_len=128, max_num_seqs=4,
              speculative_config={**ECHO_SPEC, "enable_adaptive_verification": False})
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 60, rng.integers(3, 40)).tolist() for _ in range(8)]
    # The live batch widens for these (to MAX_LOGPROBS: generate's batches have the same shapes).
    penalized = dict(presence_penalty=0.4, repetition_penalty=1.3, logprobs=20)
    params = [SamplingParams(max_tokens=int(rng.integers(5, 40)), temperature=0.0, ignore_eos=True,
                             speculative=bool(i % 3), **(penalized if i % 4 == 1 else {})) for i in range(8)]
    ref = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    scheduler = Scheduler(llm.engine, steps_per_chunk=2).start()
    results = [None] * 8

    def run(i):
        updates = list(scheduler.stream(prompts[i], params[i]))
        results[i] = (sum((u.token_ids for u in updates), []), updates[-1].metrics,
                      sum((u.logprobs or [] for u in updates), []))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join(timeout=300) for t in threads]
    stats = scheduler.stats()
    scheduler.shutdown()
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_per_position")
    for (tokens, m, logprobs), out in zip(results, ref):
        assert tokens == out.outputs[0].token_ids
        head = lambda entries: [{t: x.logprob for t, x in e.items() if x.rank <= 3} for e in entries]  # noqa: E731
        assert head(logprobs) == [pytest.approx(e, rel=1e-4, abs=1e-4) for e in head(out.outputs[0].logprobs or [])]
        assert {k: m[k] for k in keys} == {k: out.metrics[k] for k in keys}
    assert stats["num_accepted_tokens"] == sum(o.metrics["num_accepted_tokens"] for o in ref) > 0
    assert stats["requests_length"] == 8 and stats["running"] == stats["waiting"] == 0


def test_n_choices_per_prompt(served):
    """n > 1 fans each prompt out into n rows: choices numbered prompt x n + i, the i-th seeded
    seed + i as LLM.generate does, prompt tokens counted once per prompt."""
    url, llm, client = served
    r = client.completions.create(model="tiny", prompt=["def f(", "class A"], max_tokens=6, temperature=1.0, n=2,
                                  seed=3, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    ids = [llm.tokenize("def f("), llm.tokenize("class A")]
    want = [llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(temperature=1.0, max_tokens=6, seed=s,
                                                                              ignore_eos=True), use_tqdm=False)[0]
            for p in ids for s in (3, 4)]
    assert [c.token_ids for c in r.choices] == [w.outputs[0].token_ids for w in want]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == 24


TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                  "{% for call in m.tool_calls or [] %}{% if call.function %}{% set call = call.function %}{% endif %}"
                  "<tool_call>{{ call.name }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
                  "{% for d in documents or [] %}{{ d }}{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_client(served, tmp_path_factory):
    """The served model behind a chat template that iterates `tools` and each message's `tool_calls`."""
    template = tmp_path_factory.mktemp("tools") / "tools.jinja"
    template.write_text(TOOLS_TEMPLATE)
    with TestClient(build_app(Server(served[1], chat_template=str(template))), raise_server_exceptions=False) as client:
        yield client


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("fields, param, named", [
    ({"chat_template_kwargs": {"tools": 5}}, "chat_template_kwargs", "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"tools": True}}, "chat_template_kwargs", "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": {"tools": [5]}}, "chat_template_kwargs", "chat_template_kwargs.tools[0]"),
    ({"chat_template_kwargs": {"tools": [{"function": "str"}]}}, "chat_template_kwargs",
     "chat_template_kwargs.tools[0].function"),
    ({"tool_calls": 5}, "messages", "messages[1].tool_calls"),
    ({"tool_calls": True}, "messages", "messages[1].tool_calls"),
    ({"tool_calls": [5]}, "messages", "messages[1].tool_calls[0]"),
    ({"tool_calls": [{"function": "str"}]}, "messages", "messages[1].tool_calls[0].function"),
    ({"tool_calls": [{"function": {"name": "f", "arguments": 5}}]}, "messages",
     "messages[1].tool_calls[0].function.arguments"),
    ({"tools": 5}, "tools", "tools"),
])
def test_malformed_tools_and_tool_calls_are_refused_naming_the_field(tool_client, fields, param, named):
    """A template that loops over tools or tool calls never meets a value of the wrong shape: the
    request is a 400 in OpenAI's error body naming the field, not a template crash."""
    calls = fields.pop("tool_calls", None)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "user", "content": "go on"}]
    r = tool_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and named in error["message"], error


def test_well_formed_tools_and_tool_calls_reach_the_template(tool_client, served):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    r = tool_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "return_token_ids": True,
                                                       "chat_template_kwargs": {"tools": [tool]}})
    assert r.status_code == 200, r.text
    prompt = ChatTemplate(TOOLS_TEMPLATE).render(messages, {"tools": [tool]})
    assert '"lookup"' in prompt and "<tool_call>f</tool_call>" in prompt
    assert r.json()["prompt_token_ids"] == [served[1].tokenizer.encode(prompt)]


def test_a_template_failing_on_a_request_is_a_400(tool_client):
    """Whatever the template cannot render for a request's values is the request's fault, not a 500."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = tool_client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"documents": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "TypeError" in r.json()["error"]["message"]


def test_steps_per_chunk_is_bounded_at_start_up(monkeypatch, capsys, tiny_dir, tiny_llm):
    """More steps a chunk than max_model_len is refused before serving, naming the flag and the range."""
    import uvicorn

    from spec_jax.api.cli import main

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("served with an unbounded --steps-per-chunk"))
    for steps in ("99999999999", "2147483647", "257", "0"):
        assert main(["serve", "--model", str(tiny_dir), "--dtype", "float32", "--max-model-len", "256",
                     "--steps-per-chunk", steps]) == 2
        assert "--steps-per-chunk" in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps_per_chunk=2147483647 must be 1 to 256"):
        Scheduler(tiny_llm.engine, steps_per_chunk=2**31 - 1)


def test_a_failed_warm_up_stops_the_server(tiny_llm, monkeypatch):
    """A program that fails while warming up ends start-up with its error; nothing is served."""
    server = Server(tiny_llm)

    def fail(*args):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    monkeypatch.setattr(server.scheduler.core, "decode", fail)
    with pytest.raises(RuntimeError, match="warm-up failed: RuntimeError: RESOURCE_EXHAUSTED"):
        with TestClient(build_app(server)):
            pass
    assert not server.scheduler.thread.is_alive()


def test_request_preparation_runs_off_the_event_loop(served, monkeypatch):
    """Checking a request's fields and rows (n of them, bad words tokenized for each) and rendering
    its chat prompt run in worker threads: the event loop only moves bytes, so /health and other
    streams keep answering while a large request is prepared."""
    url, llm, client = served
    on_loop = []

    def watch(name, fn):
        def spy(*args, **kwargs):
            with contextlib.suppress(RuntimeError):  # no running loop: a worker or the scheduler thread
                asyncio.get_running_loop()
                on_loop.append(name)
            return fn(*args, **kwargs)
        return spy

    for name in ("check_params", "bad_word_forms", "tokenize"):
        monkeypatch.setattr(llm, name, watch(name, getattr(llm, name)))
    monkeypatch.setattr(SamplingParams, "__post_init__", watch("SamplingParams", SamplingParams.__post_init__))
    monkeypatch.setattr(ChatTemplate, "render", watch("render", ChatTemplate.render))
    r = client.completions.create(model="tiny", prompt=["def f(", "x"], max_tokens=2, n=8, temperature=1.0,
                                  extra_body={"bad_words": ["if", "return x"]})
    assert len(r.choices) == 16
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=3,
                                       extra_body={"bad_words": ["if"]})
    assert len(r.choices) == 3
    assert on_loop == []


@pytest.mark.parametrize("field, value", [("repetition_penalty", 1e-300), ("repetition_penalty", 1e308),
                                          ("temperature", 1e39), ("temperature", 1e-40), ("top_p", 1e-300),
                                          ("min_p", 1e-45), ("presence_penalty", -1e-320)])
def test_float_fields_are_checked_in_float32(served, field, value):
    """The device holds these fields in float32: a value that would become 0 or inf there (or a
    denormal, whose reciprocal overflows) is refused by name, though float64 holds it."""
    r = httpx.post(f"{served[0]}/v1/completions", json={"prompt": "x", "max_tokens": 1, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "float32" in r.json()["error"]["message"]


def test_best_of_equal_to_n_is_accepted(served):
    """vLLM takes best_of == n (n samples, all returned); any other best_of is refused by name."""
    r = httpx.post(f"{served[0]}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    r = httpx.post(f"{served[0]}/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_no_combination_of_logit_processors_compiles_while_serving(served):
    """After start-up, requests with any combination of logit processors and logprobs, beside a
    plain stream, run on programs compiled at start-up: the live batch never stops for a compile."""
    url, llm, client = served
    programs = len(llm.engine.runner.executables)
    fields = {"min_p": {"min_p": 0.1}, "bias": {"logit_bias": {"7": -100.0}}, "min_tokens": {"min_tokens": 2},
              "penalties": {"repetition_penalty": 1.2}, "bad_words": {"bad_words": ["return x"]},
              "logprobs": {"logprobs": 2}}
    combos = [dict(kv for name in names for kv in fields[name].items())
              for r in (1, 2, 5) for names in itertools.combinations(sorted(fields), r)]
    plain = threading.Thread(target=lambda: client.completions.create(model="tiny", prompt="x", max_tokens=60,
                                                                      temperature=0, extra_body={"ignore_eos": True}))
    plain.start()
    for extra in combos:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(", "max_tokens": 3, "temperature": 0.5,
                                                      **extra}, timeout=300)
        assert r.status_code == 200, r.text
    plain.join(timeout=300)
    assert len(llm.engine.runner.executables) == programs


def test_soak_short_form(served):
    """bench.server_soak's load mix in 10 short rounds with dropped clients: every request not
    dropped completes (no 5xx, every stream ends with [DONE]), greedy and seeded outputs are the
    same every round, and nothing compiles after the first round, so memory stays flat."""
    url, llm, _ = served
    rows = soak(url, rounds=10, requests=14, clients=4, drop_every=5,
                probe=lambda: {"rss_mb": rss_mb(os.getpid()), "programs": len(llm.engine.runner.executables)})
    for row in rows:
        assert row["completed"] + row["dropped"] == row["requests"] and row["dropped"] == 2, row
        assert row["mismatches"] == 0 and row["compared"] == (12 if row["round"] > 1 else 0), row
    assert len({row["programs"] for row in rows}) == 1, [row["programs"] for row in rows]
    print("RSS per round (MB):", [round(row["rss_mb"]) for row in rows])
