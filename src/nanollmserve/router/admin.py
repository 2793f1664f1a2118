"""The router's admin surface and the workers' admin routes it never forwards.

A worker's admin routes (`/sleep`, `/wake_up`, `/is_sleeping`, `/debug/steps`, the run-time
LoRA routes `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`: the operator's,
behind the worker's `--admin-api-key`) answer 404 at the router, whatever key comes with
them: a client of the cluster must not put a worker picked by the policy to sleep or read
its flight record. The operator acts on a named worker through the router's own routes,
served only with the router's `--admin-api-key` (a 404 without one, a 401 without the right
one, the API key never opening them):

- `GET /admin/workers`: every worker, its health, sleep and drain state, requests in flight.
- `POST /admin/workers/sleep?url=URL&level=1|2&mode=wait|abort`: the worker gets no new
  request from then on, and is put to sleep (its `POST /sleep`, with the workers' admin key);
  answers once it sleeps, with the worker's own answer when that is an error.
- `POST /admin/workers/wake_up?url=URL`: wakes it (its `POST /wake_up`); back in the rotation.
- `POST /admin/workers/drain?url=URL`: no new request goes to it (those in flight finish;
  `num_in_flight` in the answer and in `GET /admin/workers` says when none is left);
  `POST /admin/workers/undrain?url=URL` puts it back.

A worker asleep is also seen by the health checks (`"status": "sleeping"` in its /health),
so one put to sleep on its own port leaves the rotation too.
"""

from __future__ import annotations

import hmac

import httpx
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from nanollmserve.router.errors import error_response
from nanollmserve.router.workers import Worker, WorkerPool, normalize_url

