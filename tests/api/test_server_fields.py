"""The server's request fields beyond generation's core, each through the real `openai` client
(or plain HTTP for vLLM's non-OpenAI routes): every field it does not implement is a 400 naming
it; echo, prompt_logprobs, truncate_prompt_tokens, allowed_token_ids, add_generation_prompt and
continue_final_message equal what the offline API gives; /tokenize, /detokenize, /version; the
`spec-jax serve MODEL` command line."""

import copy

import httpx
import numpy as np
import openai
import pytest
from helpers import TINY
from live_server import live_server

from spec_jax import SamplingParams
from spec_jax.api.chat import ChatTemplate
from spec_jax.api.cli import main
from spec_jax.api.server import Server, build_app
from spec_jax.default_model import train_tokenizer
from spec_jax.loading.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "def fibonacci(n):\n    return n"


@pytest.fixture(scope="module")
def served(tiny_llm, tmp_path_factory):
    d = tmp_path_factory.mktemp("fields")
    train_tokenizer(TINY.vocab_size).save(str(d / "tokenizer.json"))
    (d / "chat.jinja").write_text(CHATML)
    llm = copy.copy(tiny_llm)  # shares the loaded model and its compiled executables
    llm.set_tokenizer(Tokenizer(d / "tokenizer.json"))
    with live_server(build_app(Server(llm, served_model_name="tiny", chat_template=str(d / "chat.jinja"),
                                      steps_per_chunk=2))) as url:
        yield url, llm, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


REFUSED = [({"use_beam_search": True}, "use_beam_search"), ({"length_penalty": 0.5}, "length_penalty"),
           ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
           ({"guided_choice": "a"}, "guided_choice"), ({"guided_decoding_backend": "nope"}, "guided_decoding_backend"),
           ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
           ({"frobnicate": 1}, "frobnicate"), ({"priority": 3}, "priority")]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("fields, name", REFUSED, ids=[n for _, n in REFUSED])
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(served, chat, fields, name):
    url, llm, client = served
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body=fields)
        else:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=fields)
    assert e.value.body["param"] == name and name in e.value.body["message"]


def test_chat_only_refusals_and_neutral_values(served):
    url, llm, client = served
    hi = [{"role": "user", "content": "hi"}]
    for fields, name in (({"functions": [{"name": "f"}]}, "functions"), ({"function_call": "auto"}, "function_call"),
                         ({"echo": True}, "echo")):
        with pytest.raises(openai.BadRequestError, match=name):
            client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, extra_body=fields)
    # neutral values ask for nothing and pass
    r = client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, extra_body={
        "use_beam_search": False, "include_stop_str_in_output": False, "response_format": {"type": "text"}})
    assert r.choices[0].finish_reason == "length"


def generate(llm, ids, **fields):
    return llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(temperature=0.0, **fields),
                        use_tqdm=False)[0]


def test_truncate_prompt_tokens_and_allowed_token_ids_equal_generate(served):
    url, llm, client = served
    ids = llm.tokenizer.encode(TEXT)
    r = client.completions.create(model="tiny", prompt=TEXT, max_tokens=6, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 4, "return_token_ids": True})
    assert r.model_extra["prompt_token_ids"] == [ids[-4:]]
    assert r.choices[0].model_extra["token_ids"] == generate(llm, ids[-4:], max_tokens=6).outputs[0].token_ids
    allowed = [5, 17, 40]
    r = client.completions.create(model="tiny", prompt=TEXT, max_tokens=6, temperature=0,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    assert set(got) <= set(allowed)
    assert got == generate(llm, ids, max_tokens=6, allowed_token_ids=allowed).outputs[0].token_ids
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model="tiny", prompt=TEXT, max_tokens=2, extra_body={"truncate_prompt_tokens": 0})


def test_add_generation_prompt_and_continue_final_message(served):
    url, llm, client = served
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello the"}]

    def prompt(**fields):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                           extra_body={"return_token_ids": True, **fields})
        return llm.tokenizer.decode(r.model_extra["prompt_token_ids"][0], False)

    rendered = ChatTemplate(CHATML).render(messages, {"add_generation_prompt": False})
    assert prompt(add_generation_prompt=False) == rendered
    assert prompt() == rendered + "<|im_start|>assistant\n"
    assert prompt(add_generation_prompt=False, continue_final_message=True) == rendered[:rendered.rindex("the") + 3]
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        prompt(continue_final_message=True)  # a prompt cannot both continue and open a message
    offline = llm.chat(messages, SamplingParams(max_tokens=1), chat_template=CHATML, add_generation_prompt=False,
                       continue_final_message=True, use_tqdm=False)[0]
    assert offline.prompt == prompt(add_generation_prompt=False, continue_final_message=True)


