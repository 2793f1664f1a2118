"""What keeps a live server up, through its HTTP API: readers that stall do not grow its
memory (outputs are queued as deltas, merged while a reader lags), a huge prompt is
tokenized off the event loop (`/health` still answers), and a failing engine step fails only
the requests in the engine (500), after which the server goes on; repeated failures make the
process exit non-zero so a supervisor restarts it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from live_server import LiveServer

pytestmark = pytest.mark.milestone("m02")


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _kv_bytes_per_token() -> int:
    """K and V bytes a token takes in the live servers here (bundled model, float32)."""
    from nanollmserve.model import ModelConfig, resolve_model

    return ModelConfig.from_pretrained(resolve_model(None).path).kv_bytes_per_token(torch.float32)


STALLED_TOKENS = 8 * 100
"""Tokens the 8 unread streams generate before the memory is measured."""


def _wait_generated(server: LiveServer, total: int, timeout: float) -> dict:
    """The server's stats once it has generated `total` tokens since it started."""
    deadline = time.monotonic() + timeout
    while (stats := server.stats())["num_generation_tokens"] < total:
        assert time.monotonic() < deadline, f"only {stats['num_generation_tokens']} of {total}"
        time.sleep(0.2)
    return stats


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
@pytest.mark.milestone("m21")
@pytest.mark.timeout(400)
def test_stalled_streams_do_not_grow_memory_and_free_their_blocks():
    server = LiveServer.start("--num-kv-blocks", "2048", "--max-num-seqs", "8")
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
        with server.client() as warm:  # first steps allocate what a batch needs
            warm.post("/v1/completions", json={**body, "max_tokens": 64}).raise_for_status()
        before = _rss_bytes(server.process.pid)
        generated_before = server.stats()["num_generation_tokens"]
        clients = [httpx.Client(base_url=server.url, timeout=120) for _ in range(8)]
        responses = []
        for client in clients:  # opened, headers read, body never read
            request = client.build_request("POST", "/v1/completions", json={**body, "stream": True})
            response = client.send(request, stream=True)
            assert response.status_code == 200
            responses.append(response)
        # Measured at a token count, not after a fixed time: the same work on any machine.
        stats = _wait_generated(server, generated_before + STALLED_TOKENS, timeout=240)
        grown = _rss_bytes(server.process.pid) - before
        generated = stats["num_generation_tokens"] - generated_before
        # The CPU KV pool is committed page by page as tokens are written (zero pages of an
        # anonymous map), so the K/V of the blocks in use count in the RSS: take them out.
        used_blocks = stats["num_total_blocks"] - stats["num_free_blocks"]
        block_bytes = _kv_bytes_per_token() * stats["block_size"]
        outside_kv = grown - used_blocks * block_bytes
        print(
            f"8 stalled streams: {generated} tokens generated, RSS grew {grown / 2**20:.1f} MB, "
            f"{outside_kv / 2**20:.1f} MB outside the {used_blocks} KV blocks in use"
        )
        assert stats["num_requests_running"] == 8  # all still running, nobody reading
        assert outside_kv < 100 * 2**20
        for response, client in zip(responses, clients, strict=True):
            response.close()
            client.close()
        idle = server.wait_idle(timeout=60)
        assert idle["num_requests_running"] == 0
        assert idle["num_free_blocks"] == idle["num_total_blocks"]
    finally:
        server.stop()


@pytest.mark.milestone("m21")
def test_health_answers_while_a_huge_prompt_is_tokenized():
    """Timed against the huge request itself, not against fixed seconds: tokenized on the
    event loop, a /health sent during the tokenization would wait for most of it."""
    server = LiveServer.start()
    try:
        prompt = "hello world, this is a test of tokenization. " * 78_000  # ~3.5 MB
        result: dict = {}

        def send_big() -> None:
            with server.client() as client:
                result["start"] = time.monotonic()
                response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
                result["end"] = time.monotonic()
                result["response"] = response

        thread = threading.Thread(target=send_big)
        thread.start()
        polls = []  # (sent, answered) of each /health
        with httpx.Client(base_url=server.url, timeout=120) as client:
            while thread.is_alive():
                sent = time.monotonic()
                assert client.get("/health").status_code == 200
                polls.append((sent, time.monotonic()))
                time.sleep(0.02)
        thread.join()
        response = result["response"]
        seconds = result["end"] - result["start"]
        # Sent while the huge request was in flight (answered maybe only after it, if blocked).
        during = [a - s for s, a in polls if result["start"] <= s <= result["end"]]
        print(
            f"big prompt answered in {seconds:.2f} s; {len(during)} /health polls during it, "
            f"max {max(during, default=0):.3f} s"
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "prompt"
        assert "maximum context length" in response.json()["error"]["message"]
        assert len(during) >= 3, "the huge request ended before /health was polled"
        assert max(during) < seconds / 4, (max(during), seconds)
    finally:
        server.stop()


def _complete(server: LiveServer, max_tokens: int = 8) -> httpx.Response:
    with server.client() as client:
        body = {"prompt": "The capital of France is", "max_tokens": max_tokens}
        return client.post("/v1/completions", json=body)


def test_a_failed_step_is_a_500_and_the_server_goes_on():
    server = LiveServer.start(env={"NANOLLMSERVE_FAIL_STEPS": "3"})
    try:
        failed = _complete(server)
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "engine_step_failed"
        assert "step 3 failed" in error["message"]
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        ok = _complete(server)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
        idle = server.wait_idle()
        assert idle["num_requests_failed"] == 1
        assert idle["num_free_blocks"] == idle["num_total_blocks"]
        assert server.process.poll() is None
    finally:
        server.stop()


def test_repeated_step_failures_exit_the_process_non_zero():
    server = LiveServer.start(env={"NANOLLMSERVE_FAIL_STEPS": "1,2,3"})
    try:
        for _ in range(3):
            assert _complete(server).status_code == 500
        assert server.process.wait(timeout=60) == 1
        assert "the engine failed" in server.log()
    finally:
        server.stop()
