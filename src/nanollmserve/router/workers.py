"""The router's view of its workers: a `Worker` per URL (health, sleep, drain, KV role,
requests in flight, routed / failed / retried counts) and the `WorkerPool` the policies
choose from: `serving()`, the healthy workers neither asleep nor drained. The cluster
launcher replaces the pool's URLs when Ray restarts a worker somewhere else (`set_urls`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("nanollmserve.router")

KV_ROLES = ("prefill", "decode", "both")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
    return url


@dataclass(eq=False)
class Worker:
    url: str
    is_healthy: bool = False
    """In the rotation. A new worker joins after its first good health check."""
    num_in_flight: int = 0
    """Requests sent to it that have not ended (the least-load measure)."""
    num_routed: int = 0
    """Attempts sent to it."""
    num_failed: int = 0
    """Attempts that failed: no connection, reset, 502/503, a stream cut short."""
    num_retried: int = 0
    """Failed attempts that were then retried on another worker (the client saw nothing)."""
    num_failed_checks: int = 0
    """Health checks failed in a row."""
    kv_role: str = "both"
    """What its /health says it serves (`serve --kv-role`): prefill, decode or both (a
    worker that does not say serves both)."""
    is_sleeping: bool = False
    """Its /health says `"status": "sleeping"` (put to sleep: it answers requests 503 until
    woken), or the router's admin surface is putting it to sleep: it gets no traffic."""
    is_draining: bool = False
    """Drained through the router's admin surface: no new requests until undrained."""
    sleep_call_pending: bool = False
    """The admin surface's /sleep or /wake_up call to it is under way (health checks then
    leave `is_sleeping` alone)."""
    sleep_epoch: int = 0
    """Bumped by each admin sleep or wake: a health check begun before it (whose answer may
    predate it) leaves `is_sleeping` alone."""

    @property
    def is_serving(self) -> bool:
        """In the rotation: healthy, awake and not drained."""
        return self.is_healthy and not self.is_sleeping and not self.is_draining

    def set_sleeping(self, sleeping: bool) -> None:
        if sleeping != self.is_sleeping:
            logger.info("worker %s is %s", self.url, "asleep" if sleeping else "awake")
        self.is_sleeping = sleeping

    def mark_up(self, kv_role: str = "both") -> None:
        self.num_failed_checks = 0
        if kv_role != self.kv_role:
            logger.info("worker %s has the KV role %s", self.url, kv_role)
            self.kv_role = kv_role
        if not self.is_healthy:
            logger.info("worker %s is up", self.url)
        self.is_healthy = True

    def mark_down(self, reason: str) -> None:
        if self.is_healthy:
            logger.warning("worker %s is down: %s", self.url, reason)
        self.is_healthy = False


class WorkerPool:
    def __init__(self, urls: list[str]) -> None:
        self.workers: dict[str, Worker] = {}
        self.set_urls(urls)

    def set_urls(self, urls: list[str]) -> None:
        """Make the pool these URLs: known ones keep their state, new ones join after their
        first good health check, missing ones leave."""
        wanted = [normalize_url(url) for url in urls]
        self.workers = {url: self.workers.get(url) or Worker(url) for url in wanted}

    def all(self) -> list[Worker]:
        return list(self.workers.values())

    def healthy(self) -> list[Worker]:
        return [worker for worker in self.workers.values() if worker.is_healthy]

    def serving(self) -> list[Worker]:
        """The workers requests may go to: healthy, awake, not drained."""
        return [worker for worker in self.workers.values() if worker.is_serving]

    def get(self, url: str) -> Worker | None:
        return self.workers.get(normalize_url(url))
