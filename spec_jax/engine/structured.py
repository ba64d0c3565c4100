"""Structured output's request side: vLLM's `StructuredOutputsParams` (and its older name
`GuidedDecodingParams`), checked when made, and `grammar_text`, the llguidance grammar a request is
constrained by. The matchers that run it beside the step are `spec_jax.engine.grammar_rows`.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
"""

from __future__ import annotations

import dataclasses
import json

import llguidance

# The constraint kinds, of which a request sets exactly one.
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's backend names. Every one is served by llguidance: each names a grammar engine, not a
# different constraint, so the output obeys the same grammar whichever is asked for.
BACKENDS = ("auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer")


def schema_dict(value, what: str = "json") -> dict | bool:
    """A JSON schema given as a dict, as JSON text, or as a pydantic model class
    (`model_json_schema`); ValueError naming `what` otherwise."""
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return value.model_json_schema()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if isinstance(value, bool) or isinstance(value, dict):
        return value
    raise ValueError(f"{what} must be a JSON schema (an object, or its JSON text), got {type(value).__name__}")


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's structured-output request: exactly one of json (a JSON schema: dict, JSON text or a
    pydantic model class), regex, choice (the output is one of these strings), grammar (Lark or
    GBNF/EBNF, as llguidance reads them), json_object (any JSON object). Options: disable_any_whitespace
    (JSON with no whitespace between tokens), disable_additional_properties (objects take only their
    listed properties unless the schema says otherwise), whitespace_pattern (a regex for JSON's
    whitespace). disable_fallback is accepted: llguidance is the only engine, so there is nothing to
    fall back to. structural_tag is refused by name (not built yet)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            found = f"{len(given)} ({', '.join(given)})" if given else "none"
            raise ValueError(f"structured outputs take exactly one constraint of {', '.join(KINDS)}; {found} given")
        if self.structural_tag is not None:
            raise ValueError("structured outputs: structural_tag is not supported yet; use json, regex, choice, "
                             "grammar or json_object")
        if self.json is not None:
            schema_dict(self.json)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple))
                                        or not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured outputs: choice must be a non-empty list of strings, got {self.choice!r}")
        for name in ("json_object", "disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured outputs: {name} must be true or false, got {value!r}")
        if self.whitespace_pattern is not None and self.json is None and not self.json_object:
            raise ValueError("structured outputs: whitespace_pattern applies to json and json_object only")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))


@dataclasses.dataclass
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name for `StructuredOutputsParams`, with its `backend` field (one of `BACKENDS`;
    every one runs llguidance)."""

    backend: str | None = None

    def __post_init__(self):
        super().__post_init__()
        check_backend(self.backend, "backend")


def check_backend(backend, what: str) -> None:
    """ValueError naming `what` unless backend is None or one of vLLM's `BACKENDS`."""
    if backend is None:
        return
    if backend not in BACKENDS:
        raise ValueError(f"{what}={backend!r} is not a structured-output backend; accepted: "
                         f"{', '.join(map(repr, BACKENDS))} (spec_jax runs llguidance for each)")


def as_structured(value, what: str) -> StructuredOutputsParams | None:
    """A `SamplingParams` field's structured-output request: a `StructuredOutputsParams` as it is, a
    dict of its fields made into one, None as none; ValueError naming `what` otherwise."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(GuidedDecodingParams)}
        unknown = sorted(set(value) - fields)
        if unknown:
            raise ValueError(f"{what} has unknown fields {unknown}; known: {sorted(fields)}")
        cls = GuidedDecodingParams if "backend" in value else StructuredOutputsParams
        return cls(**value)
    raise ValueError(f"{what} must be a StructuredOutputsParams (or a dict of its fields), got "
                     f"{type(value).__name__}")


def closed_objects(schema):
    """The schema with additionalProperties false on every object schema that does not set it
    (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_objects(value) for key, value in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a request (the key its compiled matcher is cached under). Raises
    ValueError for a grammar llguidance cannot read (GBNF that does not convert)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = schema_dict(params.json) if kind == "json" else {"type": "object"}
        if params.disable_additional_properties:
            schema = closed_objects(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"structured outputs: grammar is neither Lark nor GBNF llguidance reads: {e}") from None
