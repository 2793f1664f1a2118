"""The router's `--policy pd` (m26) against stand-in workers: a real `nanollmserve router`
process in front of two prefill-role and two decode-role workers that are small HTTP servers
in this process, recording what reaches them and answering as each test sets them to (a
good answer, a 5xx, a 4xx, no answer in time, a cut connection).

What the router sends in each phase, prefix affinity among the prefill workers, the retry
on another prefill worker, the fallback when none is left (counted in the router's
metrics), the 4xx passthrough, streaming of phase 2, and the requests that have no phase 1.
"""

from __future__ import annotations

import itertools
import json
import socket
import time

import httpx
import pytest
from cluster_process import ClusterProcess, wait_until
from live_server import free_port
from prometheus_client.parser import text_string_to_metric_families
from stand_in_http import JsonHandler, StandInServer

pytestmark = [pytest.mark.milestone("m26"), pytest.mark.timeout(180)]

PREFILL_TIMEOUT_S = 2.0
HANG_S = 30.0
REMOTE = {"remote_tokens": 32, "remote_blocks": 2, "first_token_id": 7}
SSE_CHUNKS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n']
SSE_CHUNKS.append(b"data: [DONE]\n\n")
BAD_REQUEST = {"error": {"message": "bad temperature", "type": "invalid_request_error"}}
BAD_REQUEST["error"].update(param="temperature", code=None)


ARRIVALS = itertools.count()  # thread-safe: the stand-ins' handler threads share it


