"""API-key authentication: with `--api-key` (or NANOLLMSERVE_API_KEY) set, every route except
/health and the playground page (`/`, `/static/app.js`, `/static/app.css`: it holds no data)
needs `Authorization: Bearer <key>` or (as Anthropic's clients send it) `x-api-key: <key>`;
anything else answers 401 in the OpenAI error shape (Anthropic's on the Messages routes).
The key is compared in constant time and never logged. `open_paths` widens the exceptions
(the app adds /metrics unless `--metrics-require-auth`).
"""

from __future__ import annotations

import hmac

from starlette._utils import get_route_path
from starlette.types import ASGIApp, Receive, Scope, Send

from nanollmserve.api.errors import error_response
from nanollmserve.api.playground import PLAYGROUND_PATHS

OPEN_PATHS = frozenset({"/health"}) | PLAYGROUND_PATHS


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_x_api_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The path under --root-path: uvicorn puts the prefix in front of scope["path"].
        if scope["type"] != "http" or get_route_path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        given, given_x_api_key = b"", b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
            elif name == b"x-api-key":
                given_x_api_key = value
        bearer_ok = hmac.compare_digest(given, self.expected)
        if not (bearer_ok or hmac.compare_digest(given_x_api_key, self.expected_x_api_key)):
            response = error_response(
                401,
                "Invalid or missing API key: send 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
