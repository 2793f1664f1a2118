"""Block pool and KV cache manager bookkeeping: ref counts, prefix hashes, LRU, statistics."""

import pytest

from nanollmserve.engine.kv_cache import KVCacheManager
from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.engine.request import Request
from nanollmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.milestone("m06")


def make_request(request_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=8, cache_salt=cache_salt)
    core = EngineCoreRequest(request_id, token_ids, params)
    return Request(core, eos_token_ids=set(), max_tokens=8)


def test_allocate_grows_block_by_block_and_free_returns_everything():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    req = make_request("a", list(range(6)))
    assert kv.allocate_slots(req, 6)
    assert len(kv.block_ids("a")) == 2
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2)  # fills block 2 exactly
    assert len(kv.block_ids("a")) == 2
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 1)
    assert len(kv.block_ids("a")) == 3
    stats = kv.stats()
    assert stats.num_used_blocks == 3
    assert stats.reserved_tokens == 12 and stats.allocated_tokens == 9
    assert stats.internal_fragmentation == pytest.approx(0.25)
    kv.free(req)
    assert kv.num_free_blocks == 10 and kv.req_blocks == {}


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    req = make_request("a", list(range(12)))
    assert not kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


@pytest.mark.milestone("m08")
def test_prefix_hit_shares_blocks_by_ref_count():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(10)))
    assert kv.get_computed_blocks(first) == []
    assert kv.allocate_slots(first, 10)
    second = make_request("b", list(range(8)) + [99, 98, 97])
    hits = kv.get_computed_blocks(second)
    assert [b.block_id for b in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(second, 3, hits)
    assert all(b.ref_cnt == 2 for b in hits)
    kv.free(first)
    kv.free(second)
    assert kv.num_free_blocks == 10


@pytest.mark.milestone("m21")
def test_cache_salt_shares_blocks_only_within_one_salt():
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10))
    for request_id, salt in (("plain", None), ("alice", "alice"), ("bob", "bob")):
        request = make_request(request_id, prompt, salt)
        assert kv.get_computed_blocks(request) == [], request_id  # nobody else's blocks
        assert kv.allocate_slots(request, len(prompt))
    assert len({tuple(kv.block_ids(r)) for r in ("plain", "alice", "bob")}) == 3
    for request_id, salt in (("plain-2", None), ("alice-2", "alice"), ("bob-2", "bob")):
        hits = kv.get_computed_blocks(make_request(request_id, prompt, salt))
        owner = request_id.removesuffix("-2")
        assert [b.block_id for b in hits] == kv.block_ids(owner)[:2], request_id


@pytest.mark.milestone("m08")
def test_at_least_one_token_is_left_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(8)))
    kv.allocate_slots(first, 8)
    same = make_request("b", list(range(8)))
    assert len(kv.get_computed_blocks(same)) == 1  # not 2: the last token must run


@pytest.mark.milestone("m08")
def test_freed_blocks_stay_findable_until_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(9)))
    kv.allocate_slots(first, 9)
    kv.free(first)
    revived = make_request("b", list(range(9)))
    assert len(kv.get_computed_blocks(revived)) == 2
    # A request that needs the whole pool evicts the cached blocks.
    big = make_request("c", list(range(100, 116)))
    assert kv.allocate_slots(big, 16)
    assert kv.get_computed_blocks(make_request("d", list(range(9)))) == []
    assert kv.stats().num_cached_blocks == 4  # c's own full blocks


@pytest.mark.milestone("m08")
def test_equal_hash_with_different_tokens_is_not_a_hit():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    first = make_request("a", [1, 2, 3])
    kv.allocate_slots(first, 3)
    block = kv.req_blocks["a"].blocks[0]
    # Forge a collision: the other request's first block hash points at a's block.
    other = make_request("b", [5, 6, 7])
    kv._extend_block_hashes(other, 1)
    kv.pool.cached_blocks[other.block_hashes[0]] = block
    assert kv.get_computed_blocks(other) == []


def test_pool_is_sized_from_kv_cache_memory(make_llm):
    """--kv-cache-memory bytes -> blocks of 2 * layers * kv_heads * head_dim * itemsize * 16."""
    llm = make_llm(num_kv_blocks=None, kv_cache_memory=8 * 1024 * 1024, block_size=16)
    engine = llm.engine
    config = engine.model_config
    per_block = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 * 16
    assert engine.num_kv_blocks == 8 * 1024 * 1024 // per_block
    kv = engine.model_runner.kv_cache
    assert kv.numel() * kv.element_size() == engine.num_kv_blocks * per_block
    assert engine.max_model_len == engine.num_kv_blocks * 16  # capped to what the pool holds
