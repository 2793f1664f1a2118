"""`nanollmserve serve` as a process: the ready line, graceful shutdown on SIGTERM (running
requests finish, exit 0), SIGINT with a short --shutdown-timeout (running requests are
aborted, exit 0), and a busy port failing fast with one line."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from live_server import LiveServer, busy_port

pytestmark = pytest.mark.milestone("m02")


def _stream_in_thread(server: LiveServer, body: dict) -> tuple[threading.Thread, list, dict]:
    lines: list[str] = []
    result: dict = {}
    first_chunk = threading.Event()

    def run():
        try:
            with (
                server.client() as client,
                client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response,
            ):
                for line in response.iter_lines():
                    if line:
                        lines.append(line)
                        first_chunk.set()
        except httpx.HTTPError as exc:
            result["error"] = exc
        finally:
            first_chunk.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert first_chunk.wait(60)
    return thread, lines, result


def test_ready_line_and_sigterm_lets_running_requests_finish():
    server = LiveServer.start("--num-kv-blocks", "64", "--served-model-name", "tiny", "smol")
    try:
        ready = [line for line in server.log().splitlines() if "nanollmserve ready" in line]
        assert len(ready) == 1
        assert re.search(
            rf"http://127\.0\.0\.1:{server.port} model=tiny device=cpu dtype=float32 "
            r"quantization=gguf kv_blocks=64x16 tokens max_model_len=1024 ready_in=[\d.]+s",
            ready[0],
        ), ready[0]
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["tiny", "smol"]

        body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
        thread, lines, result = _stream_in_thread(server, body)
        server.process.send_signal(signal.SIGTERM)
        thread.join(60)
        assert "error" not in result
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        assert server.process.wait(60) == 0
        assert "nanollmserve stopped" in server.log()
    finally:
        server.stop()


def test_sigint_aborts_what_outlives_the_shutdown_timeout():
    server = LiveServer.start("--num-kv-blocks", "128", "--shutdown-timeout", "1")
    try:
        body = {"prompt": "Count:", "max_tokens": 1500, "ignore_eos": True}
        thread, lines, _ = _stream_in_thread(server, body)
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(60) == 0
        thread.join(60)
        # The engine ended the request at the timeout (not timed here: the error event says
        # it was the timeout, on any machine): an error event, then [DONE].
        assert len(lines) < 1500 and lines[-1] == "data: [DONE]"
        assert '"code": "engine_unavailable"' in lines[-2] and "shut down" in lines[-2]
        assert "Traceback" not in server.log()
    finally:
        server.stop()


def test_busy_port_fails_fast_with_one_line():
    with busy_port() as port:
        done = subprocess.run(
            [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"nanollmserve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
