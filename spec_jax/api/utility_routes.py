"""The server routes a deployment expects beside generation, as vLLM serves them: `/version`,
`/tokenize` (a prompt or chat messages -> token ids), `/detokenize` (token ids -> text), and the
`--api-key` check on the /v1 routes (401 without `Authorization: Bearer KEY`; /health, /metrics
and these stay open, as in vLLM)."""

from __future__ import annotations

import asyncio
import hmac
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from spec_jax.api.chat import RequestError
from spec_jax.api.openai_requests import APIError


def check_api_key(app: FastAPI, api_key: str | None) -> None:
    """With an API key, every /v1 route wants it as a Bearer token: without it (or with another) a
    401 in OpenAI's error body."""
    if api_key is None:
        return

    @app.middleware("http")
    async def bearer(request: Request, call_next):
        if request.method != "OPTIONS" and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                error = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                 type="authentication_error", code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered with the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def version() -> str:
    try:
        return metadata.version("spec_jax")
    except metadata.PackageNotFoundError:
        return "unknown"


def tokenize(server, body: TokenizeBody) -> dict:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt (text) or messages (a chat)", param="prompt")
    if server.llm.tokenizer is None:
        raise APIError(400, f"{server.llm.model_path} has no tokenizer", param="prompt")
    text = body.prompt
    if body.messages is not None:
        if server.chat_template is None:
            raise APIError(400, f"{server.llm.model_path} has no chat template", param="messages")
        try:
            text = server.chat_template.render(body.messages, {"add_generation_prompt": body.add_generation_prompt,
                                                               **(body.chat_template_kwargs or {})})
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
    ids = server.llm.tokenizer.encode(text)
    out = {"count": len(ids), "max_model_len": server.llm.max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = [server.llm.tokenizer.decode([t], False) for t in ids]
    return out


def detokenize(server, body: DetokenizeBody) -> dict:
    if server.llm.tokenizer is None:
        raise APIError(400, f"{server.llm.model_path} has no tokenizer", param="tokens")
    vocab = server.llm.cfg.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens holds ids outside the vocabulary (0 to {vocab - 1}): {bad[:8]}", param="tokens")
    return {"prompt": server.llm.tokenizer.decode(body.tokens, False)}


def add_utility_routes(app: FastAPI, server) -> None:
    @app.get("/version")
    async def version_route():
        return {"version": version()}

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeBody):
        server.check_model(body.model)
        return await asyncio.to_thread(tokenize, server, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeBody):
        server.check_model(body.model)
        return await asyncio.to_thread(detokenize, server, body)