def test_echo_with_logprobs_as_lm_eval_asks(served):
    """lm-evaluation-harness's loglikelihood request: echo with logprobs and one token; the prompt's
    token logprobs are the target's (offline prompt_logprobs), the first one null."""
    url, llm, client = served
    ids = llm.tokenizer.encode(TEXT)
    want = generate(llm, ids, max_tokens=1, logprobs=1, prompt_logprobs=1)
    r = client.completions.create(model="tiny", prompt=TEXT, max_tokens=1, temperature=0, logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text == TEXT + want.outputs[0].text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    offline = [e[t].logprob for t, e in zip(ids[1:], want.prompt_logprobs[1:])]
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], offline, rtol=1e-5, atol=1e-5)
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])] and lp.text_offset[len(ids)] == len(TEXT)
    # as lm-eval sends them: a batch of token-id prompts, each choice echoing its own
    batch = [ids, ids[:5]]
    r = client.completions.create(model="tiny", prompt=batch, max_tokens=1, temperature=0, logprobs=1, echo=True)
    for c, prompt in zip(sorted(r.choices, key=lambda c: c.index), batch):
        assert len(c.logprobs.tokens) == len(prompt) + 1 and c.logprobs.token_logprobs[0] is None
        np.testing.assert_allclose(c.logprobs.token_logprobs[1:len(prompt)], offline[:len(prompt) - 1],
                                   rtol=1e-5, atol=1e-5)
    chunks = list(client.completions.create(model="tiny", prompt=TEXT, max_tokens=3, temperature=0, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text == TEXT
    whole = client.completions.create(model="tiny", prompt=TEXT, max_tokens=3, temperature=0, echo=True)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_prompt_logprobs_equal_generate(served):
    url, llm, client = served
    ids = llm.tokenizer.encode(TEXT)
    want = generate(llm, ids, max_tokens=1, prompt_logprobs=2).prompt_logprobs
    r = client.completions.create(model="tiny", prompt=TEXT, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for entry, ref in zip(got[1:], want[1:]):
        assert {int(t): (x["rank"], x["decoded_token"]) for t, x in entry.items()} == {
            t: (x.rank, x.decoded_token) for t, x in ref.items()}
        np.testing.assert_allclose([entry[str(t)]["logprob"] for t in ref], [x.logprob for x in ref.values()],
                                   rtol=1e-5, atol=1e-5)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"prompt_logprobs": 0})
    scored = r.model_extra["prompt_logprobs"]
    assert scored[0] is None and all(len(e) == 1 for e in scored[1:])  # top 0: the token's own only
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt=TEXT, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})


def test_tokenize_detokenize_version(served):
    url, llm, client = served
    r = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": TEXT, "return_token_strs": True}).json()
    assert r["tokens"] == llm.tokenizer.encode(TEXT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == llm.max_model_len and "".join(r["token_strs"]) == TEXT
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == llm.tokenizer.encode(ChatTemplate(CHATML).render(messages))
    assert httpx.post(f"{url}/detokenize", json={"tokens": llm.tokenizer.encode(TEXT)}).json() == {"prompt": TEXT}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [TINY.vocab_size]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{url}/tokenize", json={"prompt": "a", "messages": messages}).status_code == 400
    assert httpx.get(f"{url}/version").json() == {"version": "0.1.0"}


def test_serve_takes_the_model_as_its_argument(monkeypatch, tiny_dir, capsys):
    import uvicorn

    import spec_jax.api.cli as cli

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    assert main(["serve", str(tiny_dir), "--dtype", "float32", "--max-model-len", "64", "--api-key", "k",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]) == 0
    assert "serving" in capsys.readouterr().err
    monkeypatch.setattr(cli, "load_llm", lambda args: pytest.fail("the model loaded before the flags were checked"))
    assert main(["serve", str(tiny_dir), "--model", "/elsewhere"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["serve", str(tiny_dir), "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_dir), "--tool-call-parser", "mistral"])


def test_tools_need_the_flags_and_a_template_that_renders_them(served):
    """This server runs without --enable-auto-tool-choice, behind a template that never reads
    `tools`: tools with the default tool_choice ("auto") ask for the flags; with "none" the tools
    would never reach the model. Both are a 400 naming the field, not a silent drop."""
    url, llm, client = served
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as e:
        client.chat.completions.create(model="tiny", messages=hi, tools=tools, max_tokens=2)
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="does not render tools") as e:
        client.chat.completions.create(model="tiny", messages=hi, tools=tools, tool_choice="none", max_tokens=2)
    assert e.value.body["param"] == "tools"
