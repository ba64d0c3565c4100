"""The OpenAI server's structured-output fields as one `StructuredOutputsParams`: `response_format`
(json_object, json_schema), vLLM's `structured_outputs` object and its legacy `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, `guided_whitespace_pattern` and
`guided_decoding_backend`. Whether the constraint compiles is checked with the request's other
sampling fields (`EngineCore.check_params`)."""

from __future__ import annotations

from typing import Any, Mapping

from spec_jax.engine.structured import StructuredOutputsParams, as_structured, check_backend

# Each legacy field and the StructuredOutputsParams field it sets.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredRequestError(ValueError):
    """A malformed structured-output field (a 400), naming it in `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def structured_outputs_from_body(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The constraint a request body (its JSON object, as a dict) asks for, or None. Raises
    `StructuredRequestError` naming the field for a malformed value, or for two fields that both
    ask for a constraint."""
    given = {name: body.get(name) for name in ("response_format", "structured_outputs", *GUIDED)
             if body.get(name) is not None}
    if given.get("response_format") is not None and response_format_kind(given["response_format"]) == "text":
        del given["response_format"]
    legacy = [name for name in given if name in GUIDED]
    sources = [name for name in given if name not in GUIDED] + legacy[:1]
    if len(sources) > 1:
        raise StructuredRequestError(sources[1], f"asks for a constraint, and so does {sources[0]}; send one")
    if len(legacy) > 1:
        raise StructuredRequestError(legacy[1], f"asks for a constraint, and so does {legacy[0]}; send one")
    backend = body.get("guided_decoding_backend")
    try:
        check_backend(backend, "guided_decoding_backend")
    except ValueError as e:
        raise StructuredRequestError("guided_decoding_backend", str(e)) from None
    name = sources[0] if sources else None
    if body.get("guided_whitespace_pattern") is not None and name != "guided_json":
        raise StructuredRequestError("guided_whitespace_pattern", "applies only with guided_json")
    if name is None:
        return None
    try:
        if name == "response_format":
            return from_response_format(given[name])
        if name == "structured_outputs":
            return as_structured(given[name], name)
        return StructuredOutputsParams(**{GUIDED[name]: given[name]},
                                       whitespace_pattern=body.get("guided_whitespace_pattern"))
    except StructuredRequestError:
        raise
    except (ValueError, TypeError) as e:
        raise StructuredRequestError(name, str(e)) from None


def response_format_kind(value) -> str:
    """response_format's type: "text", "json_object" or "json_schema"; StructuredRequestError otherwise."""
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise StructuredRequestError("response_format", f'must be an object with a "type", got {value!r}')
    kind = value["type"]
    if kind not in ("text", "json_object", "json_schema"):
        raise StructuredRequestError("response_format.type", f"{kind!r} is not supported; accepted: 'text', "
                                                             f"'json_object', 'json_schema'")
    return kind


def from_response_format(value: Mapping) -> StructuredOutputsParams:
    """OpenAI's response_format of type json_object or json_schema ({"name", "schema", "strict",
    "description"}: the output follows the schema whether strict is true or false)."""
    if response_format_kind(value) == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise StructuredRequestError("response_format.json_schema", f'must be an object with a "schema", got '
                                                                    f'{spec!r}')
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise StructuredRequestError("response_format.json_schema", f"has unknown fields {unknown}; known: "
                                                                    f"description, name, schema, strict")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise StructuredRequestError("response_format.json_schema.strict", f"must be true or false, got "
                                                                           f"{spec['strict']!r}")
    if not isinstance(spec.get("schema"), Mapping):
        raise StructuredRequestError("response_format.json_schema.schema", f"must be a JSON schema object, got "
                                                                           f"{spec.get('schema')!r}")
    return StructuredOutputsParams(json=dict(spec["schema"]))