class StandInWorker:
    """Serves /health (with its `kv_role`, or 503 while `healthy` is False) and /stats, and
    answers everything else as `mode` says, recording (path, parsed body) of each such request.

    Modes: ok (a prefill worker answers with kv_transfer_params; a decode worker echoes the
    body it got, or streams SSE_CHUNKS when asked to stream), 500, 400, hang (no answer for
    HANG_S seconds, far past the router's prefill timeout), cut (closes the connection),
    no_params (a prefill worker's answer without kv_transfer_params)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.mode = "ok"
        self.healthy = True
        self.requests: list[tuple[int, str, object]] = []
        """(arrival number across all stand-ins, path, body)"""
        worker = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:
                if self.path == "/health":
                    status = 200 if worker.healthy else 503
                    self._json(status, {"status": "ok", "kv_role": worker.role})
                elif self.path == "/stats":  # the router's /stats asks each worker
                    self._json(200, {})
                else:
                    self._answer(b"")

            def do_POST(self) -> None:
                self._answer(self.rfile.read(int(self.headers.get("content-length") or 0)))

            def _answer(self, raw: bytes) -> None:
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                worker.requests.append((next(ARRIVALS), self.path, body))
                mode = worker.mode
                if mode == "cut":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if mode == "hang":  # the router has given up long before
                    time.sleep(HANG_S)
                    return
                if mode == "500":
                    return self._json(500, {"error": {"message": "boom", "type": "server_error"}})
                if mode == "400":
                    return self._json(400, BAD_REQUEST)
                if worker.role == "prefill":
                    answer = {"choices": [{"text": "x"}]}
                    if mode != "no_params":
                        answer["kv_transfer_params"] = REMOTE
                    return self._json(200, answer)
                if isinstance(body, dict) and body.get("stream"):
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    for chunk in SSE_CHUNKS:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    return
                self._json(200, {"echo": body, "worker": worker.role})

        self.http = StandInServer(Handler)
        self.url = self.http.url

    def stop(self) -> None:
        self.http.stop()


class Workers:
    def __init__(self) -> None:
        self.prefill = [StandInWorker("prefill") for _ in range(2)]
        self.decode = [StandInWorker("decode") for _ in range(2)]
        self.all = self.prefill + self.decode

    def reset(self) -> None:
        for worker in self.all:
            worker.mode, worker.healthy = "ok", True
            worker.requests.clear()

    def received(self, workers: list[StandInWorker]) -> list[tuple[str, object]]:
        """(path, body) of what `workers` received, in arrival order across them."""
        arrived = sorted(request for worker in workers for request in worker.requests)
        return [(path, body) for _, path, body in arrived]


@pytest.fixture(scope="module")
def workers():
    workers = Workers()
    yield workers
    for worker in workers.all:
        worker.stop()


@pytest.fixture(scope="module")
def router(workers):
    port = free_port()
    args = ["--port", str(port), "--policy", "pd", "--health-interval", "0.3"]
    args += ["--health-failures", "1", "--prefill-timeout", str(PREFILL_TIMEOUT_S)]
    for worker in workers.all:
        args += ["--worker", worker.url]
    router = ClusterProcess.start("router", port, *args, num_workers=4)
    yield router
    assert router.stop() == 0


@pytest.fixture(autouse=True)
def fresh(workers, router):
    workers.reset()
    router.wait_healthy(4, 30)
    yield


def _metric(router, name: str, **labels: str) -> float:
    text = httpx.get(f"{router.url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _fallbacks(router, reason: str) -> float:
    return _metric(router, "nanollmserve_router:pd_prefill_fallbacks_total", reason=reason)


def _post(router, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{router.url}{path}", json=body, timeout=60)


def test_phase_one_on_a_prefill_worker_then_phase_two_on_a_decode_worker(router, workers) -> None:
    roles = {w["url"]: w["kv_role"] for w in router.stats()["workers"]}
    assert roles == {w.url: w.role for w in workers.all}  # read from their /health
    body = {"model": "m", "prompt": "Hello there", "max_tokens": 16, "min_tokens": 4}
    body.update(temperature=0, best_of=1, stream_options={"include_usage": True})
    answer = _post(router, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    [(path, phase_one)] = workers.received(workers.prefill)
    assert path == "/v1/completions"
    assert phase_one == {
        "model": "m", "prompt": "Hello there", "max_tokens": 1, "temperature": 0,
        "stream": False, "n": 1, "kv_transfer_params": {"do_remote_decode": True},
    }  # fmt: skip
    [(path, phase_two)] = workers.received(workers.decode)
    assert phase_two == {**body, "kv_transfer_params": {"do_remote_prefill": True, **REMOTE}}
    assert answer.json() == {"echo": phase_two, "worker": "decode"}
    # Chat: max_completion_tokens too when the client used it; the answer streams through.
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}
    chat.update(max_completion_tokens=20, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=chat) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert b"".join(stream.iter_bytes()) == b"".join(SSE_CHUNKS)
    path, phase_one = workers.received(workers.prefill)[-1]
    phase_two = workers.received(workers.decode)[-1][1]
    assert path == "/v1/chat/completions"
    assert phase_one["max_tokens"] == phase_one["max_completion_tokens"] == 1
    assert (phase_one["stream"], phase_one["n"], "stream_options" in phase_one) == (
        False, 1, False,
    )  # fmt: skip
    assert phase_two == {**chat, "kv_transfer_params": {"do_remote_prefill": True, **REMOTE}}


def test_a_shared_prefix_keeps_its_prefill_worker_and_decodes_spread_by_load(
    router, workers
) -> None:
    system = "You are the support desk of a large company. " * 8  # past the 256-char key
    for i in range(6):
        assert _post(router, "/v1/completions", {"prompt": f"{system} q{i}"}).status_code == 200
    used = [w for w in workers.prefill if w.requests]
    assert len(used) == 1 and len(used[0].requests) == 6
    assert all(w.requests for w in workers.decode)  # least load: both took some
    for i in range(16):  # other prefixes spread over both prefill workers
        assert _post(router, "/v1/completions", {"prompt": f"{i} other"}).status_code == 200
    assert all(w.requests for w in workers.prefill)


def test_failed_prefills_are_retried_then_the_decode_worker_prefills_itself(
    router, workers
) -> None:
    before_failed = _fallbacks(router, "prefill_failed")
    workers.prefill[0].mode, workers.prefill[1].mode = "500", "cut"
    body = {"prompt": "a prompt", "max_tokens": 4}
    answer = _post(router, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert len(workers.received(workers.prefill)) == 2  # one try on each
    [(_, phase_two)] = workers.received(workers.decode)
    assert phase_two == body  # no kv_transfer_params: the decode worker prefills
    assert _fallbacks(router, "prefill_failed") == before_failed + 1
    # One prefill worker answers: every request gets its parameters (after a retry or not).
    wait_until(lambda: router.worker(workers.prefill[1].url)["is_healthy"], 30, "cut worker up")
    workers.prefill[1].mode = "ok"
    for i in range(4):
        assert _post(router, "/v1/completions", {"prompt": f"p{i}"}).status_code == 200
    assert all("kv_transfer_params" in b for _, b in workers.received(workers.decode)[1:])
    assert _fallbacks(router, "prefill_failed") == before_failed + 1


def test_a_prefill_worker_that_does_not_answer_in_time_is_given_up(router, workers) -> None:
    for worker in workers.prefill:
        worker.mode = "hang"
    start = time.monotonic()
    answer = _post(router, "/v1/completions", {"prompt": "slow", "max_tokens": 2})
    elapsed = time.monotonic() - start
    assert answer.status_code == 200 and "kv_transfer_params" not in answer.json()["echo"]
    assert elapsed < HANG_S  # two timeouts of 2 s, not the hang's end
    # A timeout is not a dead worker: both stay in the rotation.
    assert all(router.worker(w.url)["is_healthy"] for w in workers.prefill)


def test_a_4xx_from_phase_one_is_the_clients_answer(router, workers) -> None:
    workers.prefill[0].mode = workers.prefill[1].mode = "400"
    answer = _post(router, "/v1/completions", {"prompt": "x", "temperature": -3})
    assert answer.status_code == 400 and answer.json() == BAD_REQUEST
    assert len(workers.received(workers.prefill)) == 1  # not retried
    assert workers.received(workers.decode) == []


def test_without_prefill_workers_or_parameters_the_decode_worker_prefills(router, workers) -> None:
    workers.prefill[0].mode = workers.prefill[1].mode = "no_params"
    before = _fallbacks(router, "no_transfer_params")
    assert _post(router, "/v1/completions", {"prompt": "x"}).status_code == 200
    assert _fallbacks(router, "no_transfer_params") == before + 1
    for worker in workers.prefill:
        worker.healthy = False
    wait_until(lambda: not any(w["is_healthy"] for w in router.stats()["workers"][:2]), 30, "down")
    before = _fallbacks(router, "no_prefill_worker")
    answer = _post(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert answer.status_code == 200 and "kv_transfer_params" not in answer.json()["echo"]
    assert _fallbacks(router, "no_prefill_worker") == before + 1
    # No decode worker: a 503, and no prefill worker is asked for a phase 1 nobody follows.
    for worker in workers.all:
        worker.healthy = worker.role == "prefill"
    wait_until(lambda: [w["is_healthy"] for w in router.stats()["workers"]] == [1, 1, 0, 0], 30,
               "only the prefill workers up")  # fmt: skip
    for worker in workers.all:
        worker.requests.clear()
    answer = _post(router, "/v1/completions", {"prompt": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_healthy_worker"
    assert workers.received(workers.all) == []
    # ... and the router's /health says so: prefill-only workers cannot serve a request.
    health = httpx.get(f"{router.url}/health", timeout=10)
    assert health.status_code == 503, health.text
    message = health.json()["error"]["message"]
    assert "no healthy decode (or both) worker (2 prefill-only)" in message


def test_requests_without_a_phase_one_go_to_decode_workers_only(router, workers) -> None:
    batch = {"prompt": ["one", "two"], "max_tokens": 2}
    assert _post(router, "/v1/completions", batch).json()["echo"] == batch
    assert _post(router, "/tokenize", {"prompt": "x"}).json()["worker"] == "decode"
    assert httpx.get(f"{router.url}/v1/embeddings", timeout=30).json()["worker"] == "decode"
    raw = httpx.post(f"{router.url}/v1/completions", content=b"{not json", timeout=30)
    assert raw.json()["echo"] == "{not json"  # the worker says what is wrong with it
    assert workers.received(workers.prefill) == []


@pytest.mark.parametrize(
    "value",
    ['{"do_remote_prefill": true, "remote_tokens": NaN}', '{"remote_blocks": 1e309}',
     '{"remote_tokens": -1}', '{"x": 1}', '"text"', "[]", "true", "0.5",
     '{"remote_tokens": 1' + "0" * 400 + "}", "{}"],
)  # fmt: skip
def test_a_clients_kv_transfer_params_is_refused(router, workers, value: str) -> None:
    body = f'{{"prompt": "hi", "kv_transfer_params": {value}}}'.encode()
    for path in ("/v1/completions", "/v1/chat/completions"):
        answer = httpx.post(f"{router.url}{path}", content=body, timeout=30)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert error["param"] == "kv_transfer_params" and error["type"] == "invalid_request_error"
        assert set(error) == {"message", "type", "param", "code"}
    assert workers.received(workers.all) == []
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200
