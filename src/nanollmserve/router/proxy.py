"""Proxy: forwards one client request to a worker and the worker's answer back.

- The policy picks a worker among the healthy ones not tried yet. An attempt that fails
  before anything reached the client (no connection, a reset, a 502/503, a body cut short)
  is retried on another worker with the same bytes; the client sees nothing of it (a 503
  `draining`, a worker's SIGTERM, also takes that worker out of the rotation). When no
  worker is left, the last worker's 502/503 (or a 502/503 of the router's) is the answer.
- An SSE answer streams through chunk by chunk as the worker sends it, never buffered; a
  worker that fails mid-stream ends the stream with an error event (`errors.py`), never a
  silent truncation. Other answers (JSON, small) are read whole first, which keeps them
  retryable until the last byte.
- A client that goes away closes the upstream request at once, streaming or not, so the
  worker aborts it and frees its KV blocks (`collect_final` / `SSEResponse` on its side).
- The worker gets exactly the path the router authorized, ASGI's `scope["path"]` (re-quoted)
  and query string: `request.url` is rebuilt from the Host header in some Starlette versions,
  where `Host: x/v1/completions?` once turned an open path into another one.
- Under `--policy pd`, phase 1 of a generation request runs first (`pd.py`: a prefill
  worker fills the shared store), then this same path forwards phase 2 to the workers the
  policy `serves` (decode and both roles).
- With tracing on (`--otlp-traces-endpoint`), each attempt is a CLIENT span under the
  router's span of the request, and its context replaces the client's `traceparent` in
  what the worker gets, so the worker's span joins the same trace below it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from nanollmserve.router.errors import error_response, is_draining_answer, stream_error_event
from nanollmserve.router.metrics import RouterMetrics
from nanollmserve.router.workers import Worker, WorkerPool
from nanollmserve.tracing.context import current_request_span

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
    }
)
RETRY_STATUSES = frozenset({502, 503})
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody receives it


class ClientGone(Exception):
    """The client disconnected while the router waited on a worker."""


@dataclass
class Failure:
    """An attempt that failed before anything reached the client."""

    reason: str
    response: Response | None = None
    """The worker's own 502/503, answered if no other worker can take the request."""


