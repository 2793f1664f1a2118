"""Issue 22's "done when": hostile requests, 20 at a time beside innocent ones, over HTTP,
through the router and over gRPC, against one live server (bundled model, `--grpc-port`).

Each hostile request is one a user could send today to hurt others: logits pushed to inf
(a temperature of 1e-40, a repetition penalty of 1e-30), a grammar that ends while
`min_tokens` still wants tokens, NaN and infinity where JSON lets them through, limits passed
by orders of magnitude (stop strings, logprobs, `n`, tools, metadata, schema size, body size).
Where a limit applies it gets a 400 / 413 (OpenAI error shape) or INVALID_ARGUMENT; where none
does, an ordinary answer. The innocent requests beside them must get exactly the text they get
alone, no 5xx, and the server must stay up with its memory back near where it started.
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest
from cluster_process import ClusterProcess, free_consecutive_ports
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect

pytestmark = [pytest.mark.milestone("m21"), pytest.mark.timeout(900)]

API_KEY = "hostile-test-key"
MODEL = "SmolLM2-135M-Instruct"
CONCURRENT_HOSTILE = 20
ROUNDS = 2
RSS_SLACK_MB = 50
INNOCENT = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}  # fmt: skip
USER = [{"role": "user", "content": "Say hi."}]


def _json(body) -> str:
    return json.dumps(body)  # NaN / Infinity pass as the bare words Python's parser accepts


def _hostile_http() -> list[tuple[str, str, str, set[int]]]:
    """(name, path, raw JSON body, the statuses it may get)."""
    chat, completions, responses = "/v1/chat/completions", "/v1/completions", "/v1/responses"
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,8}"} for i in range(5000)},
    }
    tools = [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}
        for i in range(5000)
    ]
    ok, refused = {200}, {400}
    return [
        ("tiny_temperature_logprobs", completions,
         _json({**INNOCENT, "prompt": "Hello", "temperature": 1e-40, "logprobs": 3}), ok),
        ("tiny_temperature_chat", chat,
         _json({"model": MODEL, "messages": USER, "max_tokens": 6, "temperature": 1e-40}), ok),
        ("tiny_repetition_penalty", completions,
         _json({**INNOCENT, "temperature": 1, "repetition_penalty": 1e-30}), refused),
        ("ended_grammar_min_tokens", chat,
         _json({"model": MODEL, "messages": USER, "max_tokens": 8, "min_tokens": 5,
                "logprobs": True, "structured_outputs": {"choice": ["a"]}}), ok),
        ("nan_temperature", completions, _json({**INNOCENT, "temperature": float("nan")}),
         refused),
        ("inf_top_p", completions, _json({**INNOCENT, "top_p": float("inf")}), refused),
        ("huge_presence_penalty", completions,
         _json({**INNOCENT, "presence_penalty": 1e308}), refused),
        ("many_stop_strings", completions,
         _json({**INNOCENT, "stop": [f"s{i}" for i in range(20000)]}), refused),
        ("huge_logprobs", completions, _json({**INNOCENT, "logprobs": 10**6}), refused),
        ("huge_n", completions, _json({**INNOCENT, "n": 10**6}), refused),
        ("huge_max_tokens", completions, _json({**INNOCENT, "max_tokens": 10**12}), refused),
        ("huge_schema", chat,
         _json({"model": MODEL, "messages": USER, "max_tokens": 8, "response_format": {
             "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}), refused),
        ("many_tools", chat,
         _json({"model": MODEL, "messages": USER, "max_tokens": 8, "tools": tools}), refused),
        ("big_metadata", responses,
         _json({"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                "metadata": {f"k{i}": "v" * 512 for i in range(17)}}), refused),
        ("oversized_body", completions, _json({**INNOCENT, "prompt": "a " * (3 << 20)}), {413}),
    ]  # fmt: skip


def _hostile_grpc() -> list[tuple[str, dict, grpc.StatusCode]]:
    """(name, make_request keywords, the status it must get; OK: an ordinary answer)."""
    schema = json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    )
    base = {"prompt": "The capital of France is", "max_tokens": 8}
    ok, invalid = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
    return [
        ("tiny_temperature", {**base, "temperature": 1e-40}, ok),
        ("tiny_repetition_penalty", {**base, "temperature": 1, "repetition_penalty": 1e-30},
         invalid),
        ("nan_temperature", {**base, "temperature": float("nan")}, invalid),
        ("inf_top_p", {**base, "top_p": float("inf")}, invalid),
        ("many_stop_strings", {**base, "stop": [f"s{i}" for i in range(20000)]}, invalid),
        ("many_stop_token_ids", {**base, "stop_token_ids": list(range(10000))}, invalid),
        ("huge_max_tokens", {**base, "max_tokens": 2**32 - 1}, invalid),
        ("ended_grammar_min_tokens", {**base, "min_tokens": 5,
                                      "structured_outputs": {"choice": ["a"]}}, ok),
        ("huge_schema", {**base, "structured_outputs": {"json": schema}}, invalid),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def stack():
    """One server (HTTP + gRPC) and a router in front of it."""
    grpc_port = free_port()
    server = LiveServer.start(
        "--num-kv-blocks", "512", "--max-queue-len", "128", "--grpc-port", str(grpc_port),
        api_key=API_KEY,
    )  # fmt: skip
    server.grpc_target = f"127.0.0.1:{grpc_port}"
    router_port = free_consecutive_ports(1)
    router = ClusterProcess.start(
        "router", router_port, "--worker", server.url, "--port", str(router_port),
        "--health-interval", "0.5", api_key=API_KEY, num_workers=1,
    )  # fmt: skip
    yield server, router
    router.stop()
    server.stop()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _innocent_text(url: str) -> str:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(f"{url}/v1/completions", json=INNOCENT, headers=headers, timeout=240)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


async def _http_storm(url: str, expected_text: str) -> list[str]:
    """ROUNDS rounds of CONCURRENT_HOSTILE hostile requests with innocent ones between them;
    the list of what went wrong (empty: nothing)."""
    hostile = _hostile_http()
    problems: list[str] = []
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=240) as client:

        async def send_hostile(name: str, path: str, body: str, allowed: set[int]) -> None:
            reply = await client.post(path, content=body)
            if reply.status_code not in allowed:
                problems.append(f"{name}: {reply.status_code} {reply.text[:300]}")
            elif reply.status_code != 200:
                error = reply.json().get("error", {})
                if not error.get("message") or "type" not in error:
                    problems.append(f"{name}: not the OpenAI error shape: {reply.text[:300]}")

        async def send_innocent(index: int) -> None:
            reply = await client.post("/v1/completions", content=_json(INNOCENT))
            if reply.status_code != 200:
                problems.append(f"innocent {index}: {reply.status_code} {reply.text[:300]}")
            elif reply.json()["choices"][0]["text"] != expected_text:
                problems.append(f"innocent {index}: {reply.json()['choices'][0]['text']!r}")

        for _ in range(ROUNDS):
            tasks = []
            for i in range(CONCURRENT_HOSTILE):
                if i % 4 == 0:
                    tasks.append(send_innocent(i))
                tasks.append(send_hostile(*hostile[i % len(hostile)]))
            await asyncio.gather(*tasks)
    return problems


async def _grpc_storm(target: str, expected_text: str) -> list[str]:
    hostile = _hostile_grpc()
    problems: list[str] = []
    async with await connect(target, api_key=API_KEY) as client:

        async def send(name: str, request: dict, expected: grpc.StatusCode) -> None:
            try:
                reply = await client.generate(**request)
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                code, reply = exc.code(), exc.details()
            if code != expected:
                problems.append(f"grpc {name}: {code} {str(reply)[:300]}")

        async def innocent(index: int) -> None:
            reply = await client.generate(INNOCENT["prompt"], max_tokens=8, temperature=0)
            if reply.text != expected_text:
                problems.append(f"grpc innocent {index}: {reply.text!r}")

        for _ in range(ROUNDS):
            tasks = [send(*hostile[i % len(hostile)]) for i in range(CONCURRENT_HOSTILE)]
            tasks += [innocent(i) for i in range(4)]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            problems += [f"grpc: {r!r}" for r in results if isinstance(r, BaseException)]
    return problems


def _assert_alive(server: LiveServer) -> None:
    assert server.process.poll() is None, server.log()[-5000:]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_hostile_requests_over_http_router_and_grpc(stack):
    server, router = stack
    expected = _innocent_text(server.url)
    assert _innocent_text(router.url) == expected
    # One quiet round first, so what the server allocates once (grammar caches, pools, the
    # pages of the KV blocks these prompts use) is in the baseline.
    assert not asyncio.run(_http_storm(server.url, expected))
    server.wait_idle()
    baseline = _rss_mb(server.process.pid)

    problems = asyncio.run(_http_storm(server.url, expected))
    problems += [f"router {p}" for p in asyncio.run(_http_storm(router.url, expected))]
    problems += asyncio.run(_grpc_storm(server.grpc_target, expected))
    assert not problems, "\n".join(problems)
    _assert_alive(server)
    assert _innocent_text(router.url) == expected

    stats = server.wait_idle(timeout=120)
    assert stats["num_sequences_in_flight"] == 0, stats
    deadline = time.monotonic() + 60
    while (rss := _rss_mb(server.process.pid)) > baseline + RSS_SLACK_MB:
        assert time.monotonic() < deadline, f"RSS {rss:.0f} MB, started at {baseline:.0f} MB"
        time.sleep(1)
