"""Two router replicas (m32): two real `nanollmserve router --policy prefix` processes over
the same four stand-in workers (small HTTP servers in this process that answer with their
own URL) agree on the worker of every prefix, agree again after a worker leaves (only its
prefixes move), and when one router is killed the other keeps serving every request, each
still on the worker both had chosen.

Requests go one at a time, so every router sees its workers idle when it places one: the
load bound (which reads each router's own requests in flight) leaves the hash order alone.
"""

from __future__ import annotations

import signal
import threading

import httpx
import pytest
from cluster_process import ClusterProcess, wait_until
from live_server import free_port
from stand_in_http import JsonHandler, StandInServer

from nanollmserve.router import Worker
from nanollmserve.router.policies import preference
from nanollmserve.router.routing_key import routing_key

pytestmark = [pytest.mark.milestone("m32"), pytest.mark.timeout(240), pytest.mark.slow]

SYSTEMS = [f"You are assistant number {i} of the support desk. " * 6 for i in range(48)]


class StandInWorker:
    """/health answers 200 while `healthy` (else 503), /stats `{}`, anything else
    `{"worker": its URL}`; it counts the requests it answered."""

    def __init__(self) -> None:
        self.healthy = True
        self.answered = 0
        worker = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    self._json(200 if worker.healthy else 503, {"status": "ok"})
                elif self.path == "/stats":
                    self._json(200, {})
                else:
                    self._answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self._answer()

            def _answer(self) -> None:
                worker.answered += 1
                self._json(200, {"worker": worker.url})

        self.http = StandInServer(Handler)
        self.url = self.http.url

    def stop(self) -> None:
        self.http.stop()


@pytest.fixture(scope="module")
def workers():
    workers = [StandInWorker() for _ in range(4)]
    yield workers
    for worker in workers:
        worker.stop()


def _router(workers: list[StandInWorker]) -> ClusterProcess:
    port = free_port()
    urls = [arg for worker in workers for arg in ("--worker", worker.url)]
    return ClusterProcess.start(
        "router", port, "--port", str(port), "--policy", "prefix", *urls,
        "--health-interval", "0.3", "--health-failures", "1", num_workers=len(workers),
    )  # fmt: skip


@pytest.fixture(scope="module")
def routers(workers):
    # One router lists the workers in reverse: the order of --worker flags must not matter.
    first, second = _router(workers), _router(workers[::-1])
    yield first, second
    first.stop(signal.SIGKILL)
    second.stop(signal.SIGKILL)


def _chat(system: str, question: str = "what now?") -> dict:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
    }


def _worker_of(router: ClusterProcess, system: str, question: str = "what now?") -> str:
    answer = httpx.post(
        f"{router.url}/v1/chat/completions", json=_chat(system, question), timeout=30
    )
    assert answer.status_code == 200, answer.text
    return answer.json()["worker"]


def _expected(system: str, urls: list[str]) -> str:
    """The placement the policy's hash order gives an idle pool of `urls`."""
    key = routing_key(_chat(system))
    return preference(key, [Worker(url) for url in urls])[0].url


def _num_healthy(router: ClusterProcess) -> int:
    health = httpx.get(f"{router.url}/health", timeout=10)
    return health.json()["num_healthy_workers"] if health.status_code == 200 else 0


def test_two_routers_agree_on_every_prefix_and_after_a_worker_leaves(routers, workers) -> None:
    first, second = routers
    urls = [worker.url for worker in workers]
    placed = {system: _worker_of(first, system) for system in SYSTEMS}
    assert {system: _worker_of(second, system) for system in SYSTEMS} == placed
    assert placed == {system: _expected(system, urls) for system in SYSTEMS}
    assert len(set(placed.values())) >= 3  # 48 prefixes spread (the URLs' ports vary)
    # Another question after the same system prompt (past the 256-char key): same worker.
    assert all(_worker_of(second, s, "and then?") == placed[s] for s in SYSTEMS[:8])

    gone = max(workers, key=lambda w: list(placed.values()).count(w.url))  # moves the most
    gone.healthy = False  # its /health answers 503: each router takes it out on its own
    try:
        for router in routers:
            wait_until(lambda r=router: _num_healthy(r) == 3, 30, "the worker out")
        rest = [url for url in urls if url != gone.url]
        after = {system: _worker_of(first, system) for system in SYSTEMS}
        assert {system: _worker_of(second, system) for system in SYSTEMS} == after
        assert after == {system: _expected(system, rest) for system in SYSTEMS}
        moved = {system for system in SYSTEMS if after[system] != placed[system]}
        assert moved == {system for system in SYSTEMS if placed[system] == gone.url}
    finally:
        gone.healthy = True
    for router in routers:
        wait_until(lambda r=router: _num_healthy(r) == 4, 30, "the worker back")
    assert {system: _worker_of(first, system) for system in SYSTEMS} == placed


def test_when_one_router_dies_the_other_serves_every_request(routers, workers) -> None:
    first, second = routers
    placed = {system: _worker_of(first, system) for system in SYSTEMS}
    # A client keeps sending through the second router while the first is killed.
    results: list[tuple[str, str | None]] = []
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                for system in SYSTEMS:
                    try:
                        answer = http.post(f"{second.url}/v1/chat/completions", json=_chat(system))
                        worker = answer.json()["worker"] if answer.status_code == 200 else None
                    except (httpx.HTTPError, ValueError):
                        worker = None
                    results.append((system, worker))

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(results) >= len(SYSTEMS), 60, "requests before the kill")
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
        served = len(results)
        wait_until(lambda: len(results) >= served + len(SYSTEMS), 60, "requests after the kill")
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    failed = [system for system, worker in results if worker is None]
    assert not failed, f"{len(failed)} of {len(results)} requests failed"
    assert all(worker == placed[system] for system, worker in results)
    with pytest.raises(httpx.ConnectError):  # the first router is gone for good
        httpx.get(f"{first.url}/health", timeout=5)
    assert _num_healthy(second) == len(workers)
