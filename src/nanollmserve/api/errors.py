"""Every error the API returns, in OpenAI's shape: `{"error": {message, type, param, code}}`.

Only what the client can fix is a 400: an `APIError` a route raises, a `ParamError` (from
SamplingParams, the request limits, the frontend's prompt checks), which names its `param`,
and FastAPI's validation errors (its default is 422; an unknown request field is one of them,
"Unrecognized request argument supplied: foo"). Starlette's HTTP errors (404 route, 405
method) keep their status; anything else, a bare ValueError included, is a bug: a 500
`server_error` / `internal_error`, logged with its traceback. A client only ever parses one
kind of error body.
"""

from __future__ import annotations

import json
import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanollmserve.api.protocol import ErrorInfo, ErrorResponse
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import (
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    EngineSleepingError,
    EngineStepError,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1

_UNION_TAG = re.compile(r"[\[\]\-(]")


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def not_found(message: str, code: str = "not_found", param: str | None = None) -> APIError:
    return APIError(404, message, param=param, code=code)


def from_param_error(exc: ParamError, aliases: dict[str, str] | None = None) -> APIError:
    """The 400 of a ParamError; `aliases` maps a SamplingParams field to the name the
    endpoint calls it (chat: max_tokens -> max_completion_tokens), which becomes `param`."""
    param = (aliases or {}).get(exc.param, exc.param) if exc.param else None
    return bad_request(str(exc), param)


def error_response(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorInfo(message=message, type=error_type(status_code), param=param, code=code)
    )
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


def error_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code >= 500:
        return "server_error"
    return "invalid_request_error"


def error_from_exception(exc: BaseException) -> APIError:
    """Map any exception met while serving a request to the APIError a client should see."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return APIError(503, str(exc), code="overloaded", headers=headers)
    if isinstance(exc, EngineSleepingError):  # sleep mode: docs/features/sleep-mode.md
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return APIError(503, str(exc), code="engine_sleeping", headers=headers)
    if isinstance(exc, EngineDrainingError):  # SIGTERM: a router retries it elsewhere
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return APIError(503, str(exc), code="draining", headers=headers)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, ParamError):
        return from_param_error(exc)
    if isinstance(exc, EngineStepError):  # the engine loop logged the traceback
        return APIError(500, str(exc), code="engine_step_failed")
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error")


def stream_error_payload(exc: BaseException) -> str:
    """The `data:` of an SSE event reporting an error after the stream has started."""
    err = error_from_exception(exc)
    body = ErrorInfo(message=err.message, type=error_type(err.status_code), code=err.code)
    return json.dumps({"error": body.model_dump()})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(
            exc.status_code, exc.message, param=exc.param, code=exc.code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        # Drop "body" and the tags pydantic gives union members ("list[int]", "function-after").
        loc = [
            str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_TAG.search(str(p))
        ]
        if first.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", code="invalid_json")
        unknown = [e["loc"][-1] for e in errors if _is_unknown_field(e)]
        if unknown:
            names = ", ".join(str(name) for name in unknown)
            message = f"Unrecognized request argument{'s' * (len(unknown) > 1)} supplied: {names}"
            return error_response(400, message, param=str(unknown[0]), code="unknown_parameter")
        param = ".".join(loc) or None
        message = first.get("msg", "invalid request")
        if param:
            message = f"{param}: {message}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error{'s' * (len(errors) > 2)})"
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        return error_response(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(ParamError)
    async def _param_error(request: Request, exc: ParamError) -> JSONResponse:
        err = from_param_error(exc)
        return error_response(400, err.message, param=err.param, code=err.code)

    # Registered by class, so they are answered here and never re-raised to the ASGI server
    # (the catch-all below answers too, but Starlette then re-raises what it caught).
    @app.exception_handler(EngineOverloadedError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineSleepingError)
    @app.exception_handler(EngineStepError)
    async def _engine_error(request: Request, exc: Exception) -> JSONResponse:
        err = error_from_exception(exc)
        return error_response(err.status_code, err.message, code=err.code, headers=err.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        err = error_from_exception(exc)
        return error_response(err.status_code, err.message, code=err.code)


def _is_unknown_field(error: dict) -> bool:
    """A top-level field the request model does not declare (nested objects such as chat
    messages ignore unknown keys: clients echo back assistant messages with extra ones)."""
    loc = error.get("loc", ())
    return error.get("type") == "extra_forbidden" and len(loc) == 2 and loc[0] == "body"
