"""KV block bookkeeping: the block pool, per-request block tables and the prefix cache.

The KV tensors themselves live in the model runner; this file only decides which block ids a
request owns. A block is `block_size` token slots. Requests grow block by block and give every
block back the moment they finish, are aborted or preempted.

Prefix caching: a full block is named by a hash chained over its parent's hash and its own
token ids, so equal hashes mean equal prefixes. The first block's parent is the request's
LoRA adapter and `cache_salt`: requests share blocks only within one adapter and one salt.
Full blocks are registered as soon as the step that computes them is scheduled (the whole
batch writes its K/V before any attention reads, so a request scheduled later in the same
step may already reuse them). A freed block keeps its hash and stays findable until the pool
needs it for something else: free blocks with a hash form an LRU queue, evicted from the front.

The pool is one memory map whose pages the OS commits when first written, so the order free
blocks are taken in decides the resident footprint: a free block without a hash (the partial
last block of a request, a block of a duplicate prefix, every block with prefix caching off)
is reused first, the most recently freed first (its pages are resident, it caches nothing);
then a block never used yet, in id order; a cached block is evicted only when neither is
left. A long run of requests that cache nothing then keeps reusing the same few blocks
instead of touching the whole pool (tests/test_kv_footprint.py).

KV offload (`kv_offload.py`, `--kv-offload-dir`): a second tier behind the pool. Every block
registered here is handed to it once the step that computes it has run
(`offload_computed_blocks`), and a lookup that misses the pool goes on in the offload store:
the blocks found there are read into free pool blocks and registered, so they are taken as
pool hits are.

Saved slots (`slot_save.py`, `--slot-save-path`) use the same cache without a request:
`cached_prefix` finds a token sequence's blocks, `insert_cached` puts restored ones in (free
and registered, like offloaded ones) and `uncache` drops the free ones (erase).

It counts nothing: the scheduler reports lookups, hits and blocks in use in its
`SchedulerOutput`, and `EngineCore` keeps the totals (`engine/stats.py`). With the flight
recorder on, each request's block events (allocated, released, prefix hits, evictions) go
into `block_events`, which the engine drains into each step's record.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanollmserve.engine.request import Request

if TYPE_CHECKING:
    from nanollmserve.engine.kv_offload import KVOffload


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.key: tuple | None = None  # (parent hash, token ids): rules out hash collisions


class BlockPool:
    """All blocks, the free blocks (a stack of blocks without a hash, the LRU queue of cached
    ones) and the hash -> block map of cached full blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_unhashed: list[KVBlock] = self.blocks[::-1]
        """Free blocks without a hash, taken from the end: the most recently freed, then the
        never used ones in id order (the start of the list)."""
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict()
        """Free blocks with a hash, least recently freed first: evicted from the front."""
        self.cached_blocks: dict[int, KVBlock] = {}
        self.num_evicted = 0  # cached blocks overwritten since start (the flight recorder's)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_unhashed) + len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        blocks = []
        for _ in range(num_blocks):
            if self.free_unhashed:
                block = self.free_unhashed.pop()
            else:
                _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict: its content is about to be overwritten
                del self.cached_blocks[block.block_hash]
                block.block_hash = block.key = None
                self.num_evicted += 1
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache hits, reviving blocks that were free."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; pass a request's blocks tail first so its tail is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block.block_hash is None:
                self.free_unhashed.append(block)
            elif block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def lookup(self, block_hash: int, key: tuple) -> KVBlock | None:
        block = self.cached_blocks.get(block_hash)
        if block is None or block.key != key:
            return None
        return block

    def register(self, block: KVBlock, block_hash: int, key: tuple) -> None:
        if block.block_hash is not None or block_hash in self.cached_blocks:
            return  # already cached, or an equal block computed by another request is
        block.block_hash = block_hash
        block.key = key
        self.cached_blocks[block_hash] = block


@dataclass
class KVCacheStats:
    num_blocks: int
    block_size: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    """Blocks holding a prefix-cache entry (in use or free but still findable)."""
    allocated_tokens: int
    """Token slots holding a token of a running request."""
    reserved_tokens: int
    """Token slots in the blocks in use (allocated + the empty tail of each last block)."""
    peak_used_blocks: int = 0
    """The most blocks in use at once since start: filled in by EngineCore from its counters
    (the manager itself reports only the present, so 0 from `KVCacheManager.stats()`)."""

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def internal_fragmentation(self) -> float:
        if not self.reserved_tokens:
            return 0.0
        return 1.0 - self.allocated_tokens / self.reserved_tokens


