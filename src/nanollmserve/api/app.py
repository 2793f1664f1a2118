"""`create_app(engine, settings)`: the FastAPI app of the OpenAI-compatible server.

It wires the routes (`routes.py`) to a ServerContext, registers the Prometheus metrics
(`app.state.metrics`, an engine observer served at /metrics), installs the OpenAI-shaped
error handlers (Anthropic's shape on the Messages routes), the body-size cap, (with an API
key) authentication, the admin routes' own key (`--admin-api-key`; off without it), the
`X-Request-Id` echo, (with allowed origins) CORS, (with
`log_requests`) the request log and (with a tracer) a trace span per generation request,
and documents 400 instead of FastAPI's 422 in /openapi.json, because validation errors
answer 400 here.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.middleware.cors import CORSMiddleware

from nanollmserve import __version__
from nanollmserve.anthropic_errors import AnthropicErrorShape
from nanollmserve.api.auth import OPEN_PATHS, AdminKeyMiddleware, APIKeyMiddleware
from nanollmserve.api.body_limit import BodySizeLimitMiddleware
from nanollmserve.api.debug import router as debug_router
from nanollmserve.api.errors import install_error_handlers
from nanollmserve.api.llamacpp_routes import router as llamacpp_router
from nanollmserve.api.playground import router as playground_router
from nanollmserve.api.request_id import RequestIdEchoMiddleware
from nanollmserve.api.request_log import RequestLogger
from nanollmserve.api.routes import router
from nanollmserve.api.serving import ServerContext, ServerSettings
from nanollmserve.api.sleep_routes import router as sleep_router
from nanollmserve.frontend.async_engine import AsyncEngine
from nanollmserve.metrics import ServerMetrics

__all__ = ["ServerSettings", "create_app"]


def create_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    app = FastAPI(
        title="nanollmserve",
        version=__version__,
        description="An OpenAI-compatible LLM inference server written from scratch in Python.",
    )
    app.state.ctx = ServerContext(engine, settings)
    app.state.metrics = ServerMetrics(
        app.state.ctx.model_name, lambda: engine.stats().engine, engine.max_model_len
    )
    engine.add_observer(app.state.metrics)
    if settings.log_requests:
        engine.add_observer(RequestLogger(settings.log_prompts))
    app.include_router(router)
    app.include_router(llamacpp_router)  # llama.cpp's native API (/completion, /props, ...)
    app.include_router(playground_router)
    app.include_router(sleep_router)  # 404 unless --enable-sleep-mode
    if settings.enable_debug_endpoints:
        app.include_router(debug_router)
    install_error_handlers(app)
    if settings.tracer is not None:  # innermost: only requests auth and the cap let through
        from nanollmserve.tracing.asgi import TracingMiddleware

        settings.tracer.observe(engine)
        app.add_middleware(TracingMiddleware, tracer=settings.tracer)
    # Outermost last: auth runs before the body is read, then the size cap.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key:
        open_paths = OPEN_PATHS if settings.metrics_require_auth else OPEN_PATHS | {"/metrics"}
        app.add_middleware(
            APIKeyMiddleware,
            api_key=settings.api_key,
            open_paths=open_paths,
            admin_slot_actions=bool(settings.admin_api_key),
        )
    # The admin routes: their own key (404 without one), never the API key's (api/auth.py).
    app.add_middleware(AdminKeyMiddleware, admin_api_key=settings.admin_api_key)
    app.add_middleware(AnthropicErrorShape)  # outside auth and the size cap: their errors too
    app.add_middleware(RequestIdEchoMiddleware)  # errors of the layers inside echo it too
    if settings.allowed_origins:  # outermost: a preflight carries no key and needs no body
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=settings.allowed_methods,
            allow_headers=settings.allowed_headers,
            allow_credentials=settings.allow_credentials,
        )
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
