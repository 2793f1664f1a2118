"""API-key authentication: with `--api-key` (or NANOLLMSERVE_API_KEY) set, every route except
the probes (/health, /ready, /live) and the playground page (`/`, `/static/app.js`,
`/static/app.css`: it holds no data) needs `Authorization: Bearer <key>` or (as Anthropic's
clients send it) `x-api-key: <key>`; anything else answers 401 in the OpenAI error shape
(Anthropic's on the Messages routes). The key is compared in constant time and never logged.
`open_paths` widens the exceptions
(the app adds /metrics unless `--metrics-require-auth`).

The admin routes (`ADMIN_PATHS`: the sleep routes, `/debug/steps` and the run-time LoRA
routes, which load a directory of the server's) are the operator's, not
the clients': `AdminKeyMiddleware` serves them only with `--admin-api-key` (or
NANOLLMSERVE_ADMIN_API_KEY) set, a 404 otherwise as if they did not exist, and checks that
key on them in the same two headers (a 401 in the OpenAI error shape when it is missing or
wrong). The inference key never opens them; the API-key check leaves them to this one.
llama.cpp's slot actions (`POST /slots/{id}`, which write and read files of
`--slot-save-path`) are client routes behind the API key, as on llama.cpp, unless the server
has an admin key: then they are the operator's, behind the admin key alone.
"""

from __future__ import annotations

import hmac
import re

from starlette._utils import get_route_path
from starlette.types import ASGIApp, Receive, Scope, Send

from nanollmserve.api.errors import error_response
from nanollmserve.api.playground import PLAYGROUND_PATHS

OPEN_PATHS = frozenset({"/health", "/ready", "/live"}) | PLAYGROUND_PATHS
ADMIN_ROUTE_FLAGS = {
    "/sleep": "--enable-sleep-mode",
    "/wake_up": "--enable-sleep-mode",
    "/is_sleeping": "--enable-sleep-mode",
    "/debug/steps": "--enable-debug-endpoints",
    "/v1/load_lora_adapter": "--allow-runtime-lora-updating",
    "/v1/unload_lora_adapter": "--allow-runtime-lora-updating",
    "/load_lora_adapter": "--allow-runtime-lora-updating",
    "/unload_lora_adapter": "--allow-runtime-lora-updating",
}
"""Each admin route and the flag that mounts it."""
ADMIN_PATHS = frozenset(ADMIN_ROUTE_FLAGS)
"""Operator routes: behind `--admin-api-key`, never the inference key (docs/SECURITY.md)."""
ADMIN_KEY_FLAG = "--admin-api-key"
_SLOT_ACTION = re.compile(r"/slots/[^/]+/?")
"""llama.cpp's slot actions: admin routes when the server has an admin key."""


def is_slot_action(path: str) -> bool:
    return _SLOT_ACTION.fullmatch(path) is not None


def _given_keys(scope: Scope) -> tuple[bytes, bytes]:
    """The Authorization and x-api-key headers of a request (empty when absent)."""
    given, given_x_api_key = b"", b""
    for name, value in scope["headers"]:
        if name == b"authorization":
            given = value
        elif name == b"x-api-key":
            given_x_api_key = value
    return given, given_x_api_key


def key_matches(scope: Scope, key: str) -> bool:
    """The request carries `key` as a Bearer token or in x-api-key (constant time)."""
    given, given_x_api_key = _given_keys(scope)
    bearer_ok = hmac.compare_digest(given, f"Bearer {key}".encode())
    return hmac.compare_digest(given_x_api_key, key.encode()) or bearer_ok


def is_admin_path(path: str) -> bool:
    """`path` names an admin route (a trailing slash, redirected by Starlette, included)."""
    return (path.rstrip("/") or "/") in ADMIN_PATHS


class APIKeyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        open_paths: frozenset[str] = OPEN_PATHS,
        admin_slot_actions: bool = False,
    ):
        """`admin_slot_actions`: the server has an admin key, which alone opens the slot
        actions (the admin middleware checks it)."""
        self.app = app
        self.admin_slot_actions = admin_slot_actions
        self.expected = f"Bearer {api_key}".encode()
        self.expected_x_api_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The path under --root-path: uvicorn puts the prefix in front of scope["path"].
        path = get_route_path(scope) if scope["type"] == "http" else ""
        if (
            scope["type"] != "http"
            or path in self.open_paths
            or is_admin_path(path)
            or (self.admin_slot_actions and is_slot_action(path))
        ):
            await self.app(scope, receive, send)
            return
        given, given_x_api_key = _given_keys(scope)
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


class AdminKeyMiddleware:
    """The admin routes: a 404 without an admin key configured, a 401 without the right one
    on the request; the slot actions: a 401 without it when one is configured; every other
    path passes untouched."""

    def __init__(self, app: ASGIApp, admin_api_key: str | None) -> None:
        self.app = app
        self.admin_api_key = admin_api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = get_route_path(scope) if scope["type"] == "http" else ""
        slot_action = bool(self.admin_api_key) and is_slot_action(path)
        if scope["type"] != "http" or not (is_admin_path(path) or slot_action):
            await self.app(scope, receive, send)
            return
        if not self.admin_api_key:
            flag = ADMIN_ROUTE_FLAGS[path.rstrip("/")]
            response = error_response(
                404,
                f"{path.rstrip('/')} is an admin route, off on this server: it needs {flag} "
                f"and {ADMIN_KEY_FLAG} (or $NANOLLMSERVE_ADMIN_API_KEY)",
                code="not_found",
            )
        elif not key_matches(scope, self.admin_api_key):
            response = error_response(
                401,
                "Invalid or missing admin API key: this is an admin route; send "
                "'Authorization: Bearer <admin key>' (the --admin-api-key, not the API key).",
                code="invalid_admin_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)
