"""An OpenAI-compatible HTTP server over the continuous-batching `Scheduler`.

    spec-jax serve --model DIR --speculative-config '{"method":"mtp","num_speculative_tokens":2}'
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "DIR", "prompt": "def f(x):", "max_tokens": 16, "temperature": 0}'

Endpoints: /v1/completions, /v1/chat/completions (both stream with server-sent events ending in
`data: [DONE]`), /v1/models, /health, /version, /tokenize, /detokenize, /metrics (Prometheus
text, vLLM's names). With --api-key, the /v1 routes want `Authorization: Bearer KEY` (401
otherwise); the others stay open, as in vLLM. Extensions beyond OpenAI's fields, spelled like
vLLM's: top_k, min_p, repetition_penalty, min_tokens, bad_words, allowed_token_ids,
stop_token_ids, ignore_eos, skip_special_tokens, return_token_ids, truncate_prompt_tokens,
prompt_logprobs, chat_template_kwargs, add_generation_prompt, continue_final_message, and the
per-request `speculative` opt-out. Penalties, logit_bias, logprobs and structured output
(response_format, structured_outputs, guided_*; `openai_requests.structured_output`) hold with
speculation on, as offline. A field the server does not implement is a 400 naming it (`openai_requests.refuse_unknown`).

Chat answers are split into reasoning, content and tool calls by the parsers the server was
started with (`chat_requests.ChatParsers`, `chat_output`). With a reasoning parser, which the engine
shares, structured output and forced tool calls hold the answer after the reasoning
(`spec_jax.engine.reasoning_grammar`).

Chat prompts are rendered from the checkpoint's own template (`chat.ChatTemplate`: tokenizer_config.json's
`chat_template`, or chat_template.jinja beside it, or `--chat-template FILE`). A checkpoint without one
has no fallback: chat requests get a 400 that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from spec_jax.api.chat import ChatTemplate, RequestError
from spec_jax.api.chat_output import ChatChoiceText, ChatDelta, chat_message
from spec_jax.api.chat_requests import (ChatParsers, chat_constraint, check_tools, template_messages, tool_call_parser,
                                        tool_choice)
from spec_jax.api.llm import LLM
from spec_jax.api.logprobs_format import LogprobsFormat, prompt_logprobs_json
from spec_jax.api.openai_requests import (APIError, ChatBody, CompletionBody, SamplingFields, body_error,
                                          refuse_unknown, sampling_params, stop_strings, structured_output)
from spec_jax.api.prometheus import prometheus_text
from spec_jax.api.reasoning import prompt_opens_reasoning
from spec_jax.api.scheduler import Scheduler, Update
from spec_jax.api.utility_routes import add_utility_routes, check_api_key
from spec_jax.engine.detokenize import TextDelta
from spec_jax.engine.params import SamplingParams, fan_out


# ----------------------------------------------------------------------------- the app


class Server:
    """What the endpoints share: the model, its scheduler, its served name and chat template, the
    parsers chat answers go through, and the API key clients must send (None: no key)."""

    def __init__(self, llm: LLM, *, served_model_name: str | None = None, chat_template: str | None = None,
                 steps_per_chunk: int = 4, parsers: ChatParsers = ChatParsers(), api_key: str | None = None):
        if parsers.reasoning_parser != llm.engine.config.reasoning_parser:
            raise ValueError(f"the server splits reasoning with reasoning_parser={parsers.reasoning_parser!r} but the "
                             f"engine's grammars follow reasoning_parser={llm.engine.config.reasoning_parser!r}; "
                             f"give both the same (LLM(reasoning_parser=...) and ChatParsers(reasoning_parser=...))")
        self.llm = llm
        self.name = served_model_name or str(llm.model_path)
        self.scheduler = Scheduler(llm.engine, steps_per_chunk=steps_per_chunk)
        self.chat_template = ChatTemplate.of_checkpoint(llm.model_path, chat_template)
        self.parsers, self.api_key = parsers, api_key
        self.created = int(time.time())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def encode(self, prompt, param: str, truncate: int | None = None) -> list[int]:
        """Text or token ids -> checked token ids; truncate (vLLM's truncate_prompt_tokens): keep
        only the last that many (-1: max_model_len - 1, the most that leaves room for a token)."""
        try:
            if truncate is not None:
                if not (truncate == -1 or truncate >= 1):
                    raise APIError(400, f"truncate_prompt_tokens={truncate} must be a positive number of tokens or "
                                        f"-1 (as many as fit)", param="truncate_prompt_tokens")
                keep = self.llm.max_model_len - 1 if truncate == -1 else truncate
                prompt = (self.llm.engine.encode(prompt, param) if isinstance(prompt, str) else list(prompt))[-keep:]
            return self.llm.tokenize(prompt, param)
        except (TypeError, ValueError) as e:
            code = "context_length_exceeded" if "max_model_len" in str(e) else None
            raise APIError(400, str(e), param=param, code=code) from None

    def check_room(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.llm.max_model_len
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} in the "
                                f"completion). Reduce the prompt or max_tokens.", param=param,
                           code="context_length_exceeded")

    async def choices(self, prompts: list[list[int]], params: SamplingParams,
                      stops: list[str]) -> AsyncIterator[tuple[int, str, Update]]:
        """Run each prompt's params.n choices (`fan_out`) through the scheduler; yield (choice
        index = prompt index x n + i, text delta, the scheduler's `Update` with finish_reason
        "stop" at a stop string) as tokens arrive. The rows are checked in a worker thread (n of
        them take a while); leaving early cancels what runs."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()

        def sink(index):
            return lambda update: loop.call_soon_threadsafe(updates.put_nowait, (index, update))

        def checked_rows():
            children = fan_out(params)
            return [self.scheduler.request(ids, p, sink(i * len(children) + j))
                    for i, ids in enumerate(prompts) for j, p in enumerate(children)]

        requests = await asyncio.to_thread(checked_rows)
        self.scheduler.enqueue(requests)  # no await between queueing them and the cancelling `finally`
        texts = [TextDelta(self.llm.tokenizer, r.params.skip_special_tokens, stops) for r in requests]
        running = set(range(len(requests)))
        try:
            while running:
                i, update = await updates.get()
                if i not in running:
                    continue
                seen = len(texts[i].ids)
                delta = texts[i].add(update.token_ids, final=update.finish_reason is not None)
                if texts[i].stopped:  # a stop string: the tokens after the one completing it are not wanted
                    self.scheduler.cancel(requests[i], "stop")
                    keep = texts[i].kept - seen
                    update = dataclasses.replace(update, token_ids=update.token_ids[:keep], finish_reason="stop",
                                                 logprobs=update.logprobs and update.logprobs[:keep])
                if update.finish_reason is not None:
                    running.discard(i)
                yield i, delta, update
        finally:
            for req in requests:
                self.scheduler.cancel(req)


