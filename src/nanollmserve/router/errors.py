"""The router's own errors, in the OpenAI shape the workers use
(`{"error": {message, type, param, code}}`), and the SSE error event that ends a stream whose
worker failed after it started. (The router does not import `nanollmserve.api`: that package
loads the engine and torch, which a router process has no use for.)
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from nanollmserve.anthropic_errors import anthropic_error_body, is_messages_path


def error_body(status_code: int, message: str, code: str | None, param: str | None = None) -> dict:
    kind = "authentication_error" if status_code == 401 else "invalid_request_error"
    if status_code >= 500:
        kind = "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status_code: int,
    message: str,
    code: str | None = None,
    headers: dict | None = None,
    param: str | None = None,
) -> JSONResponse:
    body = error_body(status_code, message, code, param)
    return JSONResponse(body, status_code, headers=headers)


def is_draining_answer(status_code: int, content: bytes) -> bool:
    """A worker's 503 that says it is draining (SIGTERM; error code `draining`): the router
    takes it out of the rotation at once, without waiting for failed health checks."""
    if status_code != 503:
        return False
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "draining"


def stream_error_event(path: str, message: str, code: str) -> bytes:
    """The event that ends a broken stream: the Responses API's `event: error`, the Messages
    API's (Anthropic's shape), elsewhere a `data: {"error": ...}` chunk and `data: [DONE]`
    (what a worker sends when it fails)."""
    if is_messages_path(path):
        payload = anthropic_error_body(502, message)
        return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
    if path.rstrip("/").endswith("/responses"):
        payload = {"type": "error", "code": code, "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(payload)}\n\n".encode()
    payload = json.dumps(error_body(502, message, code))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()
