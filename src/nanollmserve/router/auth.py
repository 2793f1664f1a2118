"""The router's API key: with `--api-key`, every route but /health, /metrics and the
playground page needs `Authorization: Bearer <key>`; anything else answers 401 in the
OpenAI error shape. The key is compared in constant time and never logged. (The workers'
own check, `api/auth.py`, lives in a package that loads the engine; the router does not.)
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from nanollmserve.router.errors import error_response

# The playground page (served by a worker through the router) holds no data, as on a worker
# (api/auth.py; not imported: the api package loads the engine).
PLAYGROUND_PATHS = frozenset({"/", "/static/app.js", "/static/app.css"})
OPEN_PATHS = frozenset({"/health", "/metrics"}) | PLAYGROUND_PATHS


class RouterAPIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            response = error_response(
                401,
                "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
