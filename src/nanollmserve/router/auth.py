"""The router's API key: with `--api-key`, every route but the probes (/health, /ready,
/live), /metrics (unless `--metrics-require-auth`) and the playground page needs
`Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients send it);
anything else answers 401 in the OpenAI error shape (Anthropic's on the Messages routes).
The key is compared in constant time
and never logged. The router's admin routes (`/admin/...`) are left to their own key
(`admin.py`). The check reads the ASGI `scope["path"]`, the path the proxy forwards
(`forwarded_path`), never one rebuilt from the Host header. (The workers' own check,
`api/auth.py`, lives in a package that loads the engine; the router does not.)
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from nanollmserve.router.errors import error_response

# The playground page (served by a worker through the router) holds no data, as on a worker
# (api/auth.py; not imported: the api package loads the engine).
PLAYGROUND_PATHS = frozenset({"/", "/static/app.js", "/static/app.css", "/static/timeline.js"})
OPEN_PATHS = frozenset({"/health", "/ready", "/live"}) | PLAYGROUND_PATHS
METRICS_PATH = "/metrics"


class RouterAPIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, metrics_require_auth: bool = False) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_x_api_key = api_key.encode()
        self.open_paths = OPEN_PATHS if metrics_require_auth else OPEN_PATHS | {METRICS_PATH}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # /admin/...: the admin key's (admin.py), never this one.
        path = scope["path"] if scope["type"] == "http" else ""
        admin = path == "/admin" or path.startswith("/admin/")
        if scope["type"] != "http" or path in self.open_paths or admin:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given, given_x_api_key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
        bearer_ok = hmac.compare_digest(given, self.expected)
        if not (bearer_ok or hmac.compare_digest(given_x_api_key, self.expected_x_api_key)):
            response = error_response(
                401,
                "Invalid or missing API key: send 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'.",
                "invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
