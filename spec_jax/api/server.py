"""An OpenAI-compatible HTTP server over the continuous-batching `Scheduler`.

    spec-jax serve --model DIR --speculative-config '{"method":"mtp","num_speculative_tokens":2}'
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "DIR", "prompt": "def f(x):", "max_tokens": 16, "temperature": 0}'

Endpoints: /v1/completions, /v1/chat/completions (both stream with server-sent events ending in
`data: [DONE]`), /v1/models, /health, /metrics (Prometheus text). Extensions beyond OpenAI's
fields, spelled like vLLM's: top_k, min_p, repetition_penalty, min_tokens, bad_words, stop_token_ids,
ignore_eos, skip_special_tokens, return_token_ids, chat_template_kwargs, and the per-request
`speculative` opt-out. Penalties, logit_bias and logprobs hold with speculation on, as offline.

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
from spec_jax.api.llm import LLM
from spec_jax.api.openai_requests import (APIError, ChatBody, CompletionBody, SamplingFields, body_error, check_tools,
                                          refuse_unsupported, sampling_params, stop_strings)
from spec_jax.api.scheduler import Scheduler, Update
from spec_jax.engine.detokenize import TextDelta
from spec_jax.engine.params import Logprob, SamplingParams, fan_out


# ----------------------------------------------------------------------------- the app


class Server:
    """What the endpoints share: the model, its scheduler, its served name and chat template."""

    def __init__(self, llm: LLM, *, served_model_name: str | None = None, chat_template: str | None = None,
                 steps_per_chunk: int = 4):
        self.llm = llm
        self.name = served_model_name or str(llm.model_path)
        self.scheduler = Scheduler(llm.engine, steps_per_chunk=steps_per_chunk)
        self.chat_template = ChatTemplate.of_checkpoint(llm.model_path, chat_template)
        self.created = int(time.time())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")

    def encode(self, prompt, param: str) -> list[int]:
        """Text or token ids -> checked token ids."""
        try:
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
    params = sampling_params(server.llm, body, body.max_tokens)
    prompts = completion_prompts(server, body.prompt, params.n)
    for ids in prompts:
        server.check_room(ids, body.max_tokens, "max_tokens")
    return params, prompts


def prepare_chat(server: Server, body: ChatBody) -> tuple[SamplingParams, list[int]]:
    """A chat request's checked SamplingParams and rendered prompt's token ids (with room for
    max_tokens); like `prepare_completion`, it runs in a worker thread."""
    if server.chat_template is None:
        raise APIError(400, f"{server.llm.model_path} has no chat template (no chat_template in its "
                            f"tokenizer_config.json, no chat_template.jinja); start the server with "
                            f"--chat-template FILE, or use /v1/completions", param="messages")
    if not body.messages or any(not isinstance(m.get("role"), str) for m in body.messages):
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    check_tools(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(server.llm, body, max_tokens)
    try:
        prompt = server.chat_template.render(body.messages, body.chat_template_kwargs)
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    ids = server.encode(prompt, "messages")
    server.check_room(ids, max_tokens, "max_tokens")
    return params, ids


def completion_prompts(server: Server, prompt, n: int) -> list[list[int]]:
    """OpenAI's prompt forms: a string, token ids, or a list of either; at most MAX_ROWS rows
    with each prompt's n choices."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompt) * n > MAX_ROWS:
        raise APIError(400, f"{len(prompt)} prompts x n={n} choices = {len(prompt) * n} completions; at most "
                            f"{MAX_ROWS} are accepted per request", param="n" if n > 1 else "prompt")
    return [server.encode(p, "prompt" if len(prompt) == 1 else f"prompt[{i}]") for i, p in enumerate(prompt)]


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


LOGPROB_FLOOR = -9999.0  # JSON has no -inf; vLLM reports this floor instead


class LogprobsFormat:
    """A choice's logprobs in OpenAI's shapes: chat's {"content": [{token, logprob, bytes,
    top_logprobs}]}, or completions' {tokens, token_logprobs, top_logprobs, text_offset}."""

    def __init__(self, server: Server, chat: bool, num: int):
        self.tokenizer, self.chat, self.num = server.llm.tokenizer, chat, num

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token], False) if self.tokenizer is not None else f"token_id:{token}"

    def span(self, token_ids: list[int]) -> int:
        """Characters the tokens' texts take: where the next token's text_offset starts after them."""
        return sum(len(self.text(t)) for t in token_ids)

    def __call__(self, token_ids: list[int], entries: list[dict[int, Logprob]], offset: int = 0) -> dict:
        """token_ids with their `logprob_entries`; offset: where the first token's text starts in
        the completion (completions' text_offset)."""
        value = lambda entry: max(entry.logprob, LOGPROB_FLOOR)  # noqa: E731
        if self.chat:
            def item(token, entry):
                text = self.text(token)
                return {"token": text, "logprob": value(entry), "bytes": list(text.encode())}

            return {"content": [{**item(t, e[t]), "top_logprobs": [item(u, x) for u, x in sorted(
                e.items(), key=lambda kv: kv[1].rank)[:self.num]]} for t, e in zip(token_ids, entries)]}
        tokens = [self.text(t) for t in token_ids]
        offsets = [offset + sum(map(len, tokens[:j])) for j in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [value(e[t]) for t, e in zip(token_ids, entries)],
                "top_logprobs": [{self.text(u): value(x) for u, x in e.items()} for e in entries],
                "text_offset": offsets}


