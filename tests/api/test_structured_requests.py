"""The server's structured-output fields as one StructuredOutputsParams (`structured_outputs_from_body`):
response_format, structured_outputs and vLLM's legacy guided_* fields; malformed values and two
constraints at once refused naming the field."""

import pytest

from spec_jax.api.structured_requests import StructuredRequestError, structured_outputs_from_body
from spec_jax.engine.structured import GuidedDecodingParams, StructuredOutputsParams
from spec_jax import SamplingParams

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("body, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}},
     StructuredOutputsParams(choice=["a", "b"], disable_any_whitespace=True)),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")),
    ({"guided_json": '{"type": "string"}'}, StructuredOutputsParams(json='{"type": "string"}')),
    ({"guided_regex": "x+", "guided_decoding_backend": "xgrammar"}, StructuredOutputsParams(regex="x+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"guided_decoding_backend": "guidance"}, None),
])
def test_each_form_becomes_one_constraint(body, want):
    assert structured_outputs_from_body(body) == want


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml' is not supported"),
    ({"response_format": "json"}, "response_format", 'must be an object with a "type"'),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", 'with a "schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format.json_schema.schema",
     "must be a JSON schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "must be true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strictly": True}}},
     "response_format.json_schema", "unknown fields"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one constraint"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", r"unknown fields \['regexp'\]"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag is not supported"),
    ({"structured_outputs": "json"}, "structured_outputs", "must be a StructuredOutputsParams"),
    ({"guided_json": "{not json"}, "guided_json", "is not valid JSON"),
    ({"guided_choice": "yes"}, "guided_choice", "must be a non-empty list of strings"),
    ({"guided_choice": []}, "guided_choice", "must be a non-empty list of strings"),
    ({"guided_regex": 5}, "guided_regex", "must be a non-empty string"),
    ({"guided_regex": "a", "guided_json": SCHEMA}, "guided_regex", "so does guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "so does response_format"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "so does response_format"),
    ({"guided_decoding_backend": "magic"}, "guided_decoding_backend", "is not a structured-output backend"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "only with guided_json"),
])
def test_malformed_fields_are_refused_by_name(body, param, message):
    with pytest.raises(StructuredRequestError, match=message) as e:
        structured_outputs_from_body(body)
    assert e.value.param == param


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one constraint .* none given"),
    ({"json": {}, "regex": "a"}, r"2 \(json, regex\) given"),
    ({"json": 3}, "must be a JSON schema"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
    ({"json_object": True, "disable_any_whitespace": "no"}, "disable_any_whitespace must be true or false"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern applies to json and json_object only"),
])
def test_structured_outputs_params_check_their_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_either_name_and_refuse_both():
    constraint = StructuredOutputsParams(regex="a+")
    assert SamplingParams(structured_outputs=constraint).structured == constraint
    assert SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+", backend="xgrammar")).structured.regex == "a+"
    assert SamplingParams(structured_outputs={"choice": ["x"]}).structured == StructuredOutputsParams(choice=["x"])
    with pytest.raises(ValueError, match="two names of one field"):
        SamplingParams(structured_outputs=constraint, guided_decoding=constraint)
    with pytest.raises(ValueError, match="backend='magic' is not a structured-output backend"):
        GuidedDecodingParams(regex="a", backend="magic")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")
