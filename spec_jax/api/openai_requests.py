"""The OpenAI API's request side, as the server reads it: the error a client caused (`APIError`),
the request bodies (vLLM's extensions included), and their checks and translation into
`SamplingParams` and stop strings."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from spec_jax.api.llm import LLM
from spec_jax.api.scheduler import MAX_STOP_TOKEN_IDS
from spec_jax.engine.params import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """An error the client caused (or a server failure), sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SamplingFields(BaseModel):
    """The fields completions and chat share. Unknown fields are ignored, as OpenAI's API does."""

    model_config = ConfigDict(extra="ignore", strict=True)  # "5" or true for a count is an error, not 5 or 1

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    speculative: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    user: str | None = None


class CompletionBody(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None


def body_error(errors: list[dict]) -> APIError:
    """A request body that failed validation as one 400 naming the field: for a field of several
    forms (prompt, stop) the forms it accepts, not the first form's complaint."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error')}")
    path = [str(x) for x in first.get("loc", ()) if x != "body"]
    if not path:
        if first.get("type") == "missing":
            return APIError(400, "the request body is empty: send a JSON object of the request's fields")
        return APIError(400, f"the request body must be a JSON object (sent with Content-Type: application/json), "
                             f"got {str(first.get('input'))[:80]!r}")
    field = path[0]
    forms = list(dict.fromkeys(str(err["loc"][2]) for err in errors if len(err["loc"]) > 2
                               and err["loc"][:2] == ("body", field) and not isinstance(err["loc"][2], int)))
    if len(forms) > 1:
        return APIError(400, f"{field} must be one of: {', '.join(forms)}; got {str(first.get('input'))[:80]!r}",
                        param=field)
    return APIError(400, f"{'.'.join(path)}: {first.get('msg', 'invalid value')}", param=".".join(path))


def refuse_unsupported(body: SamplingFields) -> None:
    """Fields this server cannot honour, when set to anything but their neutral value."""
    unsupported = {"echo": bool(getattr(body, "echo", False)),
                   "suffix": getattr(body, "suffix", None) is not None,
                   "tools": bool(getattr(body, "tools", None)),
                   "response_format": (getattr(body, "response_format", None) or {}).get("type", "text") != "text"}
    for name, is_set in unsupported.items():
        if is_set:
            raise APIError(400, f"{name} is not supported by this server; leave it unset", param=name)


TOOL_FORM = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
CALL_FORM = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}'


def check_tools(body: ChatBody) -> None:
    """What a chat template may loop over besides messages, in OpenAI's shapes: chat_template_kwargs'
    `tools` a list of tool objects, each message's `tool_calls` a list of call objects. Anything
    else is a 400 naming the field."""
    tools = (body.chat_template_kwargs or {}).get("tools")
    if tools is not None:
        check_functions(tools, "chat_template_kwargs.tools", "chat_template_kwargs", TOOL_FORM, calls=False)
    for i, message in enumerate(body.messages):
        if message.get("tool_calls") is not None:
            check_functions(message["tool_calls"], f"messages[{i}].tool_calls", "messages", CALL_FORM, calls=True)


def check_functions(items, where: str, param: str, form: str, *, calls: bool) -> None:
    """items must be a list of objects `form`, each with a `function` object that has a string
    name (and, for calls, arguments as JSON text or an object); else a 400 naming the part at
    fault, under `param`."""
    def refuse(path: str, rule: str, value):
        raise APIError(400, f"{path} must be {rule}, got {json.dumps(value)[:80]}", param=param)

    if not isinstance(items, list):
        refuse(where, f"a list of {form}", items)
    for j, item in enumerate(items):
        if not isinstance(item, dict):
            refuse(f"{where}[{j}]", f"an object {form}", item)
        function = item.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            refuse(f"{where}[{j}].function", "an object with a string name", function)
        if calls and not isinstance(function.get("arguments", ""), str | dict):
            refuse(f"{where}[{j}].function.arguments", "JSON text or an object", function["arguments"])


FLOAT32 = np.finfo(np.float32)
# The sampling fields the device holds in float32.
FLOAT32_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def check_float32(body: SamplingFields) -> None:
    """Each of FLOAT32_FIELDS 0 or of a magnitude float32 holds as a normal number: a value that
    would become 0, a denormal or inf there is a 400 naming the field, though float64 holds it."""
    for name in FLOAT32_FIELDS:
        value = getattr(body, name)
        if not (value == 0 or FLOAT32.tiny <= abs(value) <= FLOAT32.max):
            raise APIError(400, f"{name}={value} is outside float32, the precision it is used in: give 0 or a "
                                f"magnitude from {FLOAT32.tiny:.3g} to {FLOAT32.max:.3g}", param=name)


def requested_logprobs(body: SamplingFields) -> int | None:
    """SamplingParams.logprobs: completions' `logprobs` count, or chat's `top_logprobs` when its
    `logprobs` is true (0 then: the chosen token's only)."""
    if not isinstance(body, ChatBody):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs={body.top_logprobs} must be 0 to {MAX_LOGPROBS}", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def sampling_params(llm: LLM, body: SamplingFields, max_tokens: int | None) -> SamplingParams:
    """The request's SamplingParams, checked against the served model; a bad field is a 400 naming it."""
    check_float32(body)
    if len(body.stop_token_ids or []) > MAX_STOP_TOKEN_IDS:
        raise APIError(400, f"{len(body.stop_token_ids)} stop_token_ids given; at most {MAX_STOP_TOKEN_IDS} are "
                            f"supported", param="stop_token_ids")
    logprobs = requested_logprobs(body)
    try:
        params = SamplingParams(n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                min_p=body.min_p, seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens,
                                stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                                presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias,
                                bad_words=body.bad_words, logprobs=logprobs, best_of=getattr(body, "best_of", None),
                                skip_special_tokens=body.skip_special_tokens, speculative=body.speculative)
        llm.check_params(params)
        return params
    except ValueError as e:
        name = re.match(r"\w+", str(e))
        raise APIError(400, str(e), param=name.group(0) if name else None) from None


def stop_strings(body: SamplingFields) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must be non-empty", param="stop")
    return stops