def prepare_completion(server: Server, body: CompletionBody) -> tuple[SamplingParams, list[list[int]]]:
    """A completion request's checked SamplingParams and prompts' token ids (with room for
    max_tokens): long texts take seconds to tokenize, so it runs in a worker thread."""
    params = sampling_params(server.llm, body, body.max_tokens, structured_output(body))
    prompts = completion_prompts(server, body.prompt, params.n, body.truncate_prompt_tokens)
    for ids in prompts:
        server.check_room(ids, body.max_tokens, "max_tokens")
    return params, prompts


def prepare_chat(server: Server, body: ChatBody) -> tuple[SamplingParams, list[int], object]:
    """A chat request's checked SamplingParams, rendered prompt's token ids (with room for
    max_tokens), and a maker of each choice's `ChatChoiceText`; like `prepare_completion`, it runs
    in a worker thread."""
    template = server.chat_template
    if template is None:
        raise APIError(400, f"{server.llm.model_path} has no chat template (no chat_template in its "
                            f"tokenizer_config.json, no chat_template.jinja); start the server with "
                            f"--chat-template FILE, or use /v1/completions", param="messages")
    if not body.messages or any(not isinstance(m.get("role"), str) for m in body.messages):
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    check_tools(body)
    choice = tool_choice(body, server.parsers)
    constraint = chat_constraint(body, choice)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(server.llm, body, max_tokens, constraint)
    extra = {"add_generation_prompt": body.add_generation_prompt, **(body.chat_template_kwargs or {})}
    if body.tools is not None:
        extra["tools"] = body.tools
    if extra.get("tools") and "tools" not in template.variables:
        raise APIError(400, "this model's chat template does not render tools, so the model would never see them; "
                            "start the server with a --chat-template that does, or leave tools unset", param="tools")
    try:
        prompt = template.render(template_messages(body.messages), extra, body.continue_final_message)
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    ids = server.encode(prompt, "messages", body.truncate_prompt_tokens)
    server.check_room(ids, max_tokens, "max_tokens")
    reasoning = prompt_opens_reasoning(prompt) if server.parsers.reasoning_parser else None
    return params, ids, lambda: ChatChoiceText(reasoning, tool_call_parser(body, server.parsers, choice))


