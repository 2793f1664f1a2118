"""The API server's request-body cap (`nanollmserve.body_limit`, which the router shares):
larger bodies answer 413 in the OpenAI error shape before any of it is parsed."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import ASGIApp

from nanollmserve.api.errors import error_response
from nanollmserve.body_limit import BodySizeLimit, too_large_message


class BodySizeLimitMiddleware(BodySizeLimit):
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        super().__init__(app, max_bytes, _too_large)


def _too_large(max_bytes: int) -> Response:
    return error_response(413, too_large_message(max_bytes), code="request_too_large")
