"""The OpenAI API's request side, as the server reads it: the error a client caused (`APIError`),
the request bodies (vLLM's extensions included), and their checks and translation into
`SamplingParams` and stop strings."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from spec_jax.api.llm import LLM
from spec_jax.api.scheduler import MAX_STOP_TOKEN_IDS
from spec_jax.api.structured_requests import StructuredRequestError, structured_outputs_from_body
from spec_jax.engine.params import MAX_LOGPROBS, SamplingParams
from spec_jax.engine.structured import StructuredOutputsParams


class APIError(Exception):
    """An error the client caused (or a server failure), sent as OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SamplingFields(BaseModel):
    """The fields completions and chat share. Fields beyond these are kept aside (`model_extra`) for
    `refuse_unknown` and `structured_output` to answer."""

    model_config = ConfigDict(extra="allow", strict=True)  # "5" or true for a count is an error, not 5 or 1

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
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    response_format: dict | None = None
    user: str | None = None


class CompletionBody(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None


class ChatBody(SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


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


# Request fields (vLLM's extensions and OpenAI's) this server does not implement, with the neutral
# value each is accepted at; any other value is a 400 naming the field, never silently dropped.
NOT_IMPLEMENTED = {
    "use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
    "spaces_between_special_tokens": True, "prompt_embeds": None, "priority": 0, "request_id": None,
    "logits_processors": None, "return_tokens_as_token_ids": False, "cache_salt": None, "kv_transfer_params": None,
    "vllm_xargs": None, "mm_processor_kwargs": None, "documents": None, "chat_template": None,
    "media_io_kwargs": None, "functions": None, "function_call": None, "reasoning_effort": None, "audio": None,
    "modalities": None, "prediction": None, "service_tier": None, "store": False, "metadata": None,
    "web_search_options": None, "verbosity": None, "suffix": None,
}
# Per endpoint: vLLM's chat `echo` (repeat the last message) and `add_special_tokens` defaults.
NOT_IMPLEMENTED_CHAT = {"echo": False, "add_special_tokens": False}
NOT_IMPLEMENTED_COMPLETIONS = {"add_special_tokens": True}

# Structured output's fields beyond the declared response_format, in every form vLLM reads
# (`structured_output` reads them).
STRUCTURED_OUTPUT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                            "guided_whitespace_pattern", "guided_decoding_backend")


def refuse_unknown(body: SamplingFields) -> None:
    """Every field the body holds beyond the declared ones is a 400 naming it: those this server
    does not implement (set to anything but their neutral value), and those it does not know."""
    extra = dict(body.model_extra or {})
    neutral = {**NOT_IMPLEMENTED, **(NOT_IMPLEMENTED_CHAT if isinstance(body, ChatBody) else
                                     NOT_IMPLEMENTED_COMPLETIONS)}
    for name, value in extra.items():
        if name in STRUCTURED_OUTPUT_FIELDS:
            continue  # `structured_output` answers for these
        if name in neutral:
            if value != neutral[name]:
                raise APIError(400, f"{name}={json.dumps(value)[:80]} is not supported by this server; leave it "
                                    f"unset (or {json.dumps(neutral[name])})", param=name)
        else:
            raise APIError(400, f"unrecognized request field {name!r}: this server does not know it", param=name)


@dataclasses.dataclass(frozen=True)
class Constraint:
    """A request's output constraint and the request field that asked for it (its errors name it)."""

    field: str
    params: StructuredOutputsParams


def structured_output(body: SamplingFields) -> Constraint | None:
    """The request's structured-output constraint: response_format json_object / json_schema,
    `structured_outputs`, vLLM's legacy guided_* fields (`structured_outputs_from_body`); None
    when it asks for none. A malformed field, or two asking, is a 400 naming the field."""
    fields = {**(body.model_extra or {}), "response_format": body.response_format}
    try:
        params = structured_outputs_from_body(fields)
    except StructuredRequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    if params is None:
        return None
    asked = [name for name in ("response_format", *STRUCTURED_OUTPUT_FIELDS) if fields.get(name) is not None
             and not (name == "response_format" and fields[name].get("type") == "text")]
    return Constraint(asked[0], params)


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


def sampling_params(llm: LLM, body: SamplingFields, max_tokens: int | None,
                    constraint: Constraint | None = None) -> SamplingParams:
    """The request's SamplingParams, checked against the served model, constrained by `constraint`;
    a bad field is a 400 naming it (a grammar that does not compile names the constraint's field)."""
    check_float32(body)
    check_constraint(llm, constraint)
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
                                bad_words=body.bad_words, allowed_token_ids=body.allowed_token_ids,
                                logprobs=logprobs, prompt_logprobs=body.prompt_logprobs,
                                best_of=getattr(body, "best_of", None),
                                skip_special_tokens=body.skip_special_tokens, speculative=body.speculative,
                                structured_outputs=constraint and constraint.params)
        llm.check_params(params)
        return params
    except ValueError as e:
        name = re.match(r"\w+", str(e))
        raise APIError(400, str(e), param=name.group(0) if name else None) from None


def check_constraint(llm: LLM, constraint: Constraint | None) -> None:
    """The constraint compiles for the served model (compiled grammars are cached, so the
    request's own check reuses it); a 400 naming its field otherwise."""
    if constraint is None:
        return
    try:
        llm.check_params(SamplingParams(max_tokens=1, structured_outputs=constraint.params))
    except ValueError as e:
        raise APIError(400, f"{constraint.field}: {e}", param=constraint.field) from None


def stop_strings(body: SamplingFields) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise APIError(400, "stop strings must be non-empty", param="stop")
    return stops