@dataclass
class RequestBlocks:
    """One request's share of the pool: its block table and how far it is filled."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_tokens: int = 0
    """Tokens whose slots the request holds."""
    num_registered: int = 0
    """Leading blocks already in the prefix cache."""


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        offload: KVOffload | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, RequestBlocks] = {}  # request id -> what it holds
        self.offload = offload if enable_prefix_caching else None
        self._unsaved: list[tuple[Request, int, KVBlock]] = []
        """Blocks registered for the step being scheduled, for the offload tier once it ran."""
        self.block_events: list[tuple[str, int, int, int, int]] | None = None
        """With the flight recorder on, a list the engine drains each step: (request id,
        blocks allocated, released, prefix-cache hits, cached blocks evicted) per change."""

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        held = self.req_blocks.get(request_id)
        return [b.block_id for b in held.blocks] if held else []

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached full blocks that prefixes the request's tokens.

        At least one token is always left to compute: its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_block_hashes(request, max_blocks)
        hits = []
        for i in range(max_blocks):
            block = self.pool.lookup(request.block_hashes[i], self._block_key(request, i))
            if block is None:
                break
            hits.append(block)
        if self.offload is not None and len(hits) < max_blocks:
            hits += self._load_offloaded(request, hits, max_blocks)
        return hits

    def _load_offloaded(
        self, request: Request, hits: list[KVBlock], max_blocks: int
    ) -> list[KVBlock]:
        """The request's blocks after its pool hits that the offload store holds, read into
        free pool blocks and registered there (free, so taken as pool hits are). Leaves at
        least one free block besides them and never evicts the request's own hits."""
        start = len(hits)
        spare = self.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0) - 1
        num_found = min(self.offload.num_stored(request, start, max_blocks), spare)
        if num_found <= 0:
            return []
        self.pool.touch(hits)  # out of the free queue while fresh blocks are taken from it
        blocks = self.pool.allocate(num_found)
        num_loaded = self.offload.load(request, start, [b.block_id for b in blocks])
        for i, block in enumerate(blocks[:num_loaded], start):
            self.pool.register(block, request.block_hashes[i], self._block_key(request, i))
        self.pool.free(list(reversed(blocks)) + list(reversed(hits)))
        return blocks[:num_loaded]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = ()
    ) -> bool:
        """Give the request slots for `num_new_tokens` more tokens after its computed ones
        (and after `computed_blocks`, cache hits it takes on now). False if the pool is short."""
        held = self.req_blocks.get(request.request_id) or RequestBlocks()
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_tokens = num_computed + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - len(held.blocks) - len(computed_blocks)
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return False
        self.req_blocks[request.request_id] = held
        self.pool.touch(list(computed_blocks))
        held.blocks.extend(computed_blocks)
        num_evicted = self.pool.num_evicted
        if num_needed > 0:
            held.blocks.extend(self.pool.allocate(num_needed))
        if self.block_events is not None and (num_needed > 0 or computed_blocks):
            self.block_events.append(
                (
                    request.request_id,
                    max(num_needed, 0),
                    0,
                    len(computed_blocks),
                    self.pool.num_evicted - num_evicted,
                )
            )
        held.num_tokens = num_tokens
        if computed_blocks:  # a fresh request: its cache hits are its first blocks
            held.num_registered = len(computed_blocks)
            transfer = request.sampling_params.kv_transfer_params
            if self.offload is not None and transfer is not None and transfer.do_remote_decode:
                # Phase 1 of prefill/decode disaggregation hands every prompt block on
                # through the store, its hits too (the store skips those it holds).
                self._unsaved += [(request, i, b) for i, b in enumerate(computed_blocks)]
        if self.enable_prefix_caching:
            self._register_full_blocks(request, held)
        return True

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep slots for the first `num_tokens` tokens only, giving whole blocks past them
        back (speculative decoding: the slots of rejected draft tokens). Blocks past them
        were never registered in the prefix cache: only blocks of accepted tokens are."""
        held = self.req_blocks.get(request.request_id)
        if held is None or num_tokens >= held.num_tokens:
            return
        held.num_tokens = num_tokens
        num_kept = -(-num_tokens // self.block_size)
        if len(held.blocks) > num_kept:
            self.pool.free(list(reversed(held.blocks[num_kept:])))
            if self.block_events is not None:
                self.block_events.append((request.request_id, 0, len(held.blocks) - num_kept, 0, 0))
            del held.blocks[num_kept:]

    def free(self, request: Request) -> None:
        held = self.req_blocks.pop(request.request_id, None)
        if held is not None:
            self.pool.free(list(reversed(held.blocks)))
            if self.block_events is not None and held.blocks:
                self.block_events.append((request.request_id, 0, len(held.blocks), 0, 0))

    def stats(self) -> KVCacheStats:
        used = self.num_used_blocks
        reserved = used * self.block_size
        empty_tails = sum(
            len(held.blocks) * self.block_size - held.num_tokens
            for held in self.req_blocks.values()
        )
        return KVCacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            num_used_blocks=used,
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=len(self.pool.cached_blocks),
            allocated_tokens=reserved - empty_tails,
            reserved_tokens=reserved,
        )

    def _register_full_blocks(self, request: Request, held: RequestBlocks) -> None:
        # Slots past the request's tokens hold draft tokens, not accepted yet: never cached.
        num_full = min(held.num_tokens, request.num_tokens) // self.block_size
        if num_full <= held.num_registered:
            return
        self._extend_block_hashes(request, num_full)
        for i in range(held.num_registered, num_full):
            self.pool.register(held.blocks[i], request.block_hashes[i], self._block_key(request, i))
            if self.offload is not None:
                self._unsaved.append((request, i, held.blocks[i]))
        held.num_registered = num_full

    def offload_computed_blocks(self, ran: list[Request]) -> None:
        """After a step ran: hand the blocks registered for it to the offload tier. A block
        whose request was taken out of the step before it ran holds no K/V, and one another
        request registered first is saved as that request's: neither is handed over."""
        if not self._unsaved:
            return
        unsaved, self._unsaved = self._unsaved, []
        ran_ids = {id(request) for request in ran}
        self.offload.save(
            [
                (request, i, block.block_id)
                for request, i, block in unsaved
                if id(request) in ran_ids and block.block_hash == request.block_hashes[i]
            ]
        )

    # -- saved slots (`slot_save.py`): a sequence's blocks by its tokens, no request --------
    def cached_prefix(self, token_ids: list[int], root=0) -> list[KVBlock]:
        """The cached blocks of `token_ids`' full blocks, from the first, as a request of the
        base model without a cache salt (`root` 0) finds them: they stop at the first miss."""
        blocks: list[KVBlock] = []
        parent = root
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            key = (parent, tuple(token_ids[start : start + self.block_size]))
            parent = hash(key)
            block = self.pool.lookup(parent, key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def insert_cached(self, token_ids: list[int], num_blocks: int, fill, root=0) -> int:
        """Put the first `num_blocks` full blocks of `token_ids` into the prefix cache: a
        block cached already stays, a missing one gets a free pool block, `fill(index,
        block_id)` writes its K/V, and it is registered (free, so requests take it as any
        hit). Leaves one free block besides them -> how many of them are cached now."""
        held: list[KVBlock] = []
        parent = root
        count = 0
        try:
            for index in range(num_blocks):
                start = index * self.block_size
                key = (parent, tuple(token_ids[start : start + self.block_size]))
                parent = hash(key)
                block = self.pool.lookup(parent, key)
                if block is None:
                    if self.pool.num_free_blocks < 2:
                        break
                    [block] = self.pool.allocate(1)
                    fill(index, block.block_id)
                    self.pool.register(block, parent, key)
                else:
                    self.pool.touch([block])  # out of the free queue: never evicted here
                held.append(block)
                count += 1
        finally:
            self.pool.free(list(reversed(held)))
        return count

    def uncache(self, token_ids: list[int], root=0) -> int:
        """Drop `token_ids`' cached blocks that no request holds from the prefix cache (their
        pool blocks are free for anything) -> how many were dropped."""
        count = 0
        for block in self.cached_prefix(token_ids, root):
            if block.ref_cnt:
                continue
            del self.pool.free_queue[block.block_id]
            del self.pool.cached_blocks[block.block_hash]
            block.block_hash = block.key = None
            self.pool.free_unhashed.append(block)
            count += 1
        return count

    def _block_key(self, request: Request, index: int) -> tuple:
        """(parent block's hash, this block's token ids): what the block's hash is made of.
        The first block's parent is the request's LoRA adapter id (0: the base model) and its
        `cache_salt` if any (`Request.prefix_cache_root`), so a block computed under one
        adapter or salt is never found by another, nor by the base model or unsalted requests."""
        start = index * self.block_size
        parent = request.block_hashes[index - 1] if index else request.prefix_cache_root
        return parent, tuple(request.all_token_ids[start : start + self.block_size])

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> None:
        while len(request.block_hashes) < num_blocks:
            request.block_hashes.append(hash(self._block_key(request, len(request.block_hashes))))
