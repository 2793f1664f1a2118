"""One admission path for every frontend (issue 22): the same hostile inputs get the same
refusal over HTTP (400 naming the param) and gRPC (INVALID_ARGUMENT naming it), because the
limits and the generation defaults are the engine's request policy, not one frontend's; the
limits on tools, `user` and `metadata`; engine request ids are always the server's (a gRPC
`request_id` of `X#0` cannot touch child 0 of an `n = 2` request `X`); a client's id is
echoed back and logged quoted, so a newline in it forges no log line.

One live server (default limits, a gRPC port, a generation_config.json with temperature 0,
the request log on), driven with httpx and the project's gRPC client.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import grpc
import httpx
import pytest
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect

pytestmark = [pytest.mark.milestone("m21"), pytest.mark.timeout(300)]

NUM_BLOCKS = 128
CHAT = [{"role": "user", "content": "Hi"}]
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("genconfig")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    grpc_port = free_port()
    live = LiveServer.start(
        "--num-kv-blocks",
        str(NUM_BLOCKS),
        "--grpc-port",
        str(grpc_port),
        "--generation-config",
        str(folder),
    )
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def run_grpc(server, body):
    """`await body(client)` with a fresh gRPC client on a fresh event loop."""

    async def main():
        async with await connect(server.grpc_target) as client:
            return await body(client)

    return asyncio.run(main())


def grpc_refusal(server, body) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        run_grpc(server, body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return info.value


def http_refusal(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    return error


def wait_for_log(server, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in server.log():
        assert time.monotonic() < deadline, (text, server.log()[-3000:])
        time.sleep(0.1)
    return server.log()


STOP_STRINGS = [f"s{i}" for i in range(20_000)]

# (case, extra body of an HTTP completion, gRPC sampling keywords or None: no such field,
# the param both name)
HOSTILE = [
    ("20k stop strings", {"stop": STOP_STRINGS}, {"stop": STOP_STRINGS}, "stop"),
    ("5k-character stop", {"stop": ["x" * 5000]}, {"stop": ["x" * 5000]}, "stop"),
    (
        "10k stop_token_ids",
        {"stop_token_ids": list(range(10_000))},
        {"stop_token_ids": list(range(10_000))},
        "stop_token_ids",
    ),
    ("temperature NaN", {"temperature": math.nan}, {"temperature": math.nan}, "temperature"),
    ("temperature inf", {"temperature": math.inf}, {"temperature": math.inf}, "temperature"),
    ("temperature 1e308", {"temperature": 1e308}, {"temperature": 1e308}, "temperature"),
    ("max_tokens 1e12", {"max_tokens": 10**12}, {"max_tokens": 2**32 - 1}, "max_tokens"),
    ("100k logit_bias", {"logit_bias": {str(i): 1 for i in range(100_000)}}, None, "logit_bias"),
    ("n 1e6", {"n": 10**6}, None, "n"),
    ("logprobs 1e6", {"logprobs": 10**6}, None, "logprobs"),
]


@pytest.mark.parametrize(
    ("case", "body", "sampling", "param"), HOSTILE, ids=[c[0] for c in HOSTILE]
)
def test_hostile_inputs_get_the_same_refusal_over_http_and_grpc(
    server, http, case, body, sampling, param
):
    content = json.dumps({"prompt": PROMPT, **body})  # NaN and Infinity as Python writes them
    response = http.post(
        "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    http_refusal(response, param)
    if sampling is None:
        return  # the gRPC API has no such field
    error = grpc_refusal(server, lambda c: c.generate(PROMPT, **sampling))
    assert param in error.details(), error.details()
    error = grpc_refusal(server, lambda c: c.batch_generate([PROMPT, PROMPT], **sampling))
    assert param in error.details(), error.details()


def test_limit_messages_name_the_flag_over_both_protocols(server, http):
    body = {"prompt": PROMPT, "stop": STOP_STRINGS}
    message = http_refusal(http.post("/v1/completions", json=body), "stop")["message"]
    assert "(--max-stop-strings 16)" in message
    error = grpc_refusal(server, lambda c: c.generate(PROMPT, stop=STOP_STRINGS))
    assert error.details() == message
    chat = [{"role": "user", "content": "hi"}] * 1025
    error = grpc_refusal(server, lambda c: c.generate(messages=chat, max_tokens=1))
    assert "(--max-messages 1024)" in error.details()


def _chat_tools(count: int) -> list[dict]:
    parameters = {"type": "object", "properties": {}}
    return [
        {"type": "function", "function": {"name": f"f{i}", "parameters": parameters}}
        for i in range(count)
    ]


def _response_tools(count: int) -> list[dict]:
    parameters = {"type": "object", "properties": {}}
    return [{"type": "function", "name": f"f{i}", "parameters": parameters} for i in range(count)]


METADATA_17 = {f"k{i}": "v" for i in range(17)}
CHAT_BODY = {"messages": CHAT, "max_tokens": 1}
RESPONSES_BODY = {"input": "hi", "max_output_tokens": 1}
FIELD_LIMITS = [
    (
        "/v1/chat/completions",
        {**CHAT_BODY, "tools": _chat_tools(129), "tool_choice": "none"},
        "tools",
    ),
    (
        "/v1/responses",
        {**RESPONSES_BODY, "tools": _response_tools(129), "tool_choice": "none"},
        "tools",
    ),
    ("/v1/chat/completions", {**CHAT_BODY, "user": "u" * 100_000}, "user"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "user": "u" * 100_000}, "user"),
    ("/v1/responses", {**RESPONSES_BODY, "user": "u" * 100_000}, "user"),
    ("/v1/chat/completions", {**CHAT_BODY, "metadata": METADATA_17}, "metadata"),
    ("/v1/responses", {**RESPONSES_BODY, "metadata": METADATA_17}, "metadata"),
    ("/v1/responses", {**RESPONSES_BODY, "metadata": {"k" * 65: "v"}}, "metadata"),
    ("/v1/chat/completions", {**CHAT_BODY, "metadata": {"k": "v" * 513}}, "metadata"),
]


@pytest.mark.parametrize(("path", "body", "param"), FIELD_LIMITS)
def test_tools_user_and_metadata_limits_are_400s(http, path, body, param):
    error = http_refusal(http.post(path, json=body), param)
    assert "--max-" in error["message"], error


def test_requests_at_the_field_limits_are_served(http):
    metadata = {f"k{i}": "v" * 512 for i in range(15)} | {"k" * 64: "v"}
    body = {**CHAT_BODY, "tools": _chat_tools(128), "tool_choice": "none", "user": "u" * 256}
    response = http.post("/v1/chat/completions", json=body | {"metadata": metadata})
    assert response.status_code == 200, response.text
    body = {**RESPONSES_BODY, "tools": _response_tools(128), "tool_choice": "none"}
    response = http.post("/v1/responses", json=body | {"metadata": metadata, "store": False})
    assert response.status_code == 200, response.text


def test_generation_defaults_apply_over_grpc_too(server, http):
    async def body(client):
        greedy = await client.generate(PROMPT, max_tokens=12, ignore_eos=True, temperature=0)
        unset = [
            await client.generate(PROMPT, max_tokens=12, ignore_eos=True, seed=seed)
            for seed in (1, 2, 3)
        ]
        return greedy, unset

    greedy, unset = run_grpc(server, body)
    # temperature 0 from generation_config.json: every seed gives the greedy text.
    assert [reply.text for reply in unset] == [greedy.text] * 3
    body = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "seed": 1}
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == greedy.text


def test_a_client_id_naming_another_requests_child_leaves_it_alone(server):
    """Today's bug: a gRPC `request_id` of `X#0` was the engine key of child 0 of an n = 2
    request `X`, which it aborted, leaving that HTTP stream hanging."""
    body = {"messages": CHAT, "n": 2, "max_tokens": 32, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with (
        server.client(timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        victim = first["id"]  # the HTTP request is admitted and running now
        reply, chunks = run_grpc(server, lambda c: _same_id_twice(c, f"{victim}#0"))
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert reply.request_id == f"{victim}#0" and reply.completion_tokens == 4
    assert {c.request_id for c in chunks} == {f"{victim}#0"}
    assert sum(len(c.token_ids) for c in chunks) == 4
    assert events[-1] == "[DONE]"
    chunks_json = [json.loads(e) for e in events[:-1]]
    reasons = [c["finish_reason"] for e in chunks_json for c in e["choices"] if c["finish_reason"]]
    assert sorted(reasons) == ["length", "length"], chunks_json[-3:]
    assert chunks_json[-1]["usage"]["completion_tokens"] == 2 * 32
    stats = server.wait_idle()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


async def _same_id_twice(client, request_id: str):
    """A unary call and a stream at once, both with the client id `request_id`."""
    sampling = {"max_tokens": 4, "ignore_eos": True, "request_id": request_id}
    streamed = _drain(client.stream(PROMPT, **sampling))
    return await asyncio.gather(client.generate(PROMPT, **sampling), streamed)


async def _drain(stream):
    return [chunk async for chunk in stream]


def test_x_request_id_is_echoed_and_logged_quoted(server, http):
    headers = {"X-Request-Id": "client-42 'q'"}
    response = http.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=headers
    )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-42 'q'"
    assert response.json()["id"].startswith("cmpl-")  # the server's id, not the client's
    wait_for_log(server, "client_request_id=\"client-42 'q'\"")
    refused = http.post("/v1/completions", json={"prompt": PROMPT, "n": 0}, headers=headers)
    assert refused.status_code == 400 and refused.headers["x-request-id"] == headers["X-Request-Id"]
    http_refusal(
        http.post("/v1/completions", json={"prompt": PROMPT}, headers={"X-Request-Id": "r" * 257}),
        "X-Request-Id",
    )


def test_a_newline_in_a_grpc_request_id_forges_no_log_line(server):
    forged = "evil\nrequest forged-1: status=finished"
    reply = run_grpc(server, lambda c: c.generate(PROMPT, max_tokens=2, request_id=forged))
    assert reply.request_id == forged  # echoed as sent
    log = wait_for_log(server, "client_request_id='evil\\nrequest forged-1")
    assert [line for line in log.splitlines() if line.startswith("request forged-1")] == []
    error = grpc_refusal(server, lambda c: c.generate(PROMPT, request_id="r" * 257))
    assert "request_id" in error.details()


def test_twenty_hostile_calls_at_once_leave_innocent_ones_served(server):
    async def body(client):
        async def hostile_grpc():
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(PROMPT, stop=STOP_STRINGS)
            return info.value.code()

        async def hostile_http(http):
            response = await http.post(
                "/v1/completions", json={"prompt": PROMPT, "stop": STOP_STRINGS}
            )
            return response.status_code

        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            innocent_http = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            innocent_grpc = client.generate(PROMPT, max_tokens=4)
            results = await asyncio.gather(
                innocent_http,
                innocent_grpc,
                *(hostile_grpc() for _ in range(20)),
                *(hostile_http(http) for _ in range(20)),
            )
        return results

    innocent_http, innocent_grpc, *hostile = run_grpc(server, body)
    assert innocent_http.status_code == 200, innocent_http.text
    assert innocent_grpc.completion_tokens == 4
    assert hostile == [grpc.StatusCode.INVALID_ARGUMENT] * 20 + [400] * 20
    stats = server.wait_idle()
    assert stats["is_healthy"] and stats["num_free_blocks"] == stats["num_total_blocks"]
    assert "Traceback" not in server.log(), server.log()[-3000:]
