"""HealthChecker: polls every worker's /health each `interval` seconds.

A worker that answers 200 is (back) in the rotation, with the KV role its answer names
(`"kv_role"`: prefill, decode or both; both when it names none, as before `--kv-role`),
unless its answer says `"status": "sleeping"` (put to sleep with `POST /sleep`): it stays
healthy but gets no traffic until a check sees it awake.
One that refuses the connection, or answers 503 `draining` (SIGTERM), leaves it at once;
one that fails otherwise (an error status, a timeout) leaves it after `max_failures` checks
in a row. The proxy also takes a worker out when a request to it cannot connect, is cut
before its first byte or answers 503 `draining`, without waiting for the next check.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from nanollmserve.router.errors import is_draining_answer
from nanollmserve.router.workers import KV_ROLES, Worker, WorkerPool

logger = logging.getLogger("nanollmserve.router")

DEFAULT_INTERVAL_S = 2.0
DEFAULT_MAX_FAILURES = 3


class HealthChecker:
    def __init__(
        self,
        pool: WorkerPool,
        client: httpx.AsyncClient,
        interval: float = DEFAULT_INTERVAL_S,
        max_failures: int = DEFAULT_MAX_FAILURES,
    ) -> None:
        self.pool = pool
        self.client = client
        self.interval = interval
        self.max_failures = max_failures

    async def check(self, worker: Worker) -> None:
        timeout = max(1.0, min(self.interval, 5.0))
        epoch = worker.sleep_epoch
        try:
            response = await self.client.get(f"{worker.url}/health", timeout=timeout)
        except httpx.ConnectError as exc:
            worker.num_failed_checks += 1
            worker.mark_down(f"connection refused ({exc.__class__.__name__})")
            return
        except httpx.HTTPError as exc:
            self._failed(worker, exc.__class__.__name__)
            return
        if response.status_code == 200:
            worker.mark_up(_kv_role(response))
            if not worker.sleep_call_pending and epoch == worker.sleep_epoch:  # else: the
                # admin surface's call decides (this answer may predate it)
                worker.set_sleeping(_status(response) == "sleeping")
        elif is_draining_answer(response.status_code, response.content):
            worker.mark_down("it is draining")  # at once: it admits nothing new
        else:
            self._failed(worker, f"/health answered {response.status_code}")

    def _failed(self, worker: Worker, reason: str) -> None:
        worker.num_failed_checks += 1
        if worker.num_failed_checks >= self.max_failures:
            worker.mark_down(f"{reason}, {worker.num_failed_checks} checks in a row")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(worker) for worker in self.pool.all()))

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval)


def _status(response: httpx.Response) -> str:
    try:
        status = response.json().get("status", "ok")
    except (ValueError, AttributeError):
        return "ok"
    return status if isinstance(status, str) else "ok"


def _kv_role(response: httpx.Response) -> str:
    try:
        role = response.json().get("kv_role", "both")
    except (ValueError, AttributeError):  # not JSON, or not an object
        return "both"
    return role if role in KV_ROLES else "both"
