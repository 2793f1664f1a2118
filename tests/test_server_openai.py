"""The OpenAI surface of a live server, driven by the official `openai` SDK with strict
response validation: models, completions (every prompt form), chat, streaming with usage,
n, stop, logprobs, seeds, exact usage, and the Responses API (create, get, delete,
previous_response_id, streaming events)."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
from live_server import shared_server

pytestmark = pytest.mark.milestone("m02")

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def _num_tokens(server, **body) -> int:
    with server.client() as http:
        return http.post("/tokenize", json=body).json()["count"]


def test_models(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    extra = models[0].model_extra
    assert extra["root"] == MODEL and extra["max_model_len"] == 4096
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_prompt_forms(server, client):
    with server.client() as http:
        ids = http.post("/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    forms = {
        "string": "The sky is",
        "list of strings": ["The sky is", "Water is"],
        "token ids": ids,
        "list of token-id lists": [ids, ids[:2]],
    }
    results = {}
    for name, prompt in forms.items():
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        results[name] = result
        num_prompts = 2 if name.startswith("list of") else 1
        assert [c.index for c in result.choices] == list(range(num_prompts)), name
        assert all(c.finish_reason in ("stop", "length") for c in result.choices)
        assert num_prompts <= result.usage.completion_tokens <= 4 * num_prompts
    # Greedy: text and token-id forms of the same prompt give the same completion.
    assert results["string"].choices[0].text == results["token ids"].choices[0].text
    assert results["list of strings"].choices[0].text == results["string"].choices[0].text
    assert results["string"].usage.prompt_tokens == len(ids)


def test_chat_completion_and_exact_usage(server, client):
    result = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0, logprobs=True
    )
    assert result.object == "chat.completion"
    choice = result.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    usage = result.usage
    assert usage.prompt_tokens == _num_tokens(server, messages=CHAT)
    assert usage.completion_tokens == len(choice.logprobs.content)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens % 16 == 0


def test_cached_tokens_are_reported(client):
    # A unique prefix so nothing is cached before; 40+ tokens so whole blocks can be reused.
    prompt = f"{uuid.uuid4().hex} " + "one two three four five six seven eight nine ten " * 4
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0


def test_chat_streaming_matches_non_streaming(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    choice_chunks = [c.choices[0] for c in chunks[:-1]]
    assert all(c.finish_reason is None for c in choice_chunks[:-1])
    assert choice_chunks[-1].finish_reason == full.choices[0].finish_reason
    assert "".join(c.delta.content or "" for c in choice_chunks) == full.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_streaming_matches_non_streaming(server, client):
    # The SDK's Completion type makes finish_reason required, but OpenAI (and this server)
    # stream it as null until the last chunk, so streamed completions are read unstrictly.
    loose = server.openai(strict=False)
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(
        loose.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 12
    with (
        server.client() as http,
        http.stream("POST", "/v1/completions", json={**kwargs, "stream": True}) as response,
    ):
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_n_choices(client):
    result = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, n=2, temperature=1.0, seed=7, stream=True
        )
    )
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index].append(choice.finish_reason)
    assert texts == {c.index: c.message.content for c in result.choices}
    for reasons in finishes.values():
        assert reasons[-1] in ("stop", "length") and not any(reasons[:-1])


def test_stop_string(client):
    prompt = "The days of the week are Monday,"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    text = base.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    stopped = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_logprobs(client):
    result = client.completions.create(
        model=MODEL, prompt="Paris is the capital of", max_tokens=5, temperature=0, logprobs=3
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == result.usage.completion_tokens
    assert "".join(logprobs.tokens) == result.choices[0].text
    assert logprobs.text_offset[0] == 0
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(logprob)
        assert top[token] == pytest.approx(logprob)

    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the top token is sampled
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob <= 0


def test_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0)
    first = client.completions.create(**kwargs, seed=1234).choices[0].text
    again = client.completions.create(**kwargs, seed=1234).choices[0].text
    others = {client.completions.create(**kwargs, seed=s).choices[0].text for s in (1, 2, 3)}
    assert first == again
    assert len(others | {first}) > 1


def test_echo(client):
    result = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=True)
    assert result.choices[0].text.startswith("Hello")


def test_responses_create_get_delete_and_continue(client):
    first = client.responses.create(
        model=MODEL,
        input="What is the capital of France?",
        instructions="Answer in one sentence.",
        max_output_tokens=16,
        temperature=0,
    )
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert "Paris" in first.output_text
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    fetched = client.responses.retrieve(first.id)
    assert fetched.output_text == first.output_text

    follow = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "And what is the capital of Germany?"}],
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0,
    )
    assert follow.previous_response_id == first.id
    assert "Berlin" in follow.output_text
    # The follow-up's prompt holds the whole first exchange.
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 8

    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id=first.id)

    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_streaming_events(client):
    kwargs = dict(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0)
    full = client.responses.create(**kwargs, store=False)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    # The last event says how it ended: completed, or incomplete (max_output_tokens).
    last = "response.incomplete" if full.status == "incomplete" else "response.completed"
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert kinds[:4] == head and kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == full.output_text
    assert events[-1].response.output_text == full.output_text
    assert client.responses.retrieve(events[-1].response.id).output_text == full.output_text


def test_openapi_schema(server):
    schema = httpx.get(f"{server.url}/openapi.json", headers=server.headers).json()
    paths = schema["paths"]
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert path in paths
    responses = paths["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in responses and "400" in responses
    request = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert list(request)[:3] == ["messages", "model", "frequency_penalty"]
    assert "description" in request["top_k"]
    json.dumps(schema)
