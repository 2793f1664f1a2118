"""Server-sent events framing: `data: {...}\\n\\n` chunks, optional `event:` names (the
Responses API), `data: [DONE]`, and the StreamingResponse that carries them.

A client that disconnects cancels the body iterator (Starlette watches for it), and the
iterators' `finally` blocks abort their engine requests. The response also aborts them when
it ends for any reason, so even a client gone before the first chunk frees its blocks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from nanollmserve.api.errors import stream_error_payload
from nanollmserve.frontend.async_engine import RequestStream

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | str, event: str | None = None) -> str:
    """One event: a protocol model (serialized) or a JSON string."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {data}\n\n"


def sse_error(exc: BaseException, event: str | None = None) -> str:
    """An error that happens after the stream started (the status is already 200)."""
    return sse_event(stream_error_payload(exc), event)


class SSEResponse(StreamingResponse):
    def __init__(self, body: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self.streams:
                stream.abort()  # a no-op for finished ones


def sse_response(body: AsyncIterator[str], streams: list[RequestStream]) -> SSEResponse:
    """Stream `body`; the engine requests in `streams` end when the response does."""
    return SSEResponse(body, streams)
