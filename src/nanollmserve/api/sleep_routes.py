"""Sleep mode over HTTP, vLLM's routes: `POST /sleep?level=1|2`, `POST /wake_up` and
`GET /is_sleeping` (docs/features/sleep-mode.md).

They are off unless the server runs with `--enable-sleep-mode` (a 404 then; vLLM mounts them
only in its dev mode) and are admin routes: served only with `--admin-api-key`, behind that
key, never the API key (`api/auth.py`); the router never forwards them.
`/sleep` answers once the engine sleeps: after the requests in flight have finished
(`mode=wait`, the default) or after ending them (`mode=abort`); meanwhile and until
`/wake_up`, requests get a 503 with `Retry-After`. `level` and `mode` are checked here (a 400
naming the parameter); a level this engine cannot sleep at (2 with LoRA or a draft model) is
a 400 too. vLLM answers both POSTs with an empty 200; so does this.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from nanollmserve.api.errors import bad_request, not_found
from nanollmserve.api.protocol_base import OpenAIBaseModel
from nanollmserve.api.serving import ServerContext
from nanollmserve.errors import UserError

SLEEP_LEVELS = {"1": 1, "2": 2}
SLEEP_MODES = ("wait", "abort")

router = APIRouter(tags=["sleep"])


class IsSleepingResponse(OpenAIBaseModel):
    is_sleeping: bool


def _context(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    if not ctx.engine.config.enable_sleep_mode:
        raise not_found("sleep mode is off (start the server with --enable-sleep-mode)")
    return ctx


def _query(request: Request, name: str, default: str) -> str:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise bad_request(f"{name} given {len(values)} times", name)
    return values[0] if values else default


@router.post("/sleep")
async def sleep(request: Request) -> Response:
    """Free the KV cache (level 1) and the weights (level 2) until `POST /wake_up`."""
    ctx = _context(request)
    raw_level = _query(request, "level", "1")
    level = SLEEP_LEVELS.get(raw_level.strip())
    if level is None:
        raise bad_request(f"level must be 1 or 2, got {raw_level[:32]!r}", "level")
    mode = _query(request, "mode", "wait")
    if mode not in SLEEP_MODES:
        raise bad_request(f"mode must be wait or abort, got {mode[:32]!r}", "mode")
    try:
        await ctx.engine.sleep(level, abort=mode == "abort")
    except UserError as exc:
        raise bad_request(str(exc), "level") from None
    return Response(status_code=200)


@router.post("/wake_up")
async def wake_up(request: Request) -> Response:
    """Reallocate what /sleep freed; answers once requests are served again."""
    ctx = _context(request)
    if request.query_params.getlist("tags"):
        raise bad_request("waking only some tags is not supported: the whole engine wakes", "tags")
    await ctx.engine.wake_up()
    return Response(status_code=200)


@router.get("/is_sleeping", response_model=IsSleepingResponse)
async def is_sleeping(request: Request) -> IsSleepingResponse:
    return IsSleepingResponse(is_sleeping=_context(request).engine.is_sleeping)