def completion_prompts(server: Server, prompt, n: int, truncate: int | None) -> list[list[int]]:
    """OpenAI's prompt forms: a string, token ids, or a list of either; at most MAX_ROWS rows
    with each prompt's n choices."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompt) * n > MAX_ROWS:
        raise APIError(400, f"{len(prompt)} prompts x n={n} choices = {len(prompt) * n} completions; at most "
                            f"{MAX_ROWS} are accepted per request", param="n" if n > 1 else "prompt")
    return [server.encode(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]", truncate) for i, p in enumerate(prompt)]


def usage(prompts: list[list[int]], generated: list[list[int]]) -> dict:
    p, c = sum(map(len, prompts)), sum(map(len, generated))
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


MAX_ROWS = 4096  # completions (prompts x n) one request may ask for: the cap SamplingParams puts on n alone

# How often a non-streaming request looks whether its client is still connected.
DISCONNECT_POLL_S = 0.2


async def unless_client_leaves(work, client_gone) -> bool:
    """Await the coroutine `work` while polling `client_gone()`. If the client leaves first,
    cancel `work` (its scheduler requests free their slots at the next chunk) and return False."""
    task = asyncio.ensure_future(work)
    while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
        if await client_gone():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return False
    task.result()  # re-raise what the work raised
    return True


def prompt_entries(server: Server, body: SamplingFields, prompts: list[list[int]]) -> list[list] | None:
    """Each prompt's logprob entries (None first), when the request shows them: vLLM's
    prompt_logprobs, or completions' echo with logprobs. The target scores the whole prompt once."""
    echoed = getattr(body, "echo", False) and body.logprobs is not None
    if body.prompt_logprobs is None and not echoed:
        return None
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are given in whole responses only, not with stream=true",
                       param="prompt_logprobs")
    num = max(body.prompt_logprobs or 0, body.logprobs or 0 if echoed else 0)
    params = SamplingParams(prompt_logprobs=num, max_tokens=1)
    return [server.llm.engine.prompt_logprobs(ids, params) for ids in prompts]


def echo_texts(server: Server, body: SamplingFields, prompts: list[list[int]]) -> list[str] | None:
    """completions' echo: each prompt's text, which its choices' text starts with."""
    if not getattr(body, "echo", False):
        return None
    if server.llm.tokenizer is None:
        raise APIError(400, "echo needs the model's tokenizer to write the prompt's text; this model has none",
                       param="echo")
    return [server.llm.tokenizer.decode(ids, False) for ids in prompts]