async def complete(server: Server, body: SamplingFields, prompts: list[list[int]], params: SamplingParams,
                   chat: bool, client_gone):
    """Both endpoints' response: one JSON body, or a stream of OpenAI chunks. A request's n
    choices per prompt run as rows (`fan_out`); choice index = prompt index x n + i, as OpenAI
    numbers them. client_gone(): whether the client disconnected (a non-streaming request stops
    then; a stream stops when its next write fails)."""
    stops = stop_strings(body)
    rows = len(prompts) * params.n
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if body.stream and chat else
            "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": server.name}
    generated: list[list[int]] = [[] for _ in range(rows)]
    logprobs = None if params.logprobs is None else LogprobsFormat(server, chat, params.logprobs)

    def choice(i: int, text: str, ids: list[int], reason: str | None, final_body: bool, entries, offset=0) -> dict:
        if chat and final_body:
            content = {"message": {"role": "assistant", "content": text}}
        elif chat:
            content = {"delta": {"content": text} if text else {}}
        else:
            content = {"text": text}
        out = {"index": i, **content, "logprobs": logprobs(ids, entries, offset) if logprobs else None,
               "finish_reason": reason}
        if body.return_token_ids:
            out["token_ids"] = ids
        return out

    if not body.stream:
        texts = [""] * rows
        reasons: list[str | None] = [None] * rows
        entries: list[list] = [[] for _ in range(rows)]

        async def collect():
            async for i, delta, update in server.choices(prompts, params, stops):
                if update.error:
                    raise APIError(500, f"generation failed: {update.error}", type="server_error")
                texts[i] += delta
                generated[i] += update.token_ids
                entries[i] += update.logprobs or []
                reasons[i] = update.finish_reason

        if not await unless_client_leaves(collect(), client_gone):
            return Response(status_code=499)  # nginx's "client closed request": nobody reads it
        out = {**head, "choices": [choice(i, texts[i], generated[i], reasons[i], True, entries[i])
                                   for i in range(rows)],
               "usage": usage(prompts, generated)}
        if body.return_token_ids:
            out["prompt_token_ids"] = prompts
        return JSONResponse(out)

    async def events():
        if chat:
            for i in range(rows):
                yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        offsets = [0] * rows
        async for i, delta, update in server.choices(prompts, params, stops):
            if update.error:
                yield sse(APIError(500, f"generation failed: {update.error}", type="server_error").body())
                break
            ids, reason = update.token_ids, update.finish_reason
            generated[i] += ids
            if delta or reason is not None or ((body.return_token_ids or logprobs) and ids):
                yield sse({**head, "choices": [choice(i, delta, ids, reason, False, update.logprobs or [],
                                                      offsets[i])]})
            offsets[i] += logprobs.span(ids) if logprobs else 0  # token texts, as the whole body counts them
        if (body.stream_options or {}).get("include_usage"):
            yield sse({**head, "choices": [], "usage": usage(prompts, generated)})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def prometheus_text(stats: dict) -> str:
    """The scheduler's counters in Prometheus' text format (speculation: finished requests)."""
    drafts, drafted, accepted = (stats.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    lines = []

    def metric(name, kind, help_text, samples):
        lines.extend([f"# HELP spec_jax_{name} {help_text}", f"# TYPE spec_jax_{name} {kind}"])
        lines.extend(f"spec_jax_{name}{labels} {value}" for labels, value in samples)

    reasons = ("stop", "length", "abort", "error")
    metric("requests_total", "counter", "Finished requests by finish reason.",
           [(f'{{finish_reason="{r}"}}', stats.get(f"requests_{r}", 0)) for r in reasons])
    metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", stats.get("prompt_tokens", 0))])
    metric("generation_tokens_total", "counter", "Tokens generated.", [("", stats.get("generation_tokens", 0))])
    metric("spec_decode_num_drafts_total", "counter", "Steps that verified at least one draft.", [("", drafts)])
    metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [("", drafted)])
    metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", accepted)])
    metric("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted drafts by draft position.",
           [(f'{{position="{i}"}}', a) for i, a in enumerate(stats["accepted_per_position"])])
    metric("spec_decode_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
           [("", accepted / drafted if drafted else 0.0)])
    metric("spec_decode_mean_acceptance_length", "gauge", "1 + accepted / drafting steps.",
           [("", 1 + accepted / drafts if drafts else 1.0)])
    if "prefix_cache_queries" in stats:
        metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [("", stats["prefix_cache_queries"])])
        metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               [("", stats["prefix_cache_hits"])])
    metric("num_requests_running", "gauge", "Requests in a batch slot.", [("", stats["running"])])
    metric("num_requests_waiting", "gauge", "Requests waiting for a slot.", [("", stats["waiting"])])
    return "\n".join(lines) + "\n"


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
        return PlainTextResponse(prometheus_text(server.scheduler.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        server.check_model(body.model)
        refuse_unsupported(body)
        params, prompts = await asyncio.to_thread(prepare_completion, server, body)
        return await complete(server, body, prompts, params, chat=False, client_gone=request.is_disconnected)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        server.check_model(body.model)
        refuse_unsupported(body)
        params, ids = await asyncio.to_thread(prepare_chat, server, body)
        return await complete(server, body, [ids], params, chat=True, client_gone=request.is_disconnected)

    return app
