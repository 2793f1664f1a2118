"""GET /debug/steps on a live server: off (404) without --enable-debug-endpoints, behind the
admin key (m27: `--admin-api-key`, never the API key), JSON lines from `since`, hostile
`since` values refused with a 400 naming it; the requests of every frontend (OpenAI HTTP,
streaming, gRPC) are recorded, and the server's record replays identically offline and
exports as a Chrome trace from its URL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import pytest
from live_server import API_KEY, LiveServer, free_port, shared_server

from nanollmserve.api.grpc_client import connect

MODEL = "SmolLM2-135M-Instruct"
ADMIN_KEY = "recorder-admin-key"


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    live = LiveServer.start(
        "--enable-debug-endpoints",
        "--step-record-prompts",
        "--num-kv-blocks",
        "64",
        "--grpc-port",
        str(grpc_port),
        api_key=API_KEY,
        admin_api_key=ADMIN_KEY,
    )
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


@pytest.fixture(scope="module")
def served(server):
    """Requests of every kind, run to the end: two completions (one streamed, with a stop
    string), a chat and a gRPC generate."""
    client = server.openai()
    client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6)
    # Not strict: the SDK's Completion type has no null finish_reason for the chunks.
    stream = server.openai(strict=False).completions.create(
        model=MODEL, prompt="Count: one, two,", max_tokens=12, stop=["five"], stream=True
    )
    for _ in stream:
        pass
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, seed=3
    )

    async def grpc_generate():
        async with await connect(server.grpc_target, api_key=API_KEY) as grpc_client:
            return await grpc_client.generate("Once upon a time", max_tokens=4, temperature=0)

    server.grpc_reply = asyncio.run(grpc_generate())
    server.wait_idle()
    return server


def steps_of(server, **params) -> tuple[dict, list[dict]]:
    response = server.admin_client().get("/debug/steps", params=params)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines[0]["type"] == "engine" and all(line["type"] == "step" for line in lines[1:])
    return lines[0], lines[1:]


@pytest.mark.milestone("m24")
def test_debug_steps_is_a_404_without_the_flag():
    shared = shared_server()
    response = shared.client().get("/debug/steps")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.milestone("m24")
def test_debug_steps_needs_the_api_key(server):
    response = httpx.get(f"{server.url}/debug/steps", timeout=10)
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_admin_api_key"
    # The admin key (m27): the API key does not open it.
    response = httpx.get(f"{server.url}/debug/steps", headers=server.headers, timeout=10)
    assert response.status_code == 401


@pytest.mark.milestone("m24")
def test_every_frontends_requests_are_recorded_and_since_filters(served, compat):
    header, steps = steps_of(served)
    assert header["first_step"] == 0 and header["num_steps"] == len(steps)
    assert header["config"]["num_kv_blocks"] == 64
    assert [step["step"] for step in steps] == list(range(len(steps)))
    arrivals = [a for step in steps for a in step["arrivals"]]
    assert len(arrivals) == 4
    assert any(a["request_id"].startswith("grpc-") for a in arrivals)
    compat.exercised("grpc", reply=served.grpc_reply)
    compat.exercised("recorder", records=sum(a["request_id"].startswith("grpc-") for a in arrivals))
    assert any(a["sampling_params"]["seed"] == 3 for a in arrivals)
    scheduled = {entry["request_id"] for step in steps for entry in step["batch"]}
    assert scheduled == {a["request_id"] for a in arrivals}
    middle = len(steps) // 2
    _, later = steps_of(served, since=middle)
    assert later == steps[middle:]
    _, none = steps_of(served, since=10**12)
    assert none == []


@pytest.mark.milestone("m24")
@pytest.mark.parametrize(
    "since", ["-1", "abc", "1.5", "nan", "inf", "1e3", "", " 1", "9" * 40, "١٢"]
)
def test_hostile_since_is_a_400_naming_since(server, since):
    response = server.admin_client().get("/debug/steps", params={"since": since})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "since" and error["type"] == "invalid_request_error"
    assert server.client().get("/health").status_code == 200


@pytest.mark.milestone("m24")
@pytest.mark.timeout(400)
def test_the_servers_record_replays_identically(served, tmp_path):
    record = served.admin_client().get("/debug/steps").text
    path = tmp_path / "server.jsonl"
    path.write_text(record)
    command = [sys.executable, "-m", "nanollmserve.cli.main", "replay", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical" in result.stdout


@pytest.mark.milestone("m24")
def test_trace_export_reads_a_live_server(served, tmp_path):
    out = tmp_path / "trace.json"
    command = [sys.executable, "-m", "nanollmserve.cli.main", "trace", "export"]
    command += ["--url", served.url, "--api-key", ADMIN_KEY, "--output", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    events = json.loads(out.read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["name"] == "queued" for e in events)
    command[-3] = "wrong"  # the API key
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "answered 401" in result.stderr
