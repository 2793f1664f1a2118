"""Phase 1 of a request under `--policy pd` (prefill/decode disaggregation).

A completion or chat completion with one prompt is first sent to a prefill-role worker,
chosen by prefix affinity among the prefill workers, as a one-token request with
`kv_transfer_params: {"do_remote_decode": true}`. That worker answers once every full block
of the prompt is in the store it shares with the decode workers (`--kv-offload-dir`), with
`kv_transfer_params: {remote_tokens, remote_blocks, first_token_id}` (plus `ray_blocks`, the
objects holding the blocks, under `serve --kv-transfer ray`). Phase 2 is the
client's request plus those parameters and `do_remote_prefill: true`, forwarded by the
proxy to a decode worker, which loads the blocks from the store and streams the answer.

- Phase 1 changes only what makes it one short non-streamed answer: `max_tokens` (and
  chat's `max_completion_tokens` when the client used it) 1, `stream` false, `n` 1, no
  `stream_options`, and no `min_tokens` / `best_of`, which would contradict those.
- A connection error, a timeout (`--prefill-timeout`) or a 5xx there: another prefill
  worker tries. None left (or none healthy): phase 2 goes without the parameters and the
  decode worker prefills the prompt itself; the metric
  `nanollmserve_router:pd_prefill_fallbacks_total` counts it by reason.
- A 4xx from phase 1 (a bad request) is the client's answer as it is.
- The router owns `kv_transfer_params` here: a client that sends one gets a 400 (null
  counts as left out).
- Other requests (other routes, a batch of prompts, a body that is not a JSON object) have
  no phase 1; the workers answer what is wrong with them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
from starlette.requests import Request
from starlette.responses import Response

from nanollmserve.router.errors import error_response
from nanollmserve.router.proxy import (
    CLIENT_CLOSED_REQUEST,
    ClientGone,
    attempt_span,
    forwarded_path,
    response_headers,
    unless_gone,
)
from nanollmserve.router.workers import Worker

logger = logging.getLogger("nanollmserve.router")
TWO_PHASE_PATHS = frozenset(
    {"/v1/completions", "/completions", "/v1/chat/completions", "/chat/completions"}
)
DEFAULT_PREFILL_TIMEOUT_S = 120.0
TRANSFER_FIELDS = ("remote_tokens", "remote_blocks", "first_token_id")
PHASE_ONE_DROPPED = ("stream_options", "min_tokens", "best_of")


class PhaseOneFailed(Exception):
    """This prefill worker could not do phase 1; another one may."""


class PrefillPhase:
    def __init__(self, timeout: float = DEFAULT_PREFILL_TIMEOUT_S) -> None:
        self.timeout = timeout

    async def run(self, proxy, request: Request, body: bytes, key: str | None, gone):
        """The body phase 2 sends (the client's own when there is no phase 1 or it fell
        back), or a Response that is the client's answer."""
        parsed = _json_object(body)
        path = request.scope["path"]
        if parsed is None or path not in TWO_PHASE_PATHS:
            return body
        if parsed.get("kv_transfer_params") is not None:
            return error_response(
                400,
                "kv_transfer_params is set by the router under --policy pd; leave it out",
                "invalid_kv_transfer_params",
                param="kv_transfer_params",
            )
        phase_one = phase_one_body(path, parsed)
        if phase_one is None or not proxy.serving_workers():  # no phase 2 could follow
            return body
        metrics = proxy.metrics
        tried: set[Worker] = set()
        failed_worker: Worker | None = None
        while True:
            candidates = proxy.policy.prefill_workers(proxy.pool.serving())
            candidates = [worker for worker in candidates if worker not in tried]
            if not candidates:
                break
            worker = proxy.policy.prefill.choose(candidates, key)
            if failed_worker is not None:
                metrics.retries.labels(failed_worker.url).inc()
                failed_worker.num_retried += 1
            tried.add(worker)
            try:
                answer = await self._attempt(proxy, worker, request, phase_one, gone)
            except PhaseOneFailed as exc:
                logger.warning("phase 1 failed: %s", exc)
                worker.num_failed += 1
                metrics.failures.labels(worker.url).inc()
                failed_worker = worker
                continue
            if isinstance(answer, Response):
                return answer
            remote = transfer_params(answer)
            if remote is None:
                metrics.pd_fallbacks.labels("no_transfer_params").inc()
                return body
            if remote["remote_blocks"] == 0:  # a prompt under one block: nothing to load
                return body
            phase_two = {**parsed, "kv_transfer_params": {"do_remote_prefill": True, **remote}}
            return json.dumps(phase_two).encode()
        metrics.pd_fallbacks.labels("prefill_failed" if tried else "no_prefill_worker").inc()
        return body

    async def _attempt(self, proxy, worker: Worker, request: Request, body: bytes, gone):
        """The prefill worker's JSON answer (a dict), or the client's Response (a 4xx, or
        499 when the client left); PhaseOneFailed when another worker should try."""
        url = f"{worker.url}{forwarded_path(request)}"
        headers = proxy.upstream_headers(request)
        span = attempt_span(worker, request, url, headers)
        worker.num_in_flight += 1
        worker.num_routed += 1
        proxy.metrics.requests.labels(worker.url).inc()
        start = time.perf_counter()
        try:
            send = proxy.client.post(url, content=body, headers=headers)
            response = await asyncio.wait_for(unless_gone(send, gone), self.timeout)
            if span is not None:
                span.set_http_status(response.status_code)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except TimeoutError:  # a busy worker: it stays in the rotation
            raise PhaseOneFailed(f"{worker.url}: no answer in {self.timeout:g} s") from None
        except httpx.TransportError as exc:
            worker.mark_down(f"a prefill request failed ({type(exc).__name__})")
            if span is not None:
                span.fail(exc)
            raise PhaseOneFailed(f"{worker.url}: {type(exc).__name__}") from None
        finally:
            worker.num_in_flight -= 1
            if span is not None:
                span.end()
        if response.status_code >= 500:
            raise PhaseOneFailed(f"{worker.url} answered {response.status_code}")
        if response.status_code != 200:
            return Response(
                response.content, response.status_code, headers=response_headers(response)
            )
        proxy.metrics.pd_prefill_latency.labels(worker.url).observe(time.perf_counter() - start)
        return _json_object(response.content) or {}


def phase_one_body(path: str, parsed: dict) -> bytes | None:
    """The prefill worker's request for the client's `parsed` body; None when the request
    has no phase 1 (a batch of completion prompts: the answer has one set of parameters)."""
    if "chat" not in path and not _single_prompt(parsed.get("prompt")):
        return None
    body = {name: value for name, value in parsed.items() if name not in PHASE_ONE_DROPPED}
    body.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in parsed:
        body["max_completion_tokens"] = 1
    return json.dumps(body).encode()


def transfer_params(answer: dict) -> dict | None:
    """Phase 1's `kv_transfer_params` ({remote_tokens, remote_blocks, first_token_id}, each a
    whole number >= 0, and `ray_blocks` when the workers move blocks over Ray: opaque here,
    signed by the prefill worker), or None when the answer has no usable ones."""
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        return None
    values = {name: params.get(name) for name in TRANSFER_FIELDS}
    for value in values.values():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
    if isinstance(params.get("ray_blocks"), dict):  # `--kv-transfer ray`: carried as it is
        values["ray_blocks"] = params["ray_blocks"]
    return values


def _single_prompt(prompt: object) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    return len(prompt) == 1 or all(isinstance(item, int) for item in prompt)


def _json_object(body: bytes) -> dict | None:
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
