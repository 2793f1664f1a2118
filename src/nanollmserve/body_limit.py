"""A cap on the request body, shared by the API server and the router: a body larger than
`max_bytes` answers 413 before any of it is parsed, whether its Content-Length says so or a
chunked body grows past the cap (reading stops there; the rest is never buffered).

The body is read here (at most `max_bytes`), then replayed to the app; after it, the app's
`receive` reaches the client's connection again, so disconnects are still seen. The 413's
body comes from `too_large(max_bytes)`: each app answers in its own error shape (this module
imports neither the API, which loads the engine, nor the router).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_REQUEST_BYTES = 4 << 20
"""The default cap of the server and the router (`--max-request-bytes` on the router)."""


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, too_large: Callable[[int], Response]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.too_large = too_large

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self.too_large(self.max_bytes)(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self.too_large(self.max_bytes)(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


def too_large_message(max_bytes: int) -> str:
    return f"request body is larger than {max_bytes} bytes"


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
