"""`GET /debug/steps?since=STEP`: the engine's flight record as JSON lines (application/x-ndjson).

Mounted only with `--enable-debug-endpoints` (otherwise the path is a 404 like any unknown
one), and an admin route: served only with `--admin-api-key`, behind that key, never the API
key (`api/auth.py`; the router never forwards it). The first line describes the engine (its
configuration without its file system paths, the steps the ring holds), then one line per
kept step numbered `since` or later, in the schema of docs/features/flight-recorder.md. The
lines are built from a copy of the ring on a worker thread and streamed, so a full ring never
stalls the event loop.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from nanollmserve.api.errors import bad_request, not_found

MAX_SINCE = 2**63 - 1

router = APIRouter()


@router.get("/debug/steps", tags=["debug"], response_class=StreamingResponse)
async def debug_steps(request: Request, since: str | None = None) -> StreamingResponse:
    """The flight record from step `since` (default 0: every kept step)."""
    first = _parse_since(since)
    # API clients do not learn where the model and the stores live (hidden_paths names them).
    lines = request.app.state.ctx.engine.step_record_lines(first, hide_paths=True)
    if lines is None:
        raise not_found("the flight recorder is off (started with --step-record 0)")
    return StreamingResponse(lines, media_type="application/x-ndjson")


def _parse_since(since: str | None) -> int:
    if since is None:
        return 0
    if not (since.isascii() and since.isdigit()) or int(since) > MAX_SINCE:
        raise bad_request(
            f"since must be a step number: an integer in [0, {MAX_SINCE}], got {since[:40]!r}",
            param="since",
        )
    return int(since)
