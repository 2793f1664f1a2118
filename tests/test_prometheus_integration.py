"""A real Prometheus scrapes a live server: after known requests, Prometheus's HTTP API reports
`nanollmserve:generation_tokens_total` equal to the tokens the test generated.

Run by `make test-integration` (and CI), which installs Debian's `prometheus` first
(`scripts/setup-integration`); without it the test skips, saying why, or fails in CI.
Prometheus runs on loopback with a temporary config (1 s scrape interval) and storage, and is
stopped at the end.
"""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
from apt_binary import apt_binary
from live_server import LiveServer, free_port

pytestmark = [pytest.mark.integration, pytest.mark.milestone("m10")]

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    live = LiveServer.start("--num-kv-blocks", "128")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = apt_binary("prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: nanollmserve\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{server.port}']\n"
    )
    port = free_port()
    log = (workdir / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (workdir / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready after 60 s"
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def query(prometheus: str, promql: str) -> float | None:
    """The value of a one-series instant query (None while there is no series)."""
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert reply["status"] == "success", reply
    result = reply["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for(prometheus: str, promql: str, expected: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (value := query(prometheus, promql)) != expected:
        assert time.monotonic() < deadline, f"{promql} = {value}, expected {expected}"
        time.sleep(0.5)


def test_prometheus_sees_the_exact_generated_tokens(server, prometheus):
    wait_for(prometheus, 'up{job="nanollmserve"}', 1.0)
    client = server.openai()
    generated = 0
    for i, max_tokens in enumerate([4, 7, 10]):
        reply = client.completions.create(
            model=MODEL, prompt=f"Prometheus test {i}:", max_tokens=max_tokens, temperature=0
        )
        generated += reply.usage.completion_tokens
    wait_for(prometheus, f'nanollmserve:generation_tokens_total{{model_name="{MODEL}"}}', generated)
    wait_for(prometheus, "sum(nanollmserve:request_success_total)", 3.0)
    wait_for(prometheus, "sum(inference_requests_total)", 3.0)
    assert query(prometheus, "nanollmserve:time_to_first_token_seconds_count") == 3.0
