"""Anthropic's error shape on the Messages API routes, for the server and the router.

Every other route answers errors in OpenAI's shape (`{"error": {message, type, param,
code}}`); an Anthropic client reads `{"type": "error", "error": {"type", "message"}}`.
`AnthropicErrorShape` wraps the app (outside the API-key and body-size checks, so their 401
and 413 are rewritten too) and, on the Messages paths only, rewrites an OpenAI-shaped error
body into Anthropic's, keeping the status and headers; the parameter a 400 names leads its
message. A body already in Anthropic's shape (a worker's, through the router) passes as it is.
No FastAPI or engine imports: the router uses it too.
"""

from __future__ import annotations

import json

from starlette._utils import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_PATHS = frozenset(
    {"/v1/messages", "/v1/messages/count_tokens", "/messages", "/messages/count_tokens"}
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status_code: int, message: str) -> dict:
    kind = _TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_messages_path(path: str) -> bool:
    return path.rstrip("/") in MESSAGES_PATHS


class AnthropicErrorShape:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(get_route_path(scope)):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = b""

        async def reshape(message: Message) -> None:
            nonlocal start, body
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the whole body is here
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            new_body = _reshaped(start["status"], body)
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(new_body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": new_body})

        await self.app(scope, receive, reshape)


def _reshaped(status_code: int, body: bytes) -> bytes:
    try:
        payload = json.loads(body)
    except ValueError:
        return body
    if not isinstance(payload, dict) or payload.get("type") == "error":
        return body
    error = payload.get("error")
    if not isinstance(error, dict):
        return body
    message = str(error.get("message", ""))
    param = error.get("param")
    if param and not message.startswith(str(param)):
        message = f"{param}: {message}"
    return json.dumps(anthropic_error_body(status_code, message)).encode()
