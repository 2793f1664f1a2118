"""The engine's numbers: what one step did (`StepStats`), the running totals (`EngineCounters`,
the one place the engine counts) and the snapshot read by /stats, metrics and logs
(`EngineStats`).

The scheduler and the KV manager count nothing: `schedule()` reports what scheduling did in
its `SchedulerOutput` (preemptions, prefix-cache lookups, blocks in use) and
`update_from_output()` what the step produced in a `StepStats`; `EngineCore` feeds both to
its `EngineCounters`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from nanollmserve.engine.kv_cache import KVCacheStats
from nanollmserve.engine.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from nanollmserve.engine.scheduler import SchedulerOutput


@dataclass
class StepStats:
    """What the latest step did: the per-step numbers of the metrics (see `metrics/`)."""

    num_scheduled_tokens: int
    """Tokens the model ran: prompt chunks plus one per decoding request."""
    inter_token_latencies: list[float] = field(default_factory=list)
    """Seconds since the previous token of each request that got a token (not its first)."""
    num_prompt_tokens: int = 0
    """Prompt tokens of the requests that produced their first token in this step."""
    num_generation_tokens: int = 0
    """Tokens sampled in this step."""
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    """Draft tokens checked and accepted in this step (speculative decoding)."""


@dataclass
class EngineStats:
    """A snapshot of the engine for /stats, metrics and logs."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache: KVCacheStats
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    """Prompt tokens of the requests that produced their first token."""
    num_generation_tokens: int
    last_step: StepStats | None = None
    """The latest step (None before the first); observers read it in `on_step`."""
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding totals (None when the engine does not speculate)."""
    remote_prefill_loaded_tokens: int = 0
    """Prompt tokens of remote-prefill requests (prefill/decode disaggregation) whose KV was
    found in the pool or read from the store."""
    remote_prefill_recomputed_tokens: int = 0
    """Prompt tokens of remote-prefill requests computed again here."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


class EngineCounters:
    """The engine's totals since start, fed by each step."""

    def __init__(self, spec_decode: bool = False) -> None:
        self.spec_decode = SpecDecodeStats() if spec_decode else None
        self.num_steps = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up (first admission of a request)
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self.peak_used_blocks = 0
        self.num_prompt_tokens = 0  # of requests that produced their first token
        self.num_generation_tokens = 0
        self.remote_prefill_loaded_tokens = 0
        self.remote_prefill_recomputed_tokens = 0
        self.last_step: StepStats | None = None

    def record_schedule(self, scheduled: SchedulerOutput) -> None:
        self.num_preemptions += scheduled.num_preempted
        self.prefix_cache_queries += scheduled.prefix_cache_queries
        self.prefix_cache_hits += scheduled.prefix_cache_hits
        self.peak_used_blocks = max(self.peak_used_blocks, scheduled.peak_used_blocks)
        self.remote_prefill_loaded_tokens += scheduled.remote_prefill_loaded
        self.remote_prefill_recomputed_tokens += scheduled.remote_prefill_recomputed

    def record_step(self, step: StepStats) -> None:
        self.num_steps += 1
        self.num_prompt_tokens += step.num_prompt_tokens
        self.num_generation_tokens += step.num_generation_tokens
        if self.spec_decode is not None:
            self.spec_decode.add(step.spec_decode)
        self.last_step = step

    def snapshot(self, running: int, waiting: int, kv_cache: KVCacheStats) -> EngineStats:
        return EngineStats(
            num_requests_running=running,
            num_requests_waiting=waiting,
            kv_cache=replace(kv_cache, peak_used_blocks=self.peak_used_blocks),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            remote_prefill_loaded_tokens=self.remote_prefill_loaded_tokens,
            remote_prefill_recomputed_tokens=self.remote_prefill_recomputed_tokens,
            last_step=self.last_step,
            spec_decode=self.spec_decode.copy() if self.spec_decode is not None else None,
        )