class Proxy:
    def __init__(
        self,
        pool: WorkerPool,
        policy,
        client: httpx.AsyncClient,
        metrics: RouterMetrics,
        worker_api_key: str | None = None,
        prefill_phase=None,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self.worker_api_key = worker_api_key
        self.prefill_phase = prefill_phase
        """`pd.PrefillPhase` under `--policy pd`, else None."""

    def upstream_headers(self, request: Request) -> dict[str, str]:
        """The client's headers for the worker: hop-by-hop ones dropped, and with
        `--worker-api-key` the worker's key instead of the client's (either header)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if self.worker_api_key:
            headers.pop("x-api-key", None)
            headers["authorization"] = f"Bearer {self.worker_api_key}"
        return headers

    async def forward(
        self, request: Request, body: bytes, key: str | None, pinned: Worker | None = None
    ) -> Response:
        """The answer to `request`: from the worker the policy picks for `key` (or `pinned`,
        the only one that may answer it), retried on others while nothing was sent."""
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            if pinned is None and self.prefill_phase is not None:
                body = await self.prefill_phase.run(self, request, body, key, gone)
                if isinstance(body, Response):  # the client's answer already (a 4xx)
                    return body
            return await self._forward(request, body, key, pinned, gone)
        finally:
            gone.cancel()

    async def _forward(self, request, body, key, pinned, gone) -> Response:
        tried: set[Worker] = set()
        failure: Failure | None = None
        failed_worker: Worker | None = None
        while True:
            pool = [pinned] if pinned is not None else self.serving_workers()
            candidates = [worker for worker in pool if worker not in tried]
            if not candidates:
                break
            worker = self.policy.choose(candidates, key)
            if failed_worker is not None:  # it failed; this one takes the request over
                self.metrics.retries.labels(failed_worker.url).inc()
                failed_worker.num_retried += 1
            tried.add(worker)
            outcome = await self._attempt(worker, request, body, gone)
            if not isinstance(outcome, Failure):
                return outcome
            failure, failed_worker = outcome, worker
            worker.num_failed += 1
            self.metrics.failures.labels(worker.url).inc()
        if failure is not None and failure.response is not None:
            return failure.response
        if failure is not None:
            return error_response(
                502, f"no worker could answer the request: {failure.reason}", "worker_failed"
            )
        what = "worker" if self.policy.prefill is None else "decode (or both) worker"
        asleep = sum(w.is_healthy and w.is_sleeping for w in self.pool.all())
        note = f" ({asleep} asleep)" if asleep else ""
        return error_response(
            503, f"no healthy {what}{note}", "no_healthy_worker", headers={"Retry-After": "1"}
        )

    def serving_workers(self) -> list[Worker]:
        return [worker for worker in self.pool.serving() if self.policy.serves(worker)]

    async def _attempt(self, worker: Worker, request: Request, body: bytes, gone) -> object:
        """A Response for the client, or a Failure that another worker may retry."""
        url = f"{worker.url}{forwarded_path(request)}"
        headers = self.upstream_headers(request)
        span = attempt_span(worker, request, url, headers)
        upstream = self.client.build_request(request.method, url, headers=headers, content=body)
        worker.num_in_flight += 1
        worker.num_routed += 1
        self.metrics.requests.labels(worker.url).inc()
        response: httpx.Response | None = None
        handed_over = False
        start = time.perf_counter()
        try:
            response = await unless_gone(self.client.send(upstream, stream=True), gone)
            self.metrics.upstream_latency.labels(worker.url).observe(time.perf_counter() - start)
            if span is not None:
                span.set_http_status(response.status_code)
            headers = response_headers(response)
            if response.status_code in RETRY_STATUSES:
                content = await unless_gone(response.aread(), gone)
                if is_draining_answer(response.status_code, content):
                    worker.mark_down("it is draining")
                answer = Response(content, response.status_code, headers=headers)
                return Failure(f"{worker.url} answered {response.status_code}", answer)
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                handed_over = True
                relay = self._relay(worker, response, request.scope["path"], span)
                return StreamingResponse(relay, response.status_code, headers=headers)
            content = await unless_gone(response.aread(), gone)
            return Response(content, response.status_code, headers=headers)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except httpx.TransportError as exc:
            reason = f"{worker.url}: {type(exc).__name__}"
            worker.mark_down(f"a request failed ({type(exc).__name__})")
            if span is not None:
                span.fail(exc)
            return Failure(reason)
        finally:
            if not handed_over:
                worker.num_in_flight -= 1
                if response is not None:
                    await close_response(response)
                if span is not None:
                    span.end()

    async def _relay(
        self, worker: Worker, response: httpx.Response, path: str, span=None
    ) -> AsyncIterator[bytes]:
        """The worker's stream as it comes; cancelled (and the upstream closed) when the
        client goes away; an error event if the worker fails mid-stream."""
        tail = b""
        try:
            async for chunk in response.aiter_bytes():
                tail = (tail + chunk)[-2:]
                yield chunk
        except httpx.TransportError as exc:
            worker.num_failed += 1
            self.metrics.failures.labels(worker.url).inc()
            worker.mark_down(f"a stream was cut ({type(exc).__name__})")
            if span is not None:
                span.fail(exc)
            separator = b"" if tail in (b"", b"\n\n") else b"\n\n"
            message = f"the worker failed during the stream ({type(exc).__name__})"
            yield separator + stream_error_event(path, message, "worker_failed")
        finally:
            worker.num_in_flight -= 1
            await close_response(response)
            if span is not None:
                span.end()


def attempt_span(worker: Worker, request: Request, url: str, headers: dict[str, str]):
    """The CLIENT span of one attempt, its context put in `headers` for the worker; None
    with tracing off."""
    parent = current_request_span()
    if parent is None:
        return None
    span = parent.child(
        f"{request.method} {request.scope['path']}",
        attributes={"url.full": url, "nanollmserve.router.worker": worker.url},
    )
    parent.set_attributes({"nanollmserve.router.worker": worker.url})
    span.inject(headers)
    return span


def forwarded_path(request: Request) -> str:
    """The path (and query) for the worker: the decoded ASGI path the router matched and
    authorized, quoted again so the worker decodes it to the same string (dot segments too,
    which httpx would otherwise resolve)."""
    segments = request.scope["path"].split("/")
    path = "/".join(
        seg.replace(".", "%2E") if seg in (".", "..") else urllib.parse.quote(seg, safe="")
        for seg in segments
    )
    query = request.scope.get("query_string", b"").decode("latin-1")
    return f"{path}?{query}" if query else path


def response_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP}


async def close_response(response: httpx.Response) -> None:
    """Close the upstream response even while being cancelled (the client went away): that
    closes the worker's connection, which aborts the request there."""
    with anyio.CancelScope(shield=True):
        await response.aclose()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_gone(awaitable: Awaitable, gone: asyncio.Future):
    """`awaitable`'s result, or ClientGone (and `awaitable` cancelled) if the client leaves
    first."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone
