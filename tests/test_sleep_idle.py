"""`--sleep-idle-seconds` (m25, llama-server's flag) on a live server: after that long without
requests the server sleeps by itself (level 2: the KV pool and the weights leave its RSS), the
next request wakes it and is served with the same greedy output; a sleep asked for with
`POST /sleep` still holds until `POST /wake_up`; bad values of the flag (and of its
environment variable) fail before the model loads.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from live_server import LiveServer
from test_sleep_mode import MODEL, assert_sleeping_503, completion, poll, rss_bytes

pytestmark = [pytest.mark.milestone("m25"), pytest.mark.slow]

API_KEY = "sleep-idle-key"
ADMIN_KEY = "sleep-idle-admin-key"
IDLE_SECONDS = 2


@pytest.fixture(scope="module")
def server():
    live = LiveServer.start(
        "--dtype", "auto", "--enable-sleep-mode", "--sleep-idle-seconds", str(IDLE_SECONDS),
        "--num-kv-blocks", "256", api_key=API_KEY, admin_api_key=ADMIN_KEY,
    )  # fmt: skip
    yield live
    live.stop()


def greedy(server) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12}
    with server.client() as client:
        return client.post("/v1/completions", json={**body, "temperature": 0})


def is_sleeping(server) -> bool:
    with server.admin_client() as client:  # an admin route (m27)
        return client.get("/is_sleeping").json()["is_sleeping"]


@pytest.mark.timeout(300)
def test_the_server_sleeps_when_idle_and_the_next_request_wakes_it(server):
    first = greedy(server)
    assert first.status_code == 200, first.text
    awake_rss = rss_bytes(server.process.pid)
    poll(lambda: is_sleeping(server), 60, f"sleep after {IDLE_SECONDS} idle seconds")
    poll(
        lambda: rss_bytes(server.process.pid) < awake_rss - (20 << 20),
        30,
        f"RSS to fall 20 MiB below {awake_rss} bytes",
    )
    second = greedy(server)  # wakes the server, waits for it, is served
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert "asleep (level 2)" in server.log() and "waking up" in server.log()


@pytest.mark.timeout(300)
def test_an_explicit_sleep_holds_until_wake_up(server):
    with server.admin_client() as client:
        assert client.post("/sleep", params={"level": "1"}).status_code == 200
        assert_sleeping_503(completion(server.url, server.headers))
        assert is_sleeping(server)
        assert client.post("/wake_up").status_code == 200
    assert greedy(server).status_code == 200


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "soon"])
def test_bad_sleep_idle_seconds_fail_before_the_model_loads(value):
    for argv, env in [
        ([f"--sleep-idle-seconds={value}"], {}),
        ([], {"NANOLLMSERVE_SLEEP_IDLE_SECONDS": value}),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "nanollmserve.cli.main", "serve", "--port", "0", *argv],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        last_line = result.stderr.strip().splitlines()[-1]  # argparse's usage may come first
        assert "nanollmserve" in last_line and "error" in last_line, result.stderr
        assert "sleep-idle-seconds" in last_line.lower().replace("_", "-"), result.stderr
        assert "Traceback" not in result.stderr and "loaded" not in result.stderr
