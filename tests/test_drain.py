"""Issue 43, Kubernetes (m32): `/ready`, `/live` and the SIGTERM drain, on real processes.

- A server sent SIGTERM during 16 streams finishes all of them, answers new requests 503
  `draining`, and its `/ready` turns 503 while streams still run (`/live` stays 200).
- A router over two workers takes a worker sent SIGTERM during 16 streams out of its
  rotation at once (its 503 `draining` /health, or a request it refuses; not after failed
  checks), new requests still succeed and no stream fails; the router sent SIGTERM during 16
  more streams finishes them all, answers new requests and `/ready` 503 `draining` while they
  run (`/live` 200), and exits 0.

The workers serve the bundled model (tests/live_server.py) with small max_tokens and
ignore_eos. Nothing is timed: each wait polls with a deadline, and "before the last stream
ends" is read from the streams' own state at the moment /ready answered 503.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from cluster_process import ClusterProcess, wait_until
from live_server import LiveServer, free_port

pytestmark = [pytest.mark.milestone("m32"), pytest.mark.slow]

NUM_STREAMS = 16
MAX_TOKENS = 48
WORKER_ARGS = ["--num-kv-blocks", "512", "--max-num-seqs", "32", "--shutdown-timeout", "240"]


class Streams:
    """NUM_STREAMS completion streams in threads; each records its lines and its error."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url = url
        self.headers = headers
        self.lines: list[list[str]] = [[] for _ in range(NUM_STREAMS)]
        self.errors: list[BaseException | None] = [None] * NUM_STREAMS
        self.done = [threading.Event() for _ in range(NUM_STREAMS)]
        self.started = [threading.Event() for _ in range(NUM_STREAMS)]
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(NUM_STREAMS)]

    def _run(self, i: int) -> None:
        body = {
            "model": "tiny",
            "prompt": f"Story {i}: once upon a time",
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with (
                httpx.Client(base_url=self.url, headers=self.headers, timeout=240) as client,
                client.stream("POST", "/v1/completions", json=body) as response,
            ):
                response.raise_for_status()
                for line in response.iter_lines():
                    if line:
                        self.lines[i].append(line)
                        self.started[i].set()
        except BaseException as exc:  # noqa: BLE001 - recorded, asserted on below
            self.errors[i] = exc
        finally:
            self.started[i].set()
            self.done[i].set()

    def start(self) -> None:
        for thread in self.threads:
            thread.start()
        for started in self.started:
            assert started.wait(180), "a stream sent nothing"

    def num_running(self) -> int:
        return sum(not done.is_set() for done in self.done)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(240)

    def assert_all_finished(self) -> None:
        for i in range(NUM_STREAMS):
            assert self.errors[i] is None, f"stream {i}: {self.errors[i]!r}"
            lines = self.lines[i]
            assert lines[-1] == "data: [DONE]", f"stream {i}: {lines[-3:]}"
            assert '"finish_reason":"length"' in lines[-2], f"stream {i}: {lines[-3:]}"
            assert not any('"error"' in line for line in lines), f"stream {i}: {lines[-3:]}"


def poll_until_503(url: str, timeout: float = 60.0) -> httpx.Response:
    """The first 503 of `url`, polled with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        answer = httpx.get(url, timeout=10)
        if answer.status_code == 503:
            return answer
        assert time.monotonic() < deadline, f"{url} still answers {answer.status_code}"
        time.sleep(0.02)


def completion(url: str, headers: dict[str, str], max_tokens: int = 4) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def start_worker() -> LiveServer:
    return LiveServer.start(*WORKER_ARGS, "--served-model-name", "tiny", api_key="k")


def sigterm_during_streams(process, url: str, headers: dict[str, str]) -> None:
    """SIGTERM to `process` (serving `url`) while 16 streams run: /ready turns 503 `draining`
    while streams still run, a new request gets 503 `draining`, /live stays 200, every stream
    ends intact and the process exits 0."""
    streams = Streams(url, headers)
    streams.start()
    process.send_signal(signal.SIGTERM)
    ready = poll_until_503(f"{url}/ready")
    running_when_unready = streams.num_running()
    refused = completion(url, headers)
    running_when_refused = streams.num_running()
    live = httpx.get(f"{url}/live", timeout=10)
    streams.join()
    assert process.wait(120) == 0

    assert ready.json()["error"]["code"] == "draining"
    assert running_when_unready > 0, "/ready turned 503 only after every stream ended"
    assert refused.status_code == 503 and running_when_refused > 0
    assert refused.json()["error"]["code"] == "draining"
    assert live.status_code == 200
    streams.assert_all_finished()


@pytest.mark.timeout(600)  # a model server and 16 streams on a busy CPU
def test_a_server_sent_sigterm_drains_its_streams():
    server = start_worker()
    try:
        assert httpx.get(f"{server.url}/ready").json()["status"] == "ok"
        assert httpx.get(f"{server.url}/live").json() == {"status": "ok"}
        sigterm_during_streams(server.process, server.url, server.headers)
        assert "Traceback" not in server.log()
    finally:
        server.stop()


@pytest.mark.timeout(900)  # three model servers and two rounds of streams on a busy CPU
def test_a_router_drops_a_draining_worker_at_once_and_drains_itself():
    workers = [start_worker(), start_worker()]
    port = free_port()
    router = None
    try:
        router = ClusterProcess.start(
            "router", port, "--port", str(port), "--worker", workers[0].url,
            "--worker", workers[1].url, "--health-interval", "0.2", "--health-failures", "1000",
            "--shutdown-timeout", "240", api_key="k",
        )  # fmt: skip
        assert httpx.get(f"{router.url}/ready").json()["status"] == "ok"
        assert httpx.get(f"{router.url}/live").json() == {"status": "ok"}

        # A worker sent SIGTERM leaves the rotation at once: with 1000 failed checks needed
        # for an ordinary failure, only its `draining` answer can take it out while it runs.
        streams = Streams(router.url, router.headers)
        streams.start()
        counts = [router.worker(w.url)["num_routed"] for w in workers]
        assert all(counts), f"the streams did not reach both workers: {counts}"
        workers[0].process.send_signal(signal.SIGTERM)
        assert poll_until_503(f"{workers[0].url}/health").json()["error"]["code"] == "draining"
        wait_until(lambda: not router.worker(workers[0].url)["is_healthy"], 60, "worker 0 out")
        answers = [completion(router.url, router.headers) for _ in range(2)]
        assert [a.status_code for a in answers] == [200] * 2, [a.text for a in answers]
        streams.join()
        streams.assert_all_finished()
        assert workers[0].process.wait(120) == 0
        assert f"worker {workers[0].url} is down: it is draining" in router.log()

        # The router itself: SIGTERM during 16 streams (all on worker 1 now).
        sigterm_during_streams(router.process, router.url, router.headers)
    finally:
        if router is not None:
            router.stop()
        for worker in workers:
            worker.stop()
