"""llama.cpp's fields on the OpenAI routes, through HTTP with the `openai` client and httpx:
`timings` on /v1/completions and /v1/chat/completions (the top level; a stream's last chunk,
the usage chunk when there is one; left out under `--no-timings`), `n_probs` as the alias of
top logprobs (`logprobs` on completions, `top_logprobs` on chat) with their limits and a 400
naming it for a hostile value or a disagreement, and `tools` on `/apply-template` rendered
as the chat route renders them (the shared live server, and a private one for the flag)."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from live_server import LiveServer, shared_server

pytestmark = pytest.mark.milestone("m30")

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
TIMING_FIELDS = {
    "cache_n",
    "prompt_n",
    "prompt_ms",
    "prompt_per_token_ms",
    "prompt_per_second",
    "predicted_n",
    "predicted_ms",
    "predicted_per_token_ms",
    "predicted_per_second",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as client:
        yield client


def check_timings(timings: dict, usage: dict) -> None:
    """The fields llama.cpp has, consistent with the usage of the same answer."""
    assert set(timings) == TIMING_FIELDS
    assert timings["predicted_n"] == usage["completion_tokens"]
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] >= 0
    n, ms = timings["predicted_n"], timings["predicted_ms"]
    if ms > 0:
        assert math.isclose(timings["predicted_per_second"], 1000 * n / ms, rel_tol=1e-6)
        assert math.isclose(timings["predicted_per_token_ms"], ms / n, rel_tol=1e-6)
    n, ms = timings["prompt_n"], timings["prompt_ms"]
    if n:
        assert math.isclose(timings["prompt_per_second"], 1000 * n / ms, rel_tol=1e-6)
        assert math.isclose(timings["prompt_per_token_ms"], ms / n, rel_tol=1e-6)


def tops(content) -> list[list[str]]:
    """Per token of chat logprobs: the token, then its alternatives' tokens."""
    return [[t.token, *(alt.token for alt in t.top_logprobs)] for t in content]


def events(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_timings_on_completions_and_chat_with_the_openai_client(server):
    client = server.openai()
    completion = client.completions.create(model=None, prompt=PROMPT, max_tokens=5, temperature=0)
    check_timings(completion.model_extra["timings"], completion.usage.model_dump())
    assert completion.model_extra["timings"]["predicted_n"] == 5
    chat = client.chat.completions.create(
        model=None, messages=MESSAGES, max_completion_tokens=4, temperature=0
    )
    check_timings(chat.model_extra["timings"], chat.usage.model_dump())
    # several prompts and choices: totals over the whole answer
    many = client.completions.create(
        model=None, prompt=[PROMPT, "Hello"], n=2, max_tokens=3, temperature=0.5, seed=1
    )
    check_timings(many.model_extra["timings"], many.usage.model_dump())
    assert many.model_extra["timings"]["predicted_n"] == 12


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_has_timings_on_its_last_chunk_only(client, path):
    body = {"max_tokens": 4, "temperature": 0, "n": 2}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": MESSAGES}
    *chunks, last = events(client, path, body)
    assert all("timings" not in chunk for chunk in chunks)
    assert last["choices"][0]["finish_reason"] is not None
    assert 2 <= last["timings"]["predicted_n"] <= 8  # both choices
    *chunks, last = events(client, path, {**body, "stream_options": {"include_usage": True}})
    assert all("timings" not in chunk for chunk in chunks)
    assert last["choices"] == []  # the usage chunk is the last one
    check_timings(last["timings"], last["usage"])


def test_n_probs_is_the_alias_of_top_logprobs(server, client):
    openai = server.openai()
    chat = openai.chat.completions.create(
        model=None,
        messages=MESSAGES,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"n_probs": 2},
    )
    assert [len(t.top_logprobs) for t in chat.choices[0].logprobs.content] == [2, 2, 2]
    same = openai.chat.completions.create(
        model=None,
        messages=MESSAGES,
        max_completion_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"n_probs": 2},
    )
    assert tops(same.choices[0].logprobs.content) == tops(chat.choices[0].logprobs.content)
    plain = openai.chat.completions.create(
        model=None,
        messages=MESSAGES,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"n_probs": 0},  # llama.cpp's default: none
    )
    assert plain.choices[0].logprobs is None
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    aliased = client.post("/v1/completions", json={**body, "n_probs": 3}).json()
    direct = client.post("/v1/completions", json={**body, "logprobs": 3}).json()
    # the same tokens and alternatives (logprob values may differ in the last bits: a
    # prefix-cache hit computes the prompt in other batches)
    assert aliased["choices"][0]["logprobs"]["tokens"] == direct["choices"][0]["logprobs"]["tokens"]
    assert [sorted(top) for top in aliased["choices"][0]["logprobs"]["top_logprobs"]] == [
        sorted(top) for top in direct["choices"][0]["logprobs"]["top_logprobs"]
    ]
    assert all(len(top) == 3 for top in aliased["choices"][0]["logprobs"]["top_logprobs"])
    chat_body = {"messages": MESSAGES, "n_probs": 1, "max_tokens": 3}
    streamed = events(client, "/v1/chat/completions", chat_body)
    assert any(chunk["choices"] and chunk["choices"][0]["logprobs"] for chunk in streamed)


