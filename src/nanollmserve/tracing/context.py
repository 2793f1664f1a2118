"""The span of the request being served, as a context variable, and the hooks that fill it.

The middleware (`asgi.py`) or the gRPC servicer opens a `RequestSpan` around a request with
`server_span`; code below it (the admission layer, the router's proxy) finds it with
`current_request_span()`. With tracing off no span is ever set and every hook is one
`ContextVar.get()`. Plain Python: nothing here imports OpenTelemetry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanollmserve.tracing.spans import RequestSpan, Tracer

_CURRENT: ContextVar[RequestSpan | None] = ContextVar("nanollmserve_request_span", default=None)


def current_request_span() -> RequestSpan | None:
    """The span of the request this code serves; None when tracing is off."""
    return _CURRENT.get()


@contextlib.contextmanager
def server_span(
    tracer: Tracer, name: str, headers: Mapping[str, str], attributes: dict
) -> Iterator[RequestSpan]:
    """A SERVER span for the request being served, the child of the client's `traceparent`
    (in `headers`) if it sent a valid one; current inside the block, ended after it (with
    an error status if the block raised)."""
    span = tracer.start_span(name, headers=headers, attributes=attributes)
    token = _CURRENT.set(span)
    try:
        yield span
    except BaseException as exc:
        span.fail(exc)
        raise
    finally:
        with contextlib.suppress(ValueError):  # reset from another context: nothing to undo
            _CURRENT.reset(token)
        span.end()


def record_admission(request_ids: list[str], params, model: str, response_id: str) -> None:
    """The engine requests a served request became (called by the admission layer): their
    sampling parameters go on the current span, and their outputs will when they end."""
    span = _CURRENT.get()
    if span is not None:
        span.admitted(request_ids, params, model, response_id)
