"""The `/v1/responses` store is bounded in bytes (m21), through a live server started with a
small `--responses-store-max-bytes`: storing past the bound evicts the least recently used
responses (GET of the oldest is a 404, the newest is still there), the stored responses never
add up to more than the bound, one larger than the bound is answered but not stored, and the
server's RSS stays near where it started while bodies of 20k tools (`tool_choice: "none"`:
never rendered, but echoed back by GET) are stored one after another.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from live_server import LiveServer

pytestmark = pytest.mark.milestone("m21")

API_KEY = "store-key-123"
STORE_MAX_BYTES = 3 << 20
RSS_SLACK_BYTES = 50 << 20
NUM_LARGE_RESPONSES = 12
"""~2 MB bodies of 20k tools: each pinned ~18 MB of RSS when the store kept the parsed body."""


@pytest.fixture(scope="module")
def server():
    server = LiveServer.start(
        "--num-kv-blocks", "64", "--responses-store-max-bytes", str(STORE_MAX_BYTES),
        api_key=API_KEY,
        env={"NANOLLMSERVE_MAX_TOOLS": "100000"},  # the per-request tools limit, raised
    )  # fmt: skip
    yield server
    server.stop()


def _tools(count: int) -> list[dict]:
    """`count` small function tools (about 100 bytes each in JSON)."""
    parameters = {"type": "object", "properties": {}}
    return [
        {"type": "function", "name": f"tool_{i}", "description": "d", "parameters": parameters}
        for i in range(count)
    ]


def _store(client, num_tools: int) -> str:
    body = {
        "input": "Say hi.",
        "max_output_tokens": 1,
        "tools": _tools(num_tools),
        "tool_choice": "none",
        "store": True,
    }
    answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] in ("completed", "incomplete")
    return answer.json()["id"]


def _stored_size(client, response_id: str) -> int | None:
    """The size of the stored response as GET answers it; None when it is not stored."""
    answer = client.get(f"/v1/responses/{response_id}")
    if answer.status_code == 404:
        assert answer.json()["error"]["param"] == "response_id"
        return None
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == response_id
    return len(answer.content)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.timeout(300)
def test_storing_past_the_byte_bound_evicts_the_oldest(server) -> None:
    with server.client() as client:
        # Each ~1.2 MB: two fit in the bound, the third pushes the oldest out.
        first, second, third = (_store(client, 10_000) for _ in range(3))
        assert _stored_size(client, first) is None
        sizes = [_stored_size(client, second), _stored_size(client, third)]
        assert None not in sizes and sum(sizes) <= STORE_MAX_BYTES
        # One larger than the whole bound is answered, not stored, and evicts nothing.
        too_big = _store(client, 30_000)
        assert _stored_size(client, too_big) is None
        assert _stored_size(client, second) and _stored_size(client, third)
        # previous_response_id still continues a stored conversation.
        follow_up = client.post(
            "/v1/responses",
            json={"input": "Again.", "max_output_tokens": 1, "previous_response_id": third},
        )
        assert follow_up.status_code == 200, follow_up.text
        assert _stored_size(client, follow_up.json()["id"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rss_stays_bounded_while_many_large_responses_are_stored(server) -> None:
    pid = server.process.pid
    with server.client() as client:
        # Warm up: the first request faults the model's weights in, the first large bodies
        # fill the allocator's pools.
        for _ in range(2):
            _store(client, 20_000)
        start = _rss_bytes(pid)
        ids = [_store(client, 20_000) for _ in range(NUM_LARGE_RESPONSES)]
        assert sum(_stored_size(client, i) is not None for i in ids) == 1  # ~2.3 MB each
        deadline = time.monotonic() + 60
        while _rss_bytes(pid) > start + RSS_SLACK_BYTES and time.monotonic() < deadline:
            time.sleep(0.5)  # freed memory can take a moment to go back to the system
        grown = _rss_bytes(pid) - start
        assert grown <= RSS_SLACK_BYTES, f"RSS grew by {grown >> 20} MiB storing {len(ids)}"
