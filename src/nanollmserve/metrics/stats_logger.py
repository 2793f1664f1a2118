"""StatsLogger: one log line every `interval` seconds with the engine's state and throughput.

`nanollmserve serve --log-stats-interval 10` runs it as a task on the server's event loop.
It reads the engine's stats snapshot (never the engine itself), so it costs the engine
nothing. Token rates are over the last interval; the prefix-cache hit rate is since start:

    engine stats: running=2 waiting=0 kv_usage=12.5% prompt=350.2 tok/s generation=31.0 tok/s
    prefix_cache_hit_rate=40.0%
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nanollmserve.engine.stats import EngineStats

__all__ = ["StatsLogger", "format_stats_line"]

logger = logging.getLogger("nanollmserve.stats")


def format_stats_line(previous: EngineStats | None, current: EngineStats, elapsed: float) -> str:
    """The log line for `current`, with token rates since `previous` (`elapsed` s earlier)."""

    def rate(field: str) -> float:
        if previous is None or elapsed <= 0:
            return 0.0
        return (getattr(current, field) - getattr(previous, field)) / elapsed

    return (
        f"engine stats: running={current.num_requests_running} "
        f"waiting={current.num_requests_waiting} "
        f"kv_usage={current.kv_cache.usage:.1%} "
        f"prompt={rate('num_prompt_tokens'):.1f} tok/s "
        f"generation={rate('num_generation_tokens'):.1f} tok/s "
        f"prefix_cache_hit_rate={current.prefix_cache_hit_rate:.1%}" + _spec_decode_part(current)
    )


def _spec_decode_part(stats: EngineStats) -> str:
    """Speculative decoding since start, when the engine speculates."""
    spec = stats.spec_decode
    if spec is None:
        return ""
    return (
        f" spec_decode_acceptance_rate={spec.acceptance_rate:.1%}"
        f" mean_acceptance_length={spec.mean_acceptance_length:.2f}"
    )


class StatsLogger:
    def __init__(self, stats_fn: Callable[[], EngineStats], interval: float) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self.stats_fn = stats_fn
        self.interval = interval

    async def run(self) -> None:
        """Log forever (cancel the task to stop)."""
        previous, then = self.stats_fn(), time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            current, now = self.stats_fn(), time.monotonic()
            logger.info(format_stats_line(previous, current, now - then))
            previous, then = current, now
