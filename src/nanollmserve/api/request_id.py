"""RequestIdEchoMiddleware: a request's `X-Request-Id` header comes back in its response's
(errors and streams included), so a client can match answers to what it sent.

The id is the client's label only: the engine's request ids are always the server's own
(`random_id`), and the id is logged quoted (`request_log.py`), so nothing a client puts
in it reaches the engine's keys or forges a log line.
"""

from __future__ import annotations

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanollmserve.api.request_log import REQUEST_ID_HEADER


class RequestIdEchoMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_id = Headers(scope=scope).get(REQUEST_ID_HEADER) if scope["type"] == "http" else None
        if client_id is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = client_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def client_request_id(headers) -> str | None:
    """The client's id of a request (its `X-Request-Id` header), None without one."""
    return headers.get(REQUEST_ID_HEADER)
