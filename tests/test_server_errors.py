"""Every error path of a live server answers in OpenAI's shape with the right status, and a
bad request never harms the server: 400 (malformed JSON, schema errors, context overflow
naming the numbers, top_logprobs > 20, n out of range, the default request limits, unknown
fields, unsupported features), 401 (API key), 404 (unknown model, response id, route), 405,
413 (body cap), 503 + Retry-After (queue full). tests/test_request_limits.py sets the limits.
"""

from __future__ import annotations

import openai
import pytest
from live_server import shared_server

pytestmark = pytest.mark.milestone("m02")

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    return shared_server()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "param", "needle"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens", "integer"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "greater"),
        ("/v1/completions", {"max_tokens": 3}, "prompt", "required"),
        ("/v1/completions", {"prompt": ""}, "prompt", ""),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n", ""),
        ("/v1/completions", {"prompt": "hi", "n": 129}, "n", "(--max-n 128)"),
        ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, "stop", "strings 16)"),
        ("/v1/completions", {"prompt": "hi", "stop": "x" * 257}, "stop", "length 256)"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * 65}, "stop_token_ids", "64"),
        (
            "/v1/completions",
            {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}},
            "logit_bias",
            "(--max-logit-bias 1024)",
        ),
        ("/v1/completions", {"prompt": "hi", "foo": 1}, "foo", "argument supplied: foo"),
        ("/v1/completions", {"prompt": "hi", "n": 65}, "n", "max-num-seqs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 6}, "logprobs", ""),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", ""),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p", ""),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", ""),
        ("/v1/completions", {"prompt": [999999999]}, "prompt", "49152"),
        ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search", "beam"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "20"),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix", ""),
        ("/v1/chat/completions", {"messages": []}, "messages", ""),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, None, ""),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "20",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "response_format": {"type": "xml"}},
            "response_format",
            "Input should be",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "tools": [{"type": "function"}]},
            "tools.0.function",
            "Field required",
        ),
        (
            "/v1/responses",
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": 5}}},
            "text.format",
            "schema",
        ),
        ("/generate", {"prompt": "hi", "max_new_tokens": -1}, "max_new_tokens", ""),
        ("/generate", {"prompt": "hi", "max_token": 3}, "max_token", "Unrecognized"),
        ("/v1/chat/completions", {"messages": CHAT * 1025}, "messages", "(--max-messages 1024)"),
        ("/batch_generate", {"prompts": []}, "prompts", ""),
        ("/tokenize", {}, "prompt", "exactly one"),
        ("/tokenize", {"messages": []}, "messages", ""),
        ("/detokenize", {"tokens": [-1]}, None, ""),
    ],
)
def test_bad_requests_are_400(http, path, body, param, needle):
    error = _error(http.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    assert needle in error["message"]


def test_malformed_json_is_400(http):
    for raw in (b"{not json", b"", b"[1, 2"):
        response = http.post(
            "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        _error(response, 400)


def test_context_overflow_names_the_numbers(http):
    error = _error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000}), 400)
    assert "4096" in error["message"] and "5000" in error["message"]
    long_prompt = "hello" + " hello" * 4999  # 5000 tokens
    error = _error(http.post("/v1/completions", json={"prompt": long_prompt}), 400)
    assert "4096" in error["message"] and "5000" in error["message"]


def test_unknown_model_and_response_are_404(server, http):
    client = server.openai()
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_doesnotexist")
    _error(http.delete("/v1/responses/resp_doesnotexist"), 404)
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.put("/v1/models"), 405)


def test_api_key_is_required_except_for_health(server):
    import httpx

    assert httpx.get(f"{server.url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        error = _error(response, 401)
        assert error["code"] == "invalid_api_key"
        _error(
            httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers), 401
        )
    bad_client = openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key="wrong",
        max_retries=0,
        _strict_response_validation=True,
    )
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()
    assert httpx.get(f"{server.url}/v1/models", headers=server.headers).status_code == 200


def test_body_over_the_cap_is_413(http):
    body = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    response = http.post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert _error(response, 413)["code"] == "request_too_large"


def test_overload_is_503_with_retry_after(server, http):
    # The shared server admits 64 running + 16 waiting sequences: 100 prompts cannot fit.
    before = server.stats()["num_requests_rejected"]
    response = http.post("/v1/completions", json={"prompt": ["hi"] * 100, "max_tokens": 1})
    error = _error(response, 503)
    assert error["code"] == "overloaded" and error["type"] == "server_error"
    assert int(response.headers["Retry-After"]) >= 1
    stats = server.wait_idle()
    assert stats["num_requests_rejected"] == before + 1
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # admitted ones were undone


def test_server_keeps_serving_after_errors(server):
    client = server.openai()
    result = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3)
    assert result.usage.completion_tokens >= 1
    assert server.stats()["is_healthy"]
