"""The router's own limits (m21), end to end: a real `nanollmserve router` process in front of
a stand-in worker (a small HTTP server in this process that records what reaches it).

An oversized body (by its Content-Length, or a chunked one that grows past the cap) answers
413 in the OpenAI error shape before the router reads it whole, reaches no worker, and the
router keeps serving; the worker gets exactly the path the router authorized, whatever the
Host header says; with `--metrics-require-auth` the router's /metrics needs the key.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from cluster_process import ClusterProcess
from live_server import free_port

pytestmark = [pytest.mark.milestone("m21"), pytest.mark.timeout(180)]

API_KEY = "router-key-123"
MAX_REQUEST_BYTES = 64 * 1024


class StandInWorker:
    """Answers 200 to everything (so the router finds it healthy) and records each request
    but the health checks: (method, path as the worker decodes it, query, body length)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str, int]] = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                raw_path, _, query = self.path.partition("?")
                path = urllib.parse.unquote(raw_path)
                if path != "/health":
                    worker.requests.append((self.command, path, query, len(body)))
                payload = json.dumps({"path": path}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def worker():
    worker = StandInWorker()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def router(worker):
    port = free_port()
    router = ClusterProcess.start(
        "router", port, "--port", str(port), "--worker", worker.url, "--health-interval", "0.5",
        "--max-request-bytes", "64KiB", "--metrics-require-auth",
        api_key=API_KEY, num_workers=1,
    )  # fmt: skip
    yield router
    assert router.stop() == 0


def _connect(router) -> socket.socket:
    host, port = urllib.parse.urlsplit(router.url).netloc.split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, json.loads(response.read())


def _assert_too_large(status: int, body: dict) -> None:
    assert status == 413
    assert body["error"]["code"] == "request_too_large"
    assert body["error"]["type"] == "invalid_request_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert str(MAX_REQUEST_BYTES) in body["error"]["message"]


def _head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: router", f"Authorization: Bearer {API_KEY}"]
    lines += ["Content-Type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_oversized_bodies_get_413_before_they_are_read_and_the_router_keeps_serving(
    router, worker
) -> None:
    before = len(worker.requests)
    # A Content-Length over the cap: the answer comes before a byte of the body was sent.
    with _connect(router) as sock:
        sock.sendall(_head("/v1/completions", "Content-Length: 10000000"))
        _assert_too_large(*_read_response(sock))
    # A chunked body that grows past the cap and never ends: the router stops reading there.
    with _connect(router) as sock:
        sock.sendall(_head("/v1/completions", "Transfer-Encoding: chunked"))
        chunk = b"x" * 16384
        for _ in range(2 * MAX_REQUEST_BYTES // len(chunk)):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        _assert_too_large(*_read_response(sock))
    assert len(worker.requests) == before  # neither reached the worker
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "y" * (MAX_REQUEST_BYTES - 1024)}
    answer = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    method, path, _, length = worker.requests[-1]
    assert (method, path) == ("POST", "/v1/completions") and length > MAX_REQUEST_BYTES - 1024
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200


def _get(router, path: str, headers: dict[str, str]) -> int:
    host, port = urllib.parse.urlsplit(router.url).netloc.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", path, headers=headers)  # sent as is: no URL normalization
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_the_worker_gets_the_path_the_router_authorized(router, worker) -> None:
    # An open path (the playground page) with a Host header that carries another path.
    spoofed = {"Host": "evil.example/v1/models?x="}
    assert _get(router, "/", spoofed) == 200
    assert worker.requests[-1][:3] == ("GET", "/", "")
    key = {"Authorization": f"Bearer {API_KEY}"}
    # Percent-encoded bytes and dot segments reach the worker as the router decoded them.
    assert _get(router, "/v1/echo%2541?a=1&b=%20", key | spoofed) == 200
    assert worker.requests[-1][:3] == ("GET", "/v1/echo%41", "a=1&b=%20")
    assert _get(router, "/v1/a/../b%3Fc", key) == 200
    assert worker.requests[-1][:3] == ("GET", "/v1/a/../b?c", "")
    assert _get(router, "/v1/a/../b", {}) == 401  # not an open path: the key is needed


def test_router_metrics_need_the_key_with_metrics_require_auth(router) -> None:
    refused = httpx.get(f"{router.url}/metrics", timeout=10)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    metrics = httpx.get(f"{router.url}/metrics", headers=headers, timeout=10)
    assert metrics.status_code == 200 and "nanollmserve_router" in metrics.text
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200  # still open
