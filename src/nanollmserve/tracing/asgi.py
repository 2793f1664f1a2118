"""`TracingMiddleware`: an ASGI middleware that serves each generation request (a POST to
chat, completions, responses, messages, embeddings, /generate, /batch_generate, with or
without /v1, and llama.cpp's /completion and /infill) inside a SERVER span
(`context.server_span`), ended once the response's last byte is sent (a stream's too) and
carrying its HTTP status. Other routes get no span.

The worker names its span after the GenAI operation (`chat`, renamed `chat MODEL` at
admission); the router after the route (`POST /v1/chat/completions`). Installed inside the
API key check and the body cap, so only requests those let through are traced.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanollmserve.tracing import genai
from nanollmserve.tracing.context import server_span

OPERATIONS = {
    "/chat/completions": "chat",
    "/responses": "chat",
    "/messages": "chat",
    "/completions": "text_completion",
    "/completion": "text_completion",  # llama.cpp's native routes
    "/infill": "text_completion",
    "/generate": "text_completion",
    "/batch_generate": "text_completion",
    "/embeddings": "embeddings",
}
"""Traced path (also under /v1) -> `gen_ai.operation.name`."""


def operation_of(scope: Scope) -> str | None:
    """The GenAI operation of an HTTP request, None for a route that is not traced."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path = scope["path"]
    return OPERATIONS.get(path.removeprefix("/v1") if path.startswith("/v1/") else path)


def operation_name(operation: str, scope: Scope) -> str:
    return operation


def route_name(operation: str, scope: Scope) -> str:
    return f"{scope['method']} {scope['path']}"


class TracingMiddleware:
    def __init__(
        self, app: ASGIApp, tracer, span_name: Callable[[str, Scope], str] = operation_name
    ) -> None:
        self.app = app
        self.tracer = tracer
        self.span_name = span_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        operation = operation_of(scope)
        if operation is None:
            await self.app(scope, receive, send)
            return
        attributes = {
            genai.OPERATION: operation,
            genai.PROVIDER: genai.PROVIDER_NAME,
            "http.request.method": scope["method"],
            "url.path": scope["path"],
        }
        name = self.span_name(operation, scope)
        with server_span(self.tracer, name, Headers(scope=scope), attributes) as span:

            async def send_with_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_http_status(message["status"])
                await send(message)

            await self.app(scope, receive, send_with_status)
