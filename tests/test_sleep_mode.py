"""Sleep mode (m25), end to end on a live `nanollmserve serve --enable-sleep-mode`: vLLM's
routes (`POST /sleep?level=1|2`, `POST /wake_up`, `GET /is_sleeping`) behind the admin key
(`--admin-api-key`, m27), the process's RSS falling by the KV pool it had committed, greedy
output after a wake equal to before, requests while asleep refused with a 503 and
`Retry-After` (gRPC: UNAVAILABLE; through the router: its own 503, the sleeping worker being
out of its rotation), a sleep that waits for the running request, hostile
query values, and `--sleep-idle-seconds` sleeping by itself and waking on the next request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from cluster_process import ClusterProcess
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect

pytestmark = pytest.mark.milestone("m25")

API_KEY = "sleep-test-key"
ADMIN_KEY = "sleep-test-admin-key"
MODEL = "SmolLM2-135M-Instruct"
KV_POOL_BYTES = 256 << 20
PROMPT = "The capital of France is"
LONG_TOKENS = 300


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def poll(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            assert value, f"timed out after {timeout} s waiting for {what}"
            return value
        time.sleep(interval)


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    live = LiveServer.start(
        "--dtype", "auto", "--enable-sleep-mode", "--kv-cache-memory", str(KV_POOL_BYTES),
        "--grpc-port", str(grpc_port), api_key=API_KEY, admin_api_key=ADMIN_KEY,
    )  # fmt: skip
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


def greedy(server, prompt: str = PROMPT, max_tokens: int = 16, ignore_eos: bool = False) -> str:
    reply = server.openai().completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True} if ignore_eos else None,
    )
    return reply.choices[0].text


def post(server, path: str, **params) -> httpx.Response:
    with server.admin_client() as client:  # the sleep routes are admin routes
        return client.post(path, params=params)


def is_sleeping(server) -> bool:
    with server.admin_client() as client:
        answer = client.get("/is_sleeping")
    assert answer.status_code == 200, answer.text
    return answer.json()["is_sleeping"]


def assert_sleeping_503(answer: httpx.Response) -> None:
    assert answer.status_code == 503, answer.text
    assert int(answer.headers["retry-after"]) >= 1
    error = answer.json()["error"]
    assert error["code"] == "engine_sleeping" and error["type"] == "server_error"
    assert "sleeping" in error["message"]


def completion(url: str, headers: dict) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def touch_kv_pool(server) -> int:
    """Run one long prompt (so its KV blocks are written: the pool's pages are committed as
    they are written) and return the bytes of KV cache that prompt covers."""
    with server.client() as client:
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
    prompt = [100 + (i * 7919) % 40000 for i in range(int(max_model_len * 0.7))]  # token ids
    with server.client(timeout=300) as client:
        answer = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        )
    assert answer.status_code == 200, answer.text
    stats = server.stats()
    bytes_per_token = KV_POOL_BYTES // (stats["num_total_blocks"] * stats["block_size"])
    return answer.json()["usage"]["prompt_tokens"] * bytes_per_token


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sleep_level_1_frees_the_kv_pool_and_wake_up_serves_the_same_greedy_output(server):
    before = greedy(server)
    assert not is_sleeping(server)
    touched = touch_kv_pool(server)
    assert touched > KV_POOL_BYTES // 3
    awake_rss = rss_bytes(server.process.pid)

    answer = post(server, "/sleep", level="1")
    assert answer.status_code == 200, answer.text
    assert is_sleeping(server)
    # The committed part of the pool leaves the process (the mmap is unmapped).
    poll(
        lambda: awake_rss - rss_bytes(server.process.pid) > touched * 0.6,
        30,
        f"RSS to fall by 60% of {touched} bytes from {awake_rss}",
    )
    assert_sleeping_503(completion(server.url, server.headers))
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # alive, asleep

    assert post(server, "/wake_up").status_code == 200
    assert not is_sleeping(server)
    assert greedy(server) == before
    # Sleeping twice and waking twice are harmless.
    assert post(server, "/wake_up").status_code == 200
    assert greedy(server) == before


@pytest.mark.timeout(300)
def test_sleep_level_2_drops_the_weights_and_wake_up_reloads_them(server):
    before = greedy(server)
    awake_rss = rss_bytes(server.process.pid)
    assert post(server, "/sleep", level="1").status_code == 200
    level_1_rss = rss_bytes(server.process.pid)
    assert post(server, "/sleep", level="2").status_code == 200  # deeper: the weights too
    assert is_sleeping(server)
    poll(
        lambda: rss_bytes(server.process.pid) < min(level_1_rss, awake_rss) - (20 << 20),
        30,
        f"RSS to fall below {level_1_rss} bytes by 20 MiB",
    )
    assert_sleeping_503(completion(server.url, server.headers))
    assert post(server, "/wake_up").status_code == 200
    assert greedy(server) == before


@pytest.mark.timeout(300)
def test_sleep_waits_for_the_running_request_then_refuses_new_ones(server):
    # Long enough to be seen running by a 20 ms stats poll however fast the machine: 300
    # engine steps take a second or more even where a step is only its Python overhead.
    before = greedy(server, max_tokens=LONG_TOKENS, ignore_eos=True)
    results: dict = {}

    def run_long():
        results["text"] = greedy(server, max_tokens=LONG_TOKENS, ignore_eos=True)

    runner = threading.Thread(target=run_long)
    runner.start()
    poll(lambda: server.stats()["num_requests_running"] == 1, 30, "the request to run", 0.02)
    answer = post(server, "/sleep", level="1")  # returns once the request has finished
    runner.join(120)
    assert answer.status_code == 200, answer.text
    assert results["text"] == before  # it ran to its end, untouched
    assert is_sleeping(server)
    assert_sleeping_503(completion(server.url, server.headers))
    assert post(server, "/wake_up").status_code == 200


@pytest.mark.timeout(300)
def test_sleep_abort_mode_ends_the_running_request(server):
    statuses: list = []

    def run_long():
        statuses.append(
            httpx.post(
                f"{server.url}/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2000,
                      "ignore_eos": True},
                headers=server.headers,
                timeout=120,
            )
        )  # fmt: skip

    runner = threading.Thread(target=run_long)
    runner.start()
    poll(lambda: server.stats()["num_requests_running"] == 1, 30, "the request to run")
    assert post(server, "/sleep", level="1", mode="abort").status_code == 200
    runner.join(60)
    assert_sleeping_503(statuses[0])
    assert "aborted" in statuses[0].json()["error"]["message"]
    assert post(server, "/wake_up").status_code == 200
    assert greedy(server)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"level": "3"}, "level"),
        ({"level": "0"}, "level"),
        ({"level": "-1"}, "level"),
        ({"level": "1.5"}, "level"),
        ({"level": "nan"}, "level"),
        ({"level": "inf"}, "level"),
        ({"level": ""}, "level"),
        ({"level": "9" * 5000}, "level"),
        ({"level": ["1", "2"]}, "level"),
        ({"level": "1", "mode": "later"}, "mode"),
        ({"level": "1", "mode": ""}, "mode"),
    ],
)
def test_hostile_sleep_parameters_are_400s_naming_them(server, params, param):
    answer = post(server, "/sleep", **params)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert len(error["message"]) < 200
    assert not is_sleeping(server)


def test_sleep_routes_need_the_api_key(server):
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]:
        answer = httpx.request(method, f"{server.url}{path}", timeout=10)
        assert answer.status_code == 401, (path, answer.text)
        # The admin key, not the API key (m27).
        answer = httpx.request(method, f"{server.url}{path}", headers=server.headers)
        assert answer.status_code == 401, (path, answer.text)
    assert not is_sleeping(server)


def test_wake_up_tags_are_refused(server):
    answer = post(server, "/wake_up", tags="weights")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tags"


def test_grpc_requests_while_asleep_are_unavailable(server, compat):
    async def generate():
        async with await connect(server.grpc_target, api_key=API_KEY) as client:
            return await client.generate(PROMPT, max_tokens=4, temperature=0)

    assert post(server, "/sleep", level="1").status_code == 200
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(generate())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "sleeping" in info.value.details()
        compat.exercised("grpc", reply=info.value)
        compat.exercised("sleep", asleep="sleeping" in info.value.details())
    finally:
        assert post(server, "/wake_up").status_code == 200
    assert asyncio.run(generate()).text


@pytest.mark.timeout(300)
def test_the_router_passes_a_sleeping_workers_503_on(server, compat):
    port = free_port()
    router = ClusterProcess.start(
        "router", port, "--port", str(port), "--worker", server.url, "--health-interval", "0.5",
        "--worker-api-key", API_KEY, api_key=API_KEY, num_workers=1,
    )  # fmt: skip
    try:
        assert completion(router.url, router.headers).status_code == 200
        assert post(server, "/sleep", level="1").status_code == 200
        # /health stays 200 (the worker is alive) but says "sleeping": the router sends it
        # nothing (m27) and, with no other worker, answers 503 and Retry-After itself.
        health = poll(
            lambda: httpx.get(f"{router.url}/health", timeout=10).status_code == 503, 30, "503"
        )
        assert health
        asleep = completion(router.url, router.headers)
        assert asleep.status_code == 503 and int(asleep.headers["retry-after"]) >= 1
        assert "asleep" in asleep.json()["error"]["message"]
        compat.exercised("sleep", asleep="asleep" in asleep.json()["error"]["message"])
        assert post(server, "/wake_up").status_code == 200
        poll(lambda: httpx.get(f"{router.url}/health").status_code == 200, 30, "awake")
        assert completion(router.url, router.headers).status_code == 200
        compat.exercised("router", routed=router.stats()["workers"][0]["num_routed"])
    finally:
        assert router.stop() == 0


def test_sleep_routes_are_404_without_enable_sleep_mode():
    live = LiveServer.start("--num-kv-blocks", "64")
    try:
        for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")]:
            answer = httpx.request(method, f"{live.url}{path}", timeout=10)
            assert answer.status_code == 404, (path, answer.text)
            assert "--enable-sleep-mode" in answer.json()["error"]["message"]
    finally:
        live.stop()
