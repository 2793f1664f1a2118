"""The rows of the Responses API parity table (docs/api/server.md) that
tests/test_responses_parity.py does not cover, through the real `openai` SDK against the
shared live server: the fields accepted and ignored change nothing, `model` may be left out,
`seed` and `top_k` apply, `text.format` json_object gives a JSON object, and input items of
other types are 400s naming `input`."""

from __future__ import annotations

import json

import openai
import pytest
from live_server import shared_server

pytestmark = pytest.mark.milestone("m19")

MODEL = "SmolLM2-135M-Instruct"
GREEDY = dict(model=MODEL, input="Name a fruit.", max_output_tokens=8, temperature=0, store=False)


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_accepted_and_ignored_fields_change_nothing(client):
    plain = client.responses.create(**GREEDY)
    ignored = client.responses.create(
        **GREEDY,
        include=["reasoning.encrypted_content"],
        text={"format": {"type": "text"}, "verbosity": "low"},
        max_tool_calls=2,
        user="u-1",
        safety_identifier="s-1",
        prompt_cache_key="k-1",
        prompt_cache_retention="24h",
        service_tier="auto",
        reasoning={"effort": "low"},
    )
    assert (ignored.status, ignored.output_text) == (plain.status, plain.output_text)
    events = list(
        client.responses.create(**GREEDY, stream=True, stream_options={"include_obfuscation": True})
    )
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == plain.output_text


def test_model_may_be_left_out(server):
    body = {"input": "Name a fruit.", "max_output_tokens": 4, "store": False}
    with server.client() as http:
        answer = http.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == MODEL


def test_seed_and_top_k_apply(client):
    kwargs = dict(GREEDY, temperature=1.0, max_output_tokens=12)
    first, second = (
        client.responses.create(**kwargs, extra_body={"seed": 7, "top_k": 5}) for _ in range(2)
    )
    assert first.output_text == second.output_text != ""
    top1 = client.responses.create(**kwargs, extra_body={"seed": 3, "top_k": 1})
    assert (
        top1.output_text
        == client.responses.create(**GREEDY | {"max_output_tokens": 12}).output_text
    )


def test_text_format_json_object(client):
    response = client.responses.create(
        model=MODEL,
        input="Describe an apple as JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=16,
        store=False,
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # cut by max_output_tokens: still the start of an object
        assert response.output_text.lstrip().startswith("{")


@pytest.mark.parametrize(
    "item",
    [
        {"type": "input_image", "image_url": "https://example.com/a.png"},
        {"type": "item_reference", "id": "msg_1"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ],
    ids=["image", "item_reference", "reasoning"],
)
def test_other_input_items_are_400s(client, item):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=[item], max_output_tokens=2, store=False)
    assert err.value.body["param"].startswith("input")