async def complete(server: Server, body: SamplingFields, prompts: list[list[int]], params: SamplingParams,
                   client_gone, chat_text=None, scored=None):
    """Both endpoints' response: one JSON body, or a stream of OpenAI chunks. A request's n
    choices per prompt run as rows (`fan_out`); choice index = prompt index x n + i, as OpenAI
    numbers them. chat_text: for chat, the maker of each choice's `ChatChoiceText`; scored: the
    prompts' logprob entries (`prompt_entries`). client_gone(): whether the client disconnected
    (a non-streaming request stops then; a stream stops when its next write fails)."""
    chat = chat_text is not None
    stops = stop_strings(body)
    rows = len(prompts) * params.n
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if body.stream and chat else
            "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": server.name}
    generated: list[list[int]] = [[] for _ in range(rows)]
    logprobs = None if params.logprobs is None else LogprobsFormat(server.llm.tokenizer, chat, params.logprobs)
    echoes = None if chat else await asyncio.to_thread(echo_texts, server, body, prompts)
    texts = [chat_text() for _ in range(rows)] if chat else None
    prompt_of = [i // params.n for i in range(rows)]

    def reason_of(i: int, reason: str | None) -> str | None:
        return "tool_calls" if chat and reason == "stop" and texts[i].called else reason

    def echoed(i: int) -> dict:
        """The first piece of an echoing choice: its prompt's text (and the prompt's logprobs)."""
        ids = prompts[prompt_of[i]]
        return {"index": i, "text": echoes[prompt_of[i]], "finish_reason": None,
                "logprobs": logprobs(ids, scored[prompt_of[i]]) if logprobs else None}

    def choice(i: int, text, ids: list[int], reason: str | None, final_body: bool, entries, offset=0) -> dict:
        if chat and final_body:
            content = {"message": chat_message(text)}
        elif chat:
            content = {"delta": text.stream_fields()}
        else:
            content = {"text": text}
        out = {"index": i, **content, "logprobs": logprobs(ids, entries, offset) if logprobs else None,
               "finish_reason": reason_of(i, reason)}
        if body.return_token_ids:
            out["token_ids"] = ids
        return out

    if not body.stream:
        parts = [ChatDelta() if chat else "" for _ in range(rows)]
        reasons: list[str | None] = [None] * rows
        entries: list[list] = [[] for _ in range(rows)]

        async def collect():
            async for i, delta, update in server.choices(prompts, params, stops):
                if update.error:
                    raise APIError(500, f"generation failed: {update.error}", type="server_error")
                if chat:
                    parts[i].add(texts[i].feed(delta))
                    if update.finish_reason is not None:
                        parts[i].add(texts[i].finish())
                else:
                    parts[i] += delta
                generated[i] += update.token_ids
                entries[i] += update.logprobs or []
                reasons[i] = update.finish_reason

        if not await unless_client_leaves(collect(), client_gone):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        choices = [choice(i, parts[i], generated[i], reasons[i], True, entries[i]) for i in range(rows)]
        for i, c in enumerate(choices):
            if echoes is not None:
                ids = prompts[prompt_of[i]]
                c["text"] = echoes[prompt_of[i]] + c["text"]
                c["logprobs"] = logprobs(ids + generated[i], scored[prompt_of[i]] + entries[i]) if logprobs else None
            if scored is not None and body.prompt_logprobs is not None and not chat:
                c["prompt_logprobs"] = prompt_logprobs_json(prompts[prompt_of[i]], scored[prompt_of[i]],
                                                            body.prompt_logprobs)
        out = {**head, "choices": choices, "usage": usage(prompts, generated)}
        if chat and scored is not None:
            out["prompt_logprobs"] = prompt_logprobs_json(prompts[0], scored[0], body.prompt_logprobs)
        if body.return_token_ids:
            out["prompt_token_ids"] = prompts
        return JSONResponse(out)

    async def events():
        if chat:
            for i in range(rows):
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        offsets = [0] * rows
        if echoes is not None:
            for i in range(rows):
                yield sse({**head, "choices": [echoed(i)]})
                offsets[i] = len(echoes[prompt_of[i]])
        async for i, delta, update in server.choices(prompts, params, stops):
            if update.error:
                yield sse(APIError(500, f"generation failed: {update.error}", type="server_error").body())
                break
            ids, reason = update.token_ids, update.finish_reason
            generated[i] += ids
            if chat:
                delta = texts[i].feed(delta)
                if reason is not None:
                    delta.add(texts[i].finish())
            said = bool(delta.stream_fields()) if chat else bool(delta)
            if said or reason is not None or ((body.return_token_ids or logprobs) and ids):
                yield sse({**head, "choices": [choice(i, delta, ids, reason, False, update.logprobs or [],
                                                      offsets[i])]})
            offsets[i] += logprobs.span(ids) if logprobs else 0  # token texts, as the whole body counts them
        if (body.stream_options or {}).get("include_usage"):
            yield sse({**head, "choices": [], "usage": usage(prompts, generated)})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def build_app(server: Server) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the scheduler thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.scheduler.start()
        try:
            await asyncio.to_thread(server.scheduler.warm_up)
            yield
        finally:
            await asyncio.to_thread(server.scheduler.shutdown)

    app = FastAPI(title="spec_jax", lifespan=lifespan)
    check_api_key(app, server.api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError):
        error = body_error(e.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "spec_jax", "max_model_len": server.llm.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(server.scheduler.stats(), server.name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        server.check_model(body.model)
        refuse_unknown(body)
        params, prompts = await asyncio.to_thread(prepare_completion, server, body)
        scored = await asyncio.to_thread(prompt_entries, server, body, prompts)
        return await complete(server, body, prompts, params, request.is_disconnected, scored=scored)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        server.check_model(body.model)
        refuse_unknown(body)
        params, ids, chat_text = await asyncio.to_thread(prepare_chat, server, body)
        scored = await asyncio.to_thread(prompt_entries, server, body, [ids])
        return await complete(server, body, [ids], params, request.is_disconnected, chat_text, scored)

    add_utility_routes(app, server)
    return app
