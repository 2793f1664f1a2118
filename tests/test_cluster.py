"""The router and the local cluster launcher (m13), end to end: one `nanollmserve cluster`
with two real `serve` workers on a tiny random-weight model, driven through the openai SDK
and httpx; a `nanollmserve router` process with the prefix policy over the same workers.

The module's tests run in file order on the one cluster: the kill test restarts a worker,
the last test stops the cluster and checks nothing is left running.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from cluster_process import (
    WORKER_ARGS,
    ClusterProcess,
    free_consecutive_ports,
    is_running,
    pid_listening_as_worker,
    tiny_model_dir,
    wait_until,
)
from live_server import busy_port, free_port

pytestmark = [pytest.mark.milestone("m13"), pytest.mark.slow]

API_KEY = "cluster-key-123"
NUM_WORKERS = 2


@pytest.fixture(scope="module")
def cluster():
    base_port = free_consecutive_ports(NUM_WORKERS)
    grpc_port = free_consecutive_ports(NUM_WORKERS)
    router_port = free_port()
    cluster = ClusterProcess.start(
        "cluster",
        router_port,
        "--workers",
        str(NUM_WORKERS),
        "--base-port",
        str(base_port),
        "--router-port",
        str(router_port),
        "--health-interval",
        "0.5",
        "--shutdown-timeout",
        "5",
        str(tiny_model_dir()),
        *WORKER_ARGS,
        "--grpc-port",
        str(grpc_port),
        api_key=API_KEY,
    )
    cluster.grpc_ports = [grpc_port + i for i in range(NUM_WORKERS)]
    cluster.worker_urls = [f"http://127.0.0.1:{base_port + i}" for i in range(NUM_WORKERS)]
    cluster.worker_ports = [base_port + i for i in range(NUM_WORKERS)]
    yield cluster
    cluster.stop()


def _worker_stats(cluster, url: str) -> dict:
    return httpx.get(f"{url}/stats", headers=cluster.headers, timeout=30).json()


def _chat(client, content: str, max_tokens: int = 8, **kwargs):
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        **kwargs,
    )


def _allowed_cpus(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {key.decode(): value.decode() for key, value in pairs}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < NUM_WORKERS, reason="fewer CPUs than workers")
def test_each_local_worker_computes_on_its_own_cpus(cluster) -> None:
    """--worker-cpus split (the default): the CPUs are cut into one share per worker, each
    worker pinned to its share and starting as many compute threads, so two workers' threads
    never wait on each other's barriers."""
    pids = [pid_listening_as_worker(port) for port in cluster.worker_ports]
    assert all(pids)
    shares = [_allowed_cpus(pid) for pid in pids]
    assert all(shares) and not shares[0] & shares[1], shares
    assert shares[0] | shares[1] == os.sched_getaffinity(0)
    for pid, share in zip(pids, shares, strict=True):
        assert _environment(pid)["OMP_NUM_THREADS"] == str(len(share))


def test_each_worker_serves_grpc_on_its_own_port(cluster) -> None:
    """`--grpc-port P` given to the cluster: worker i serves gRPC on P + i (one port cannot
    serve two workers of one host; before, the second worker could not bind it)."""
    from nanollmserve.api.grpc_client import connect

    async def health(port: int):
        async with await connect(f"127.0.0.1:{port}", api_key=None) as client:
            return await client.health()

    for port in cluster.grpc_ports:
        assert asyncio.run(health(port)).healthy, port


def test_requests_spread_over_both_workers_and_keys_are_checked(cluster) -> None:
    client = cluster.openai()
    before = {w["url"]: w["num_routed"] for w in cluster.stats()["workers"]}
    for i in range(4):
        assert _chat(client, f"hello {i}").choices[0].finish_reason in ("stop", "length")
    stats = cluster.stats()
    assert all(w["num_routed"] > before[w["url"]] for w in stats["workers"])
    assert stats["num_healthy_workers"] == NUM_WORKERS
    assert stats["num_requests_finished"] >= 4  # the workers' own /stats, added up
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    # The router's key: 401 in the OpenAI shape without it; /health and /metrics are open.
    denied = httpx.post(f"{cluster.url}/v1/completions", json={"prompt": "hi"})
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{cluster.url}/health").status_code == 200
    metrics = httpx.get(f"{cluster.url}/metrics").text
    for url in cluster.worker_urls:
        assert f'nanollmserve_router:worker_up{{worker="{url}"}} 1.0' in metrics
        assert f'nanollmserve_router:requests_total{{worker="{url}"}}' in metrics
    # The playground page comes through the router without the key, as from a worker; its
    # live panel reads the router's /stats, whose per-worker entries it lists.
    page = httpx.get(f"{cluster.url}/")
    assert page.status_code == 200 and 'id="stat-workers"' in page.text
    # A bad request is the worker's 400, passed through with its param.
    bad = httpx.post(
        f"{cluster.url}/v1/completions",
        headers=cluster.headers,
        json={"prompt": "hi", "max_tokens": 4, "temperature": -1},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"


def test_streaming_through_the_router_equals_streaming_direct(cluster) -> None:
    import openai

    def streamed(base_url: str) -> tuple[str, list[str]]:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
        chunks = []
        finish = None
        for chunk in client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me a story about a river."}],
            max_tokens=24,
            temperature=0,
            stream=True,
        ):
            if chunk.choices:
                chunks.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(chunks), finish

    direct = streamed(cluster.worker_urls[0])
    for _ in range(NUM_WORKERS):  # whichever worker the router picks
        assert streamed(cluster.url) == direct
    assert direct[0]


