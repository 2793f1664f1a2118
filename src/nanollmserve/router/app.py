"""`create_router_app(pool, settings)`: the router's FastAPI app.

Its own routes: `GET /health` (200 while at least one worker can take a request, else 503;
under `--policy pd` a prefill-only worker cannot), `GET /ready` (the same, and 503 `draining`
once the router drains on SIGTERM: every other request then answers 503 `draining` too,
`DrainGate`), `GET /live` (200 while it serves HTTP),
`GET /stats` (`stats.py`), `GET /metrics` (`metrics.py`) and `GET /v1/models` (the workers'
models, merged). Stored responses (`/v1/responses/{id}`, `previous_response_id`) go to the
worker that holds them (`response_locator.py`). Every other path and method is forwarded by
the proxy to the worker the policy picks (`/v1/*`, `/generate`, `/batch_generate`,
`/tokenize`, `/detokenize`, the Messages API's `/v1/messages` and
`/v1/messages/count_tokens`, the paths without `/v1`, the playground page); under
`--policy pd` a completion first has its prefill done by a prefill worker (`pd.py`). The
health checker runs for the app's lifetime; the first round of checks ends before it serves.
A body over `max_request_bytes` answers 413 before it is read whole (`body_limit.py`, the
workers' own cap); with an API key, it is checked first (`auth.py`). With a tracer, each
forwarded generation request is a span (`nanollmserve.tracing`), the parent of the worker's.
The workers' admin routes (`/sleep`, `/wake_up`, `/is_sleeping`, `/debug/steps`) are never
forwarded (404); the router's own admin surface (`/admin/workers...`, `admin.py`, behind
`--admin-api-key`) sleeps, wakes and drains a named worker. A worker asleep or drained gets
no request; `/health` counts the workers that can take one (503 when none can).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from nanollmserve import __version__
from nanollmserve.anthropic_errors import AnthropicErrorShape
from nanollmserve.body_limit import MAX_REQUEST_BYTES, BodySizeLimit, too_large_message
from nanollmserve.router.admin import (
    RouterAdminKeyMiddleware,
    is_admin_path,
    is_worker_admin_path,
    not_forwarded,
)
from nanollmserve.router.admin import router as admin_router
from nanollmserve.router.auth import RouterAPIKeyMiddleware
from nanollmserve.router.errors import error_response
from nanollmserve.router.health import DEFAULT_INTERVAL_S, DEFAULT_MAX_FAILURES, HealthChecker
from nanollmserve.router.metrics import CONTENT_TYPE_LATEST, RouterMetrics
from nanollmserve.router.pd import DEFAULT_PREFILL_TIMEOUT_S, PrefillPhase
from nanollmserve.router.policies import DEFAULT_LOAD_BOUND_FACTOR, make_policy
from nanollmserve.router.proxy import Proxy
from nanollmserve.router.response_locator import ResponseLocator
from nanollmserve.router.routing_key import DEFAULT_PREFIX_CHARS, routing_key
from nanollmserve.router.stats import cluster_stats
from nanollmserve.router.workers import WorkerPool

__all__ = ["RouterSettings", "create_router_app"]

RESPONSES_PATHS = ("/v1/responses", "/responses")


@dataclass
class RouterSettings:
    policy: str = "least_load"
    api_key: str | None = None
    """What clients of the router send."""
    worker_api_key: str | None = None
    """What the router sends to the workers (default: the client's Authorization header)."""
    health_interval: float = DEFAULT_INTERVAL_S
    health_failures: int = DEFAULT_MAX_FAILURES
    prefix_chars: int = DEFAULT_PREFIX_CHARS
    load_bound_factor: float = DEFAULT_LOAD_BOUND_FACTOR
    """prefix (and pd's phase 1): a worker takes at most this many times the mean requests in
    flight; past it the prefix goes to its next worker (`policies.py`)."""
    prefill_timeout: float = DEFAULT_PREFILL_TIMEOUT_S
    """--policy pd: seconds a prefill worker gets for phase 1 before another one tries."""
    max_request_bytes: int = MAX_REQUEST_BYTES
    """Largest request body forwarded (413 beyond), the workers' own default."""
    metrics_require_auth: bool = False
    """With an api_key, /metrics needs it too; by default scrapers read /metrics freely."""
    admin_api_key: str | None = None
    """`--admin-api-key`: what the router's admin surface (/admin/...) needs; None: off."""
    worker_admin_api_key: str | None = None
    """What the router sends to a worker's admin routes (`--worker-admin-api-key`; the
    cluster launcher makes one for router and workers)."""
    tracer: object | None = None
    """`--otlp-traces-endpoint`: the `nanollmserve.tracing.spans.Tracer` that gives each
    forwarded generation request a span, the parent of the worker's; None: tracing off."""


def create_router_app(pool: WorkerPool, settings: RouterSettings | None = None) -> FastAPI:
    settings = settings or RouterSettings()
    policy = make_policy(settings.policy, settings.load_bound_factor)
    metrics = RouterMetrics(pool)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, keepalive_expiry=2.0)
        timeout = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            app.state.client = client
            prefill = PrefillPhase(settings.prefill_timeout) if policy.prefill else None
            app.state.proxy = Proxy(
                pool, policy, client, metrics, settings.worker_api_key, prefill_phase=prefill
            )
            app.state.locator = ResponseLocator(pool, client)
            checker = HealthChecker(
                pool, client, settings.health_interval, settings.health_failures
            )
            await checker.check_all()
            task = asyncio.create_task(checker.run())
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app = FastAPI(
        title="nanollmserve router",
        version=__version__,
        lifespan=lifespan,
        openapi_url=None,  # /openapi.json is the workers' (forwarded)
        docs_url=None,
        redoc_url=None,
    )
    app.state.pool = pool
    app.state.draining = False
    """Set on SIGTERM (`server.py`): new requests answer 503 `draining`, forwarded ones go on."""
    app.state.settings = settings
    app.state.metrics = metrics

    @app.get("/health")
    async def health():
        # Under --policy pd a prefill-only worker cannot answer a request by itself: it
        # counts as healthy, not as able to serve.
        serving = len(pool.serving())
        able = sum(policy.serves(w) for w in pool.serving())
        sleeping = sum(w.is_healthy and w.is_sleeping for w in pool.all())
        draining = sum(w.is_healthy and w.is_draining for w in pool.all())
        if not able:
            notes = [f"{sleeping} asleep"] if sleeping else []
            notes += [f"{draining} drained"] if draining else []
            if policy.prefill is not None:
                prefill_only = sum(not policy.serves(w) for w in pool.serving())
                notes += [f"{prefill_only} prefill-only"] if prefill_only else []
            what = "worker" if policy.prefill is None else "decode (or both) worker"
            note = f" ({', '.join(notes)})" if notes else ""
            return error_response(503, f"no healthy {what}{note}", "no_healthy_worker")
        return {
            "status": "ok",
            "num_healthy_workers": serving,
            **({"num_decode_workers": able} if policy.prefill is not None else {}),
            "num_sleeping_workers": sleeping,
            "num_draining_workers": draining,
            "num_workers": len(pool.all()),
        }

    @app.get("/ready")
    async def ready():
        # The readiness probe: /health's answer, and a 503 `draining` once the router itself
        # drains (SIGTERM, `server.py`).
        if app.state.draining:
            return error_response(503, "the router is draining (shutting down)", "draining")
        return await health()

    @app.get("/live")
    async def live():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats(request: Request):
        headers = _worker_read_headers(request, app)
        return await cluster_stats(pool, app.state.client, headers)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/models")
    async def list_models(request: Request):
        return await _merged_models(request, app)

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"])
    @app.api_route("/responses/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(response_id: str, request: Request):
        body = await request.body()
        worker = await app.state.locator.find(response_id, _worker_read_headers(request, app))
        return await app.state.proxy.forward(request, body, None, pinned=worker)

    app.include_router(admin_router)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(path: str, request: Request):
        if is_worker_admin_path(request.scope["path"]) or is_admin_path(request.scope["path"]):
            return not_forwarded(request.scope["path"][:200])
        body = await request.body()
        parsed = _json(body) if request.method == "POST" else None
        key = routing_key(parsed, settings.prefix_chars) if policy.uses_key else None
        pinned = None
        previous = parsed.get("previous_response_id") if isinstance(parsed, dict) else None
        if request.scope["path"] in RESPONSES_PATHS and isinstance(previous, str):
            headers = _worker_read_headers(request, app)
            pinned = await app.state.locator.find(previous, headers)
        return await app.state.proxy.forward(request, body, key, pinned=pinned)

    app.add_middleware(DrainGate, state=app.state)
    if settings.tracer is not None:  # innermost: only requests auth and the cap let through
        from nanollmserve.tracing.asgi import TracingMiddleware, route_name

        app.add_middleware(TracingMiddleware, tracer=settings.tracer, span_name=route_name)
    # Outermost last: auth runs before the body is read, then the size cap.
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes, too_large=_too_large)
    if settings.api_key:
        app.add_middleware(
            RouterAPIKeyMiddleware,
            api_key=settings.api_key,
            metrics_require_auth=settings.metrics_require_auth,
        )
    app.add_middleware(RouterAdminKeyMiddleware, admin_api_key=settings.admin_api_key)
    app.add_middleware(AnthropicErrorShape)  # outside auth: its 401 too
    return app


