"""ResponseLocator: which worker holds a stored Responses API object.

`GET/DELETE /v1/responses/{id}` and `POST /v1/responses` with `previous_response_id` must
reach the worker that stored that response: the router asks the healthy workers
(`GET /v1/responses/{id}`) and remembers the one that has it.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections import OrderedDict

import httpx

from nanollmserve.router.workers import Worker, WorkerPool

MAX_REMEMBERED = 10_000


class ResponseLocator:
    def __init__(self, pool: WorkerPool, client: httpx.AsyncClient) -> None:
        self.pool = pool
        self.client = client
        self.known: OrderedDict[str, str] = OrderedDict()  # response id -> worker URL

    async def find(self, response_id: str, headers: dict[str, str]) -> Worker | None:
        """The healthy worker that stores `response_id`, None if none does."""
        url = self.known.get(response_id)
        worker = self.pool.get(url) if url else None
        if worker is not None and worker.is_healthy:
            return worker
        candidates = self.pool.healthy()
        found = await asyncio.gather(*(self._has(w, response_id, headers) for w in candidates))
        for worker, has_it in zip(candidates, found, strict=True):
            if has_it:
                self.known[response_id] = worker.url
                while len(self.known) > MAX_REMEMBERED:
                    self.known.popitem(last=False)
                return worker
        return None

    async def _has(self, worker: Worker, response_id: str, headers: dict[str, str]) -> bool:
        try:
            response = await self.client.get(
                f"{worker.url}/v1/responses/{urllib.parse.quote(response_id, safe='')}",
                headers=headers,
                timeout=5.0,
            )
        except httpx.HTTPError:
            return False
        return response.status_code == 200
