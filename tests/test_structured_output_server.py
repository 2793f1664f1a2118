"""Structured output over HTTP with the official `openai` SDK (strict response validation):
`response_format` json_schema / json_object on chat and completions, the SDK's pydantic
`parse`, vLLM's `structured_outputs` block and older `guided_*` fields (regex, choice,
grammar), a streamed structured answer, and the 400s (engine message, `param`) for what
cannot be compiled or enforced."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from live_server import shared_server
from pydantic import BaseModel

pytestmark = pytest.mark.milestone("m15")

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Reply with a JSON object describing a pet."}]

SCHEMAS = {
    "enum": {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "nested object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "owner": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "adult": {"type": "boolean"},
                },
                "required": ["city", "adult"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "owner"],
        "additionalProperties": False,
    },
    "array with minItems": {
        "type": "object",
        "properties": {
            "legs": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["legs"],
        "additionalProperties": False,
    },
    "integer bounds": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 3, "maximum": 17}},
        "required": ["age"],
        "additionalProperties": False,
    },
    "string pattern": {
        "type": "object",
        "properties": {"tag": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["tag"],
        "additionalProperties": False,
    },
}


class Pet(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return server.openai().with_options(timeout=280)  # n=20 batches take a while on CPU


def json_schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_parse_returns_the_pydantic_object(client):
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Pet, max_tokens=60, temperature=0
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Pet), message.content


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_twenty_samples_at_temperature_one_validate(client, name):
    schema = SCHEMAS[name]
    completion = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=json_schema_format(name.replace(" ", "_"), schema),
        n=20,
        temperature=1.0,
        seed=1,
        max_tokens=80,
    )
    assert len(completion.choices) == 20
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_on_chat_and_completions(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    completion = client.completions.create(
        model=MODEL,
        prompt="A pet as JSON:",
        max_tokens=100,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    # Any object is allowed, so one may run to max_tokens; a finished one must parse.
    for text, reason in [
        (chat.choices[0].message.content, chat.choices[0].finish_reason),
        (completion.choices[0].text, completion.choices[0].finish_reason),
    ]:
        assert text.lstrip().startswith("{"), text
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize(
    "extra_body, is_valid",
    [
        ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}}, r"[0-9]{3}-[a-z]{2}"),
        ({"guided_regex": r"(cat|dog) [0-9]"}, r"(cat|dog) [0-9]"),
        ({"structured_outputs": {"choice": ["cat", "dog", "fish"]}}, r"cat|dog|fish"),
        ({"guided_choice": ["yes", "no"]}, r"yes|no"),
        (
            {"structured_outputs": {"grammar": 'root ::= "a pet: " ("cat" | "dog")'}},
            "a pet: (cat|dog)",
        ),
        ({"guided_grammar": 'start: "n" DIGIT DIGIT\n%import common.DIGIT'}, r"n[0-9]{2}"),
    ],
)
def test_regex_choice_and_grammar_requests(client, extra_body, is_valid):
    completion = client.completions.create(
        model=MODEL,
        prompt="My favourite pet:",
        max_tokens=16,
        n=3,
        temperature=1.0,
        seed=3,
        extra_body=extra_body,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.text
        assert re.fullmatch(is_valid, choice.text), choice.text


def test_structured_stream_joins_to_valid_json(client):
    schema = SCHEMAS["nested object"]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format=json_schema_format("pet", schema),
        max_tokens=80,
        temperature=1.0,
        seed=4,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        (
            {
                "response_format": json_schema_format(
                    "x", {"type": "integer", "minimum": 9, "maximum": 1}
                )
            },
            "response_format",
            "invalid JSON schema",
        ),
        (
            {"response_format": json_schema_format("x", {"type": "array", "uniqueItems": True})},
            "response_format",
            "uniqueItems",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "(unclosed"}}},
            "structured_outputs",
            "invalid regex",
        ),
        ({"extra_body": {"guided_grammar": "root ::= ("}}, "guided_grammar", "invalid grammar"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs", "choice"),
        ({"extra_body": {"structured_outputs": {"xml": "<a/>"}}}, "structured_outputs", "xml"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
            "response_format",
            "one output constraint",
        ),
    ],
)
def test_what_cannot_be_enforced_is_a_400_naming_the_param(client, extra, param, fragment):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **extra)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param, error
    assert fragment in error["message"], error
