"""The KV pool's resident footprint over a long run at concurrency 1 (m25, issue 25).

The pool is one shared anonymous map (`model_runner.py`; `/dev/zero` in /proc/PID/smaps) whose
pages the OS commits when a block is first written. Free blocks that cache nothing are reused
most recently freed first (`engine/kv_cache.py`), so many short requests one after another keep
writing the same few blocks: the pool's resident size stays a few blocks, not every block the
run ever took (before, freed blocks went to the back of the free list and a run of 64
requests touched ~190 blocks, ~140 MB, of the bundled model's pool).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from live_server import LiveServer
from test_kv_cache import make_request

from nanollmserve.engine.kv_cache import KVCacheManager

pytestmark = pytest.mark.milestone("m25")

NUM_REQUESTS = 64
BLOCK_BYTES = 16 * 30 * 2 * 3 * 64 * 4
"""One block of the bundled model's float32 pool: 16 tokens x 30 layers x K and V x 3 KV
heads x 64 dims x 4 bytes (737 KB)."""
RESIDENT_BOUND_BYTES = 24 * BLOCK_BYTES
"""A request here holds 3-4 blocks; the bound leaves room for pages the OS maps around them,
and is ~8x below what the old free-list order touched."""


def test_blocks_caching_nothing_are_reused_first_and_cached_ones_evicted_lru():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    cached = make_request("cached", list(range(9)))  # 2 full blocks (hashed), 1 partial
    assert kv.allocate_slots(cached, 9)
    first_ids = kv.block_ids("cached")
    assert first_ids == [0, 1, 2]  # never used blocks go in id order
    kv.free(cached)
    # The partial block caches nothing: the next request takes it, then a never used one,
    # and the cached blocks stay findable.
    other = make_request("other", list(range(100, 108)))
    assert kv.allocate_slots(other, 8)
    assert kv.block_ids("other") == [2, 3]
    assert len(kv.get_computed_blocks(make_request("probe", list(range(9))))) == 2
    kv.free(other)
    # Needing more than the blocks without a hash evicts the cached ones, least recent first.
    big = make_request("big", list(range(200, 232)))
    assert kv.allocate_slots(big, 32)
    assert sorted(kv.block_ids("big")) == list(range(8))
    assert kv.get_computed_blocks(make_request("probe2", list(range(9)))) == []


def pool_resident_bytes(pid: int) -> int:
    """Resident bytes of the process's shared anonymous maps: the KV pool."""
    resident, in_pool = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a map's header line
            in_pool = len(fields) > 5 and fields[5] == "/dev/zero"
        elif in_pool and fields[0] == "Rss:":
            resident += int(fields[1]) * 1024
    return resident


def run_sequentially(server: LiveServer, prompts: list[str]) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for prompt in prompts:
            answer = client.post(
                "/v1/completions",
                json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert answer.status_code == 200, answer.text


def assert_pool_stays_small(server: LiveServer, prompts: list[str]) -> None:
    try:
        run_sequentially(server, prompts)
        server.wait_idle()
        resident = pool_resident_bytes(server.process.pid)
        assert 0 < resident < RESIDENT_BOUND_BYTES, (
            f"the KV pool has {resident / 2**20:.1f} MiB resident after {len(prompts)} "
            f"sequential requests (bound {RESIDENT_BOUND_BYTES / 2**20:.1f} MiB)"
        )
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sequential_requests_reuse_the_same_blocks_without_prefix_caching():
    """Distinct prompts, nothing cached: every freed block is reused."""
    server = LiveServer.start("--dtype", "auto", "--no-enable-prefix-caching")
    prompts = [f"Request number {i}: tell me one fact about the number {i * 7}." for i in range(64)]
    assert_pool_stays_small(server, prompts[:NUM_REQUESTS])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_repeated_prompt_reuses_its_blocks_with_the_prefix_cache_on():
    """The default server, one prompt sent again and again (greedy): its full prompt blocks
    are prefix-cache hits, and the block after them is computed anew each time but caches
    nothing (an equal block is cached already), so it is reused, not a fresh one each time."""
    server = LiveServer.start("--dtype", "auto")
    prompt = "You are a helpful assistant. Answer briefly and precisely. " * 3
    assert_pool_stays_small(server, [prompt] * NUM_REQUESTS)