def test_stored_responses_are_found_on_the_worker_that_stored_them(cluster) -> None:
    client = cluster.openai()
    ids = [
        client.responses.create(model="tiny", input=f"note {i}", max_output_tokens=4).id
        for i in range(NUM_WORKERS)
    ]
    for response_id in ids * 2:  # every worker is asked in turn; only one holds each id
        assert client.responses.retrieve(response_id).id == response_id
    deleted = httpx.delete(f"{cluster.url}/v1/responses/{ids[0]}", headers=cluster.headers)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    gone = httpx.get(f"{cluster.url}/v1/responses/{ids[0]}", headers=cluster.headers)
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "invalid_request_error"


def test_disconnects_through_the_router_free_everything_on_the_workers(cluster) -> None:
    def running() -> int:
        return sum(_worker_stats(cluster, u)["num_requests_running"] for u in cluster.worker_urls)

    def aborted() -> int:
        return sum(_worker_stats(cluster, u)["num_requests_aborted"] for u in cluster.worker_urls)

    aborted_before = aborted()
    body = {"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
    # Streaming: read one chunk, then hang up.
    with (
        httpx.Client(headers=cluster.headers, timeout=60) as client,
        client.stream("POST", f"{cluster.url}/v1/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        next(r.iter_raw())

    # Non-streaming: hang up while the worker is generating.
    async def hang_up() -> None:
        async with httpx.AsyncClient(headers=cluster.headers, timeout=60) as client:
            task = asyncio.ensure_future(client.post(f"{cluster.url}/v1/completions", json=body))
            await asyncio.to_thread(wait_until, lambda: running() >= 1, 30, "a running request")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(hang_up())
    wait_until(lambda: aborted() >= aborted_before + 2, 30, "both requests aborted")
    for url in cluster.worker_urls:
        idle = wait_until(
            lambda url=url: (
                (s := _worker_stats(cluster, url))["num_requests_running"] == 0
                and s["num_free_blocks"] == s["num_total_blocks"]
                and s
            ),
            30,
            f"{url} idle",
        )
        assert idle["num_sequences_in_flight"] == 0


def test_prefix_policy_sends_a_shared_prefix_to_one_worker(cluster) -> None:
    port = free_port()
    workers = [arg for url in cluster.worker_urls for arg in ("--worker", url)]
    router = ClusterProcess.start(
        "router", port, "--port", str(port), "--policy", "prefix", *workers, api_key=API_KEY
    )
    try:
        client = router.openai()
        systems = {
            name: f"You are the {name} assistant. " + " ".join([name] * 200) for name in "AB"
        }
        placed: dict[str, set[str]] = {"A": set(), "B": set()}
        for i in range(4):
            for name, system in systems.items():
                before = {w["url"]: w["num_routed"] for w in router.stats()["workers"]}
                client.chat.completions.create(
                    model="tiny",
                    messages=[
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"question {i}"},
                    ],
                    max_tokens=2,
                )
                after = router.stats()["workers"]
                placed[name] |= {w["url"] for w in after if w["num_routed"] > before[w["url"]]}
        assert all(len(urls) == 1 for urls in placed.values()), placed
    finally:
        assert router.stop() == 0


def test_a_killed_worker_loses_no_request_and_rejoins(cluster) -> None:
    """200 requests at concurrency 16; worker 0 gets `kill -9` in the middle: every request
    succeeds (the router retries what the dead worker had not answered), the router takes it
    out, the cluster restarts it and the router sends it requests again. Of two long streams
    open meanwhile (one per worker), the dead worker's ends with an error event, the other
    one completes."""
    import openai

    victim_url, victim_port = cluster.worker_urls[0], cluster.worker_ports[0]
    victim_pid = pid_listening_as_worker(victim_port)
    assert victim_pid is not None
    done = []
    failures = []
    killed = threading.Event()

    streams = []

    async def load() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{cluster.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
        )
        raw = httpx.AsyncClient(headers=cluster.headers, timeout=120)
        for _ in range(NUM_WORKERS):  # least_load: one per worker
            body = {"prompt": "A long story", "max_tokens": 400, "ignore_eos": True}
            request = raw.build_request(
                "POST", f"{cluster.url}/v1/completions", json={**body, "stream": True}
            )
            response = await raw.send(request, stream=True)
            chunks = response.aiter_text()
            streams.append([await anext(chunks), chunks])
        in_flight = [w["num_in_flight"] for w in cluster.stats()["workers"]]
        assert in_flight == [1] * NUM_WORKERS
        queue = list(range(200))

        async def user() -> None:
            while queue:
                i = queue.pop()
                try:
                    await client.completions.create(
                        model="tiny", prompt=f"request {i}", max_tokens=8, temperature=0
                    )
                    done.append(i)
                except Exception as exc:
                    failures.append(repr(exc))
                if len(done) == 60 and not killed.is_set():
                    killed.set()
                    os.kill(victim_pid, signal.SIGKILL)

        await asyncio.gather(*(user() for _ in range(16)))
        for stream in streams:
            stream[0] += "".join([chunk async for chunk in stream[1]])
        await client.close()
        await raw.aclose()

    marked_down = []

    def watch() -> None:
        killed.wait(120)
        marked_down.append(
            wait_until(lambda: not cluster.worker(victim_url)["is_healthy"], 60, "marked down")
        )

    watcher = threading.Thread(target=watch)
    watcher.start()
    asyncio.run(load())
    watcher.join()
    assert killed.is_set() and marked_down
    assert failures == [] and len(done) == 200
    assert sorted(_stream_outcome(text) for text, _ in streams) == ["error", "length"]
    # The cluster restarts it; the router takes it back and routes to it again.
    wait_until(lambda: cluster.worker(victim_url)["is_healthy"], 180, "the restarted worker")
    new_pid = pid_listening_as_worker(victim_port)
    assert new_pid is not None and new_pid != victim_pid
    routed_before = cluster.worker(victim_url)["num_routed"]
    client = cluster.openai()
    for i in range(4):
        assert _chat(client, f"after {i}").choices
    assert cluster.worker(victim_url)["num_routed"] > routed_before


def _stream_outcome(text: str) -> str:
    """How an SSE completion stream ended: its finish reason, or "error" for an error event.
    Every event is whole JSON and the stream ends with [DONE]."""
    events = [event.removeprefix("data: ") for event in text.split("\n\n") if event.strip()]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    for event in events[:-2]:
        json.loads(event)
    if "error" in last:
        assert last["error"]["code"] == "worker_failed"
        return "error"
    return last["choices"][0]["finish_reason"]


def test_router_without_a_healthy_worker_answers_503() -> None:
    port = free_port()
    with busy_port() as dead:  # listening, never answering: health checks time out
        router = ClusterProcess.start(
            "router", port, "--port", str(port), "--worker", f"http://127.0.0.1:{dead}",
            "--health-interval", "0.5", num_workers=0,
        )  # fmt: skip
        try:
            health = httpx.get(f"{router.url}/health", timeout=10)
            assert health.status_code == 503
            assert health.json()["error"]["code"] == "no_healthy_worker"
            answer = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi"})
            assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        finally:
            assert router.stop() == 0


def test_cli_errors_are_one_line() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "nanollmserve.cli.main", *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )

    with busy_port() as port:
        taken = cli("router", "--worker", "http://127.0.0.1:1", "--port", str(port))
        assert taken.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port}" in taken.stderr
        worker_taken = cli("cluster", "--base-port", str(port), "--router-port", "0")
        assert worker_taken.returncode == 2
        assert f"cannot listen on 127.0.0.1:{port} (worker 0)" in worker_taken.stderr
    managed = cli("cluster", "--router-port", "0", "--port", "9000")
    assert managed.returncode == 2 and "--port is set by the cluster" in managed.stderr
    unknown = cli("cluster", "--router-port", "0", "--no-such-flag")
    assert unknown.returncode == 2 and "--no-such-flag" in unknown.stderr
    assert cli("serve", "--no-such-flag").returncode == 2  # other commands stay strict


def test_sigterm_stops_the_router_and_every_worker(cluster) -> None:
    pids = [pid_listening_as_worker(port) for port in cluster.worker_ports]
    assert all(pids)
    assert cluster.stop(signal.SIGTERM) == 0
    wait_until(lambda: not any(is_running(pid) for pid in pids), 30, "workers gone")
    assert "nanollmserve cluster stopped" in cluster.log()