DRAIN_OPEN_PATHS = frozenset({"/health", "/ready", "/live", "/metrics", "/stats"})


class DrainGate:
    """While the router drains (`app.state.draining`), every request but the probes,
    /metrics and /stats answers 503 `draining` (with Retry-After), before the proxy."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and self.state.draining
            and scope["path"] not in DRAIN_OPEN_PATHS
        ):
            answer = error_response(
                503,
                "the router is draining (shutting down); retry on another",
                "draining",
                headers={"Retry-After": "1"},
            )
            await answer(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _too_large(max_bytes: int) -> Response:
    return error_response(413, too_large_message(max_bytes), "request_too_large")


def _worker_read_headers(request: Request, app: FastAPI) -> dict[str, str]:
    """The Authorization header the router's own calls to workers carry."""
    headers = app.state.proxy.upstream_headers(request)
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}


async def _merged_models(request: Request, app: FastAPI) -> Response:
    """Every model the healthy workers serve, each id once; a worker's error (a 401) is
    passed on when no worker answered 200."""
    client: httpx.AsyncClient = app.state.client
    headers = _worker_read_headers(request, app)
    workers = app.state.pool.healthy()
    if not workers:
        return error_response(503, "no healthy worker", "no_healthy_worker")
    answers = await asyncio.gather(
        *(client.get(f"{w.url}/v1/models", headers=headers, timeout=10.0) for w in workers),
        return_exceptions=True,
    )
    cards: dict[str, dict] = {}
    errors = []
    for answer in answers:
        if isinstance(answer, httpx.Response) and answer.status_code == 200:
            for card in answer.json().get("data", []):
                cards.setdefault(card["id"], card)
        elif isinstance(answer, httpx.Response):
            errors.append(answer)
    if not cards and errors:
        return Response(errors[0].content, errors[0].status_code, media_type="application/json")
    if not cards:
        return error_response(502, "no worker listed its models", "worker_failed")
    return JSONResponse({"object": "list", "data": list(cards.values())})


def _json(body: bytes) -> object:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None
