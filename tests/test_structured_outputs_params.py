"""StructuredOutputsParams and the response_format conversion: the shapes a request may
take and the 400-style ParamError (naming the field) for the ones it may not."""

from __future__ import annotations

import pytest

from nanollmserve import SamplingParams, StructuredOutputsParams
from nanollmserve.api.response_format import structured_outputs_from_response_format
from nanollmserve.errors import ParamError

pytestmark = pytest.mark.milestone("m15")


def test_sampling_params_accepts_params_or_dict_and_parses_schema_text():
    params = SamplingParams(structured_outputs={"json": '{"type": "object"}'})
    assert params.structured_outputs == StructuredOutputsParams(json={"type": "object"})
    assert params.structured_outputs.kind == "json"
    choice = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert choice.structured_outputs.kind == "choice"
    assert SamplingParams().structured_outputs is None


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"regex": "a+", "choice": ["a"]},
        {"choice": []},
        {"choice": ["a", ""]},
        {"json": "{not json"},
        {"json": 3},
        {"regex": ""},
        {"unknown_field": 1},
        "json",
    ],
)
def test_bad_structured_outputs_raise_param_error(value):
    with pytest.raises(ParamError) as info:
        SamplingParams(structured_outputs=value)
    assert info.value.param == "structured_outputs"


def test_same_grammar_same_key():
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "string"}})
    b = StructuredOutputsParams(json='{"a": {"type": "string"}, "b": 1}')
    assert a.key == b.key
    assert a.key != StructuredOutputsParams(json=a.json, disable_any_whitespace=True).key


def test_response_format_shapes():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    flat = {"type": "json_schema", "name": "n", "schema": schema, "strict": True}
    assert structured_outputs_from_response_format(chat).json == schema
    assert structured_outputs_from_response_format(flat, param="text.format").json == schema
    assert structured_outputs_from_response_format({"type": "json_object"}).json_object
    assert structured_outputs_from_response_format({"type": "text"}) is None
    assert structured_outputs_from_response_format(None) is None


@pytest.mark.parametrize(
    "value", [{"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": 5}}, "json"]
)
def test_bad_response_format_names_the_param(value):
    with pytest.raises(ParamError) as info:
        structured_outputs_from_response_format(value, param="text.format")
    assert info.value.param == "text.format"
