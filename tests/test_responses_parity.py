"""`/v1/responses` at OpenAI parity (m19), through the real `openai` SDK with strict
validation against the shared live server: `client.responses.stream(...)` reads our event
stream, a response cut by max_output_tokens is `incomplete` (and its stream ends with
`response.incomplete`), `text.format` json_schema through the grammar, `include`
logprobs, `truncation: "auto"`, the echoed fields, and a 400 naming the field for every
request field the parity table rejects."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from live_server import shared_server

pytestmark = pytest.mark.milestone("m19")

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_sdk_stream_helper_reads_our_events(client):
    kwargs = dict(model=MODEL, input="Name a color.", temperature=0, max_output_tokens=200)
    with client.responses.stream(**kwargs, instructions="Answer in one word.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.status == "completed" and final.output_text == deltas != ""
    assert final.instructions == "Answer in one word."


def test_length_limit_reports_incomplete(client):
    kwargs = dict(model=MODEL, input="Tell me a long story.", max_output_tokens=3, store=False)
    response = client.responses.create(**kwargs)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "response.completed" not in [e.type for e in events]


def test_include_logprobs(client):
    response = client.responses.create(
        model=MODEL,
        input="Say hi.",
        max_output_tokens=4,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        temperature=0,  # a sampled answer may end inside a multi-byte character's tokens
        store=False,
    )
    [part] = response.output[0].content
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    plain = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=2, store=False)
    assert plain.output[0].content[0].logprobs == []


def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}}
    response = client.responses.create(
        model=MODEL, input="Pick a color.", text=text, max_output_tokens=40, store=False
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_echoed_fields(client):
    response = client.responses.create(
        model=MODEL,
        input="Hi",
        instructions="Be brief.",
        max_output_tokens=2,
        metadata={"run": "parity"},
        temperature=0.5,
        top_p=0.9,
        store=False,
        user="u-1",
        truncation="disabled",
    )
    assert response.metadata == {"run": "parity"} and response.user == "u-1"
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.5, 0.9, 2)
    assert response.instructions == "Be brief." and response.store is False
    assert response.truncation == "disabled" and response.text.format.type == "text"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.slow
def test_truncation_auto_drops_the_oldest_turns(client, server):
    filler = "word " * 1500  # three of these do not fit the 4096-token context
    history = []
    for _ in range(3):
        history += [
            {"role": "user", "content": filler},
            {"role": "assistant", "content": "ok"},
        ]
    conversation = history + [{"role": "user", "content": "Say hi."}]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=conversation, max_output_tokens=2)
    assert err.value.body["param"] == "input"
    response = client.responses.create(
        model=MODEL, input=conversation, max_output_tokens=2, truncation="auto", store=False
    )
    assert response.status in ("completed", "incomplete")
    assert response.truncation == "auto"
    assert 0 < response.usage.input_tokens < server.openai().models.list().data[0].max_model_len


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"top_logprobs": 50, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ],
)
def test_rejected_fields_are_400s_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, extra_body=extra)
    assert err.value.body["param"] == param
