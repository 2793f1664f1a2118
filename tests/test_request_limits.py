"""Request limits, unknown fields and typed parameter errors, through a live server started
with tight `--max-*` limits: each limit is a 400 naming its `param` (and the flag), a request
at a limit is served, an unknown field is a 400 naming it (OpenAI's "Unrecognized request
argument supplied"), the fields the openai SDK sends are accepted, `/generate` takes
`max_tokens`, and the server keeps serving. Then, in-process: ParamError is the only
exception that becomes a 400; a bare ValueError is a 500.
"""

from __future__ import annotations

import argparse
import pickle

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from live_server import LiveServer

from nanollmserve.api.errors import error_from_exception, from_param_error, install_error_handlers
from nanollmserve.errors import ParamError, UserError
from nanollmserve.request_limits import RequestLimits, add_limit_args, limits_from_args
from nanollmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.milestone("m02")

LIMIT_ARGS = ["--max-n", "3", "--max-logprobs", "2", "--max-stop-strings", "2"]
LIMIT_ARGS += ["--max-stop-string-length", "8", "--max-stop-token-ids", "2"]
LIMIT_ARGS += ["--max-logit-bias", "2", "--max-messages", "3"]
CHAT = [{"role": "user", "content": "Hi"}]
FOUR = CHAT * 4


@pytest.fixture(scope="module")
def server():
    server = LiveServer.start("--num-kv-blocks", "64", *LIMIT_ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def _error(response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("path", "body", "param", "flag"),
    [
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop", "stop-strings 2"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "stop": "123456789"},
            "stop",
            "stop-string-length 8",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stop_token_ids": [1, 2, 3]},
            "stop_token_ids",
            "stop-token-ids 2",
        ),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logit_bias": dict.fromkeys("123", 1)},
            "",
            "logit-bias 2",
        ),
        ("/v1/completions", {"prompt": "hi", "n": 4}, "n", "n 3"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 3}, "logprobs", "logprobs 2"),
        (
            "/v1/chat/completions",
            {"messages": CHAT, "logprobs": True, "top_logprobs": 3},
            "top_logprobs",
            "logprobs 2",
        ),
        ("/v1/chat/completions", {"messages": FOUR}, "messages", "messages 3"),
        ("/v1/responses", {"input": FOUR}, "input", "messages 3"),
        ("/tokenize", {"messages": FOUR}, "messages", "messages 3"),
        ("/generate", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop", "stop-strings 2"),
        (
            "/batch_generate",
            {"prompts": ["hi"], "stop": ["123456789"]},
            "stop",
            "stop-string-length 8",
        ),
    ],
)
def test_each_limit_is_a_400_naming_the_param(http, path, body, param, flag):
    param = param or "logit_bias"
    error = _error(http.post(path, json=body))
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value"
    assert "more than this server allows" in error["message"] or "longer" in error["message"]
    assert f"(--max-{flag})" in error["message"], error


def test_requests_at_the_limits_are_served(server, http):
    body = {"prompt": "One, two,", "max_tokens": 2, "n": 3, "logprobs": 2}
    body |= {"stop": ["12345678", "x"], "stop_token_ids": [1, 2], "logit_bias": {"5": 1, "6": 1}}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 3
    chat = {"messages": CHAT * 3, "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 2}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    stats = server.wait_idle()
    assert stats["is_healthy"] and stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/responses", {"input": "hi"}),
        ("/generate", {"prompt": "hi"}),
        ("/batch_generate", {"prompts": ["hi"]}),
        ("/tokenize", {"prompt": "hi"}),
        ("/detokenize", {"tokens": [1]}),
    ],
)
def test_unknown_fields_are_a_400_naming_them(http, path, body):
    error = _error(http.post(path, json=body | {"foo": 1}))
    assert error["message"] == "Unrecognized request argument supplied: foo"
    assert error["param"] == "foo" and error["code"] == "unknown_parameter"
    error = _error(http.post(path, json=body | {"foo": 1, "bar": 2}))
    assert error["message"] == "Unrecognized request arguments supplied: foo, bar"


def test_unknown_keys_inside_messages_are_ignored(http):
    # Clients echo back the assistant message they received, with keys we do not declare.
    echoed = {"role": "assistant", "content": "Hello", "refusal": None, "tool_calls": None}
    body = {"messages": [*CHAT, echoed, *CHAT], "max_completion_tokens": 1}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_generate_takes_max_tokens_as_an_alias(http):
    body = {"prompt": "Count: 1, 2, 3, 4,", "max_tokens": 3}
    result = http.post("/generate", json=body).json()
    assert result["tokens_generated"] == 3 and result["finish_reason"] == "length", result
    same = http.post("/generate", json={"prompt": body["prompt"], "max_new_tokens": 3}).json()
    assert same["generated_text"] == result["generated_text"]
    batch = http.post("/batch_generate", json={"prompts": ["Count: 1, 2,"], "max_tokens": 2})
    assert batch.json()["tokens_generated"] == [2], batch.text
    error = _error(http.post("/generate", json=body | {"max_new_tokens": 3}))
    assert error["param"] == "max_new_tokens" and "not both" in error["message"]
    assert _error(http.post("/generate", json={"prompt": "x", "max_tokens": 0}))["param"] == (
        "max_tokens"
    )


