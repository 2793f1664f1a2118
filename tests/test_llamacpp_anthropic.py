"""The Anthropic Messages checks llama.cpp's server suite makes (its compat_anthropic file),
through HTTP on the shared live server: empty `messages` and `image` / `document` blocks are
400s in Anthropic's error shape that say why, and streamed content blocks follow Anthropic's
index rules (starts numbered from 0 in order, every delta on the open block, a stop for each
start before the next one, all closed before message_delta)."""

from __future__ import annotations

import json

import pytest
from live_server import shared_server

pytestmark = pytest.mark.milestone("m30")

PNG = (  # a 1x1 red PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
)
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
TOOL = {
    "name": "lookup",
    "description": "Look a word up",
    "input_schema": {
        "type": "object",
        "properties": {"word": {"type": "string"}},
        "required": ["word"],
    },
}


@pytest.fixture(scope="module")
def client():
    with shared_server().client() as client:
        yield client


def anthropic_error(response, status: int = 400) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_empty_messages_is_a_400_in_anthropics_shape(client, path):
    body = {"messages": [], **({"max_tokens": 5} if path == "/v1/messages" else {})}
    message = anthropic_error(client.post(path, json=body))
    assert "messages" in message


@pytest.mark.parametrize(
    "content",
    [
        [IMAGE, {"type": "text", "text": "What is this?"}],
        [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}],
    ],
)
def test_image_and_document_blocks_are_400s_that_say_why(client, content):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": content}]}
    message = anthropic_error(client.post("/v1/messages", json=body))
    kind = content[0]["type"]
    assert f"{kind} input is not supported" in message and "text" in message


def test_an_image_inside_a_tool_result_is_refused_too(client):
    messages = [
        {"role": "user", "content": "Look up cat."},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"word": "cat"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}],
        },
    ]
    body = {"max_tokens": 5, "tools": [TOOL], "messages": messages}
    assert "image input is not supported" in anthropic_error(client.post("/v1/messages", json=body))


def stream_events(client, body: dict) -> list[dict]:
    events = []
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def assert_anthropic_block_order(events: list[dict]) -> list[str]:
    """The block types in order, after checking the index rules."""
    kinds, open_index = [], None
    for event in events:
        kind = event["type"]
        if kind == "content_block_start":
            assert open_index is None, "a block started while another was open"
            assert event["index"] == len(kinds)
            open_index = event["index"]
            kinds.append(event["content_block"]["type"])
        elif kind == "content_block_delta":
            assert event["index"] == open_index
        elif kind == "content_block_stop":
            assert event["index"] == open_index
            open_index = None
        elif kind == "message_delta":
            assert open_index is None
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
    return kinds


def test_stream_block_indices_with_text(client):
    body = {"max_tokens": 12, "messages": [{"role": "user", "content": "Say hello."}]}
    assert assert_anthropic_block_order(stream_events(client, body)) == ["text"]


def test_stream_block_indices_with_tool_calls(client):
    body = {
        "max_tokens": 120,
        "temperature": 0,
        "tools": [TOOL, {**TOOL, "name": "define"}],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "Look up the word cat."}],
    }
    kinds = assert_anthropic_block_order(stream_events(client, body))
    assert kinds and set(kinds) == {"tool_use"}


@pytest.mark.timeout(60)
def test_earlier_thinking_changes_nothing_under_a_template_that_drops_it(client):
    """The bundled SmolLM2 template reads no `reasoning_content`: an assistant's earlier
    thinking, as `thinking` blocks or chat's `reasoning_content` / `reasoning`, leaves the
    prompt as it was (the Qwen3 template renders it: tests/test_reasoning_server.py,
    tests/test_anthropic_messages.py)."""

    def count(assistant_content) -> int:
        messages = [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": assistant_content},
            {"role": "user", "content": "And 3+3?"},
        ]
        response = client.post("/v1/messages/count_tokens", json={"messages": messages})
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    text = {"type": "text", "text": "4"}
    thinking = {"type": "thinking", "thinking": "Two plus two.", "signature": "sig"}
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    assert count([thinking, text]) == count([redacted, text]) == count([text])
    body = {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": [thinking, text]},
                                          {"role": "user", "content": "Bye"}]}  # fmt: skip
    assert client.post("/v1/messages", json=body).status_code == 200

    def chat(path: str, **reasoning) -> dict:
        messages = [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4", **reasoning},
            {"role": "user", "content": "And 3+3?"},
        ]
        extra = {"max_tokens": 1} if path == "/v1/chat/completions" else {}
        response = client.post(path, json={"messages": messages, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    prompt = chat("/apply-template", reasoning_content="Two plus two.")["prompt"]
    assert prompt == chat("/apply-template", reasoning="Two.")["prompt"]
    assert prompt == chat("/apply-template")["prompt"]
    usage = chat("/v1/chat/completions", reasoning_content="Two plus two.")["usage"]
    assert usage["prompt_tokens"] == chat("/v1/chat/completions")["usage"]["prompt_tokens"]