ADMIN_PREFIX = "/admin"
WORKER_ADMIN_PATHS = frozenset(
    {"/sleep", "/wake_up", "/is_sleeping", "/debug/steps"}
    | {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    | {"/load_lora_adapter", "/unload_lora_adapter"}
)
"""A worker's admin routes (api/auth.py's ADMIN_PATHS): never forwarded."""
SLEEP_LEVELS = ("1", "2")
SLEEP_MODES = ("wait", "abort")
SLEEP_TIMEOUT_S = 600.0
"""How long a worker's /sleep (mode=wait: until its requests finish) or /wake_up may take."""

router = APIRouter()


def is_worker_admin_path(path: str) -> bool:
    """`path` is (or, with a trailing slash or below /debug/, leads to) a worker's admin
    route."""
    path = path.rstrip("/") or "/"
    return path in WORKER_ADMIN_PATHS or path.startswith("/debug/") or path == "/debug"


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def not_forwarded(path: str) -> Response:
    return error_response(
        404,
        f"{path} is a worker's admin route, which the router never forwards: use the "
        "router's own /admin/workers routes (with its --admin-api-key)",
        "not_found",
    )


class RouterAdminKeyMiddleware:
    """The router's /admin routes: 404 without `--admin-api-key`, 401 without that key on
    the request (Bearer or x-api-key, compared in constant time); other paths pass."""

    def __init__(self, app: ASGIApp, admin_api_key: str | None) -> None:
        self.app = app
        self.admin_api_key = admin_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_admin_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        if not self.admin_api_key:
            response = error_response(
                404,
                "the router's admin routes are off: start it with --admin-api-key "
                "(or $NANOLLMSERVE_ADMIN_API_KEY)",
                "not_found",
            )
        elif not _key_matches(scope, self.admin_api_key):
            response = error_response(
                401,
                "Invalid or missing admin API key: this is an admin route; send "
                "'Authorization: Bearer <admin key>' (the --admin-api-key, not the API key).",
                "invalid_admin_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


def _key_matches(scope: Scope, key: str) -> bool:
    headers = dict(scope["headers"])
    bearer = hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {key}".encode())
    x_api_key = hmac.compare_digest(headers.get(b"x-api-key", b""), key.encode())
    return bearer or x_api_key


def describe(worker: Worker) -> dict:
    return {
        "url": worker.url,
        "is_healthy": worker.is_healthy,
        "is_sleeping": worker.is_sleeping,
        "is_draining": worker.is_draining,
        "is_serving": worker.is_serving,
        "kv_role": worker.kv_role,
        "num_in_flight": worker.num_in_flight,
    }


def _query(request: Request, name: str, default: str | None = None) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise _Refused(error_response(400, f"{name} given {len(values)} times", param=name))
    return values[0] if values else default


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def _worker(request: Request) -> Worker:
    pool: WorkerPool = request.app.state.pool
    url = _query(request, "url")
    if url is None or not url.strip():
        raise _Refused(error_response(400, "url (the worker's URL) is required", param="url"))
    worker = pool.get(url) if len(url) <= 2048 else None
    if worker is None:
        shown = normalize_url(url[:200])
        raise _Refused(error_response(404, f"no worker {shown!r} in this router", "not_found"))
    return worker


@router.get(ADMIN_PREFIX + "/workers")
async def list_workers(request: Request) -> JSONResponse:
    pool: WorkerPool = request.app.state.pool
    return JSONResponse({"workers": [describe(worker) for worker in pool.all()]})


@router.post(ADMIN_PREFIX + "/workers/sleep")
async def sleep_worker(request: Request) -> Response:
    try:
        worker = _worker(request)
        level = _query(request, "level", "1")
        mode = _query(request, "mode", "wait")
    except _Refused as refused:
        return refused.response
    if level not in SLEEP_LEVELS:
        return error_response(400, f"level must be 1 or 2, got {level[:32]!r}", param="level")
    if mode not in SLEEP_MODES:
        return error_response(400, f"mode must be wait or abort, got {mode[:32]!r}", param="mode")
    worker.sleep_call_pending = True
    was_sleeping = worker.is_sleeping
    worker.set_sleeping(True)  # no new request from now on
    try:
        answer = await _call(request, worker, "/sleep", {"level": level, "mode": mode})
    finally:
        worker.sleep_call_pending = False
        worker.sleep_epoch += 1
    if answer.status_code != 200:
        worker.set_sleeping(was_sleeping)
        return answer
    return JSONResponse(describe(worker))


@router.post(ADMIN_PREFIX + "/workers/wake_up")
async def wake_worker(request: Request) -> Response:
    try:
        worker = _worker(request)
    except _Refused as refused:
        return refused.response
    worker.sleep_call_pending = True
    try:
        answer = await _call(request, worker, "/wake_up", {})
        if answer.status_code == 200:
            worker.set_sleeping(False)
    finally:
        worker.sleep_call_pending = False
        worker.sleep_epoch += 1
    return answer if answer.status_code != 200 else JSONResponse(describe(worker))


@router.post(ADMIN_PREFIX + "/workers/drain")
async def drain_worker(request: Request) -> Response:
    return _set_draining(request, True)


@router.post(ADMIN_PREFIX + "/workers/undrain")
async def undrain_worker(request: Request) -> Response:
    return _set_draining(request, False)


def _set_draining(request: Request, draining: bool) -> Response:
    try:
        worker = _worker(request)
    except _Refused as refused:
        return refused.response
    worker.is_draining = draining
    return JSONResponse(describe(worker))


async def _call(request: Request, worker: Worker, path: str, params: dict) -> Response:
    """The worker's answer to its admin route `path`, called with the workers' admin key;
    a 502 when it cannot be reached."""
    client: httpx.AsyncClient = request.app.state.client
    key = request.app.state.settings.worker_admin_api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        answer = await client.post(
            f"{worker.url}{path}", params=params, headers=headers, timeout=SLEEP_TIMEOUT_S
        )
    except httpx.HTTPError as exc:
        message = f"the worker {worker.url} did not answer {path}: {type(exc).__name__}"
        return error_response(502, message, "worker_failed")
    if answer.status_code == 200:
        return Response(status_code=200)
    media_type = answer.headers.get("content-type", "application/json")
    return Response(answer.content, answer.status_code, media_type=media_type)