def test_openai_client_fields_are_accepted_and_extra_body_is_checked(server):
    client = server.openai()
    chat = client.chat.completions.create(
        model="",
        messages=CHAT,
        max_completion_tokens=2,
        user="u1",
        metadata={"k": "v"},
        store=False,
        parallel_tool_calls=False,
        service_tier="auto",
        reasoning_effort="low",
        prompt_cache_key="key",
        safety_identifier="s1",
        stream_options=None,
        extra_body={"top_k": 1, "ignore_eos": True, "min_tokens": 2},
    )
    assert chat.usage.completion_tokens == 2
    completion = client.completions.create(
        model="", prompt="hi", max_tokens=1, best_of=1, user="u1", extra_body={"min_p": 0.1}
    )
    assert completion.usage.completion_tokens == 1
    response = client.responses.create(
        input="hi",
        max_output_tokens=2,
        metadata={"k": "v"},
        user="u1",
        service_tier="auto",
        parallel_tool_calls=False,
        truncation="disabled",
        store=False,
    )
    assert response.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="", messages=CHAT, max_tokens=2, extra_body={"use_beam_search": True}
        )
    assert info.value.param == "use_beam_search" and info.value.code == "unknown_parameter"
    assert "Unrecognized request argument supplied: use_beam_search" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt="hi", max_tokens=2, n=1, best_of=2)
    assert info.value.param == "best_of"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(input="hi", background=True)
    assert info.value.param == "background"


def test_server_keeps_serving_after_limit_errors(server):
    result = server.openai().completions.create(model="", prompt="One, two,", max_tokens=3)
    assert result.usage.completion_tokens >= 1
    stats = server.wait_idle()
    assert stats["is_healthy"] and stats["num_free_blocks"] == stats["num_total_blocks"]


# -- in process ------------------------------------------------------------------------------
def test_param_error_carries_its_param():
    with pytest.raises(ParamError) as info:
        SamplingParams(top_p=2)
    assert info.value.param == "top_p" and str(info.value).startswith("top_p must be")
    assert isinstance(info.value, ValueError)
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.param, str(copy)) == ("top_p", str(info.value))
    with pytest.raises(ParamError) as info:
        SamplingParams(min_tokens=5, max_tokens=2)
    assert info.value.param == "min_tokens"
    with pytest.raises(ParamError) as info:
        SamplingParams(logit_bias={"x": 1})
    assert info.value.param == "logit_bias"


def test_only_param_errors_are_400s():
    err = from_param_error(
        ParamError("max_tokens must be >= 1", param="max_tokens"),
        {"max_tokens": "max_completion_tokens"},
    )
    assert (err.status_code, err.param) == (400, "max_completion_tokens")
    assert error_from_exception(ParamError("bad", param="prompt")).status_code == 400
    err = error_from_exception(ValueError("prompt: an internal bug"))
    assert (err.status_code, err.code, err.param) == (500, "internal_error", None)

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/bug")
    async def bug():
        raise ValueError("top_p looks like a param but is a bug")

    @app.get("/param")
    async def param():
        raise ParamError("stop has 99 strings", param="stop")

    with TestClient(app, raise_server_exceptions=False) as client:
        error = _error(client.get("/bug"), 500)
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert error["param"] is None and "top_p" not in error["message"]
        error = _error(client.get("/param"), 400)
        assert error["param"] == "stop" and error["message"] == "stop has 99 strings"


def test_limit_flags_and_their_checks():
    parser = argparse.ArgumentParser()
    add_limit_args(parser)
    assert limits_from_args(parser.parse_args([])) == RequestLimits()
    assert limits_from_args(parser.parse_args(["--max-n", "2"])).max_n == 2
    for bad in (["--max-n", "0"], ["--max-logprobs", "21"], ["--max-stop-strings", "-1"]):
        with pytest.raises(UserError, match=bad[0]):
            limits_from_args(parser.parse_args(bad))
    limits = RequestLimits(max_stop_strings=0)
    limits.check_params(SamplingParams())
    with pytest.raises(ParamError, match="--max-stop-strings 0") as info:
        limits.check_params(SamplingParams(stop=["x"]))
    assert info.value.param == "stop"