@pytest.mark.parametrize(
    ("path", "fields"),
    [
        ("/v1/chat/completions", '"n_probs": NaN'),
        ("/v1/chat/completions", '"n_probs": Infinity'),
        ("/v1/chat/completions", '"n_probs": -Infinity'),
        ("/v1/chat/completions", '"n_probs": -1'),
        ("/v1/chat/completions", '"n_probs": 21'),  # over --max-logprobs
        ("/v1/chat/completions", '"n_probs": 4294967296'),
        ("/v1/chat/completions", '"n_probs": 1e400'),
        ("/v1/chat/completions", '"n_probs": 99999999999999999999999999999'),
        ("/v1/chat/completions", '"n_probs": 2.5'),
        ("/v1/chat/completions", '"n_probs": 2.0'),
        ("/v1/chat/completions", '"n_probs": true'),
        ("/v1/chat/completions", '"n_probs": "2"'),
        ("/v1/chat/completions", '"n_probs": [2]'),
        ("/v1/chat/completions", '"n_probs": 2, "logprobs": true, "top_logprobs": 3'),
        ("/v1/chat/completions", '"n_probs": 2, "logprobs": false'),
        ("/v1/chat/completions", '"n_probs": 0, "logprobs": true, "top_logprobs": 1'),
        ("/v1/completions", '"n_probs": NaN'),
        ("/v1/completions", '"n_probs": Infinity'),
        ("/v1/completions", '"n_probs": -1'),
        ("/v1/completions", '"n_probs": 6'),  # the legacy logprobs' limit, 5
        ("/v1/completions", '"n_probs": 18446744073709551616'),
        ("/v1/completions", '"n_probs": 1.5'),
        ("/v1/completions", '"n_probs": false'),
        ("/v1/completions", '"n_probs": 2, "logprobs": 3'),
        ("/v1/completions", '"n_probs": 0, "logprobs": 1'),
    ],
)
def test_hostile_n_probs_are_400s_naming_it(client, path, fields):
    head = (
        f'"prompt": "{PROMPT}"'
        if path == "/v1/completions"
        else '"messages": [{"role": "user", "content": "hi"}]'
    )
    body = "{" + head + ', "max_tokens": 2, ' + fields + "}"
    response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "n_probs", error
    assert client.get("/health").status_code == 200


def test_apply_template_renders_tools_as_the_chat_route_does(client):
    with_tools = client.post("/apply-template", json={"messages": MESSAGES, "tools": TOOLS})
    assert with_tools.status_code == 200, with_tools.text
    prompt = with_tools.json()["prompt"]
    assert "get_weather" in prompt and "The weather in a city." in prompt
    without = client.post("/apply-template", json={"messages": MESSAGES}).json()["prompt"]
    assert "get_weather" not in without
    # The chat route renders tools for a forced call (tool_choice "required").
    chat = client.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 1,
            "return_token_ids": True,
        },
    ).json()
    ids = client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert ids == chat["prompt_token_ids"]


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ("null", None),  # no tools: accepted
        ("[]", None),
        ('"get_weather"', "tools"),
        ('[{"type": "function"}]', "tools"),
        ('[{"type": "retrieval", "function": {"name": "f"}}]', "tools"),
        ('[{"type": "function", "function": {"name": ""}}]', "tools"),
        ('[{"type": "function", "function": {"name": "a b"}}]', "tools"),
        ('[{"type": "function", "function": {"name": "' + "x" * 65 + '"}}]', "tools"),
        ('[{"type": "function", "function": {"name": "f", "parameters": NaN}}]', "tools"),
        (json.dumps([TOOLS[0], TOOLS[0]]), "tools"),  # the same name twice
        (json.dumps(TOOLS * 129), "tools"),  # over --max-tools (128)
    ],
)
def test_hostile_apply_template_tools(client, tools, param):
    body = '{"messages": [{"role": "user", "content": "hi"}], "tools": ' + tools + "}"
    response = client.post(
        "/apply-template", content=body, headers={"Content-Type": "application/json"}
    )
    if param is None:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"] or "").startswith(param), error
    assert client.get("/health").status_code == 200


def test_no_timings_leaves_them_out():
    live = LiveServer.start("--no-timings", "--num-kv-blocks", "64")
    try:
        with live.client() as client:
            completion = {"prompt": PROMPT, "max_tokens": 2}
            assert "timings" not in client.post("/v1/completions", json=completion).json()
            chat = {"messages": MESSAGES, "max_tokens": 2}
            assert "timings" not in client.post("/v1/chat/completions", json=chat).json()
            for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
                options = {"stream_options": {"include_usage": True}}
                assert all("timings" not in c for c in events(client, path, {**body, **options}))
                assert all("timings" not in c for c in events(client, path, body))
            native = client.post("/completion", json={"prompt": PROMPT, "n_predict": 2}).json()
            assert native["timings"]["predicted_n"] == 2  # llama.cpp's own route keeps them
    finally:
        live.stop()
