"""`Tracer` and `RequestSpan`: the OpenTelemetry side of request tracing. This module imports
the OpenTelemetry SDK; it is loaded only when tracing is on (`exporter.py`, or a test that
builds a Tracer on its own exporter).

A Tracer owns a TracerProvider of its own, never the global one: FastAPI instruments itself
through the global provider, and a second span per request would only be noise. It reads
the W3C `traceparent` / `tracestate` headers (an invalid one starts a new trace, the
propagator's rule) and writes them for the router's calls to its workers.

It is also the engine observer (`AsyncEngine.add_observer`) that completes the spans: an
admitted request's engine ids map to its span, and when an engine request ends (on the
engine thread, before its consumer hears of it) its usage, finish reasons, latencies and
phase events go on that span. The map is bounded by the requests in flight: a span forgets
its ids when it ends, whether or not the engine reported them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from nanollmserve import __version__
from nanollmserve.tracing import genai

_PROPAGATOR = TraceContextTextMapPropagator()
_KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}


class Tracer:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("nanollmserve", __version__)
        self._by_request_id: dict[str, RequestSpan] = {}
        self._lock = threading.Lock()

    @classmethod
    def with_exporter(cls, exporter: SpanExporter, service_name: str, batch: bool = True) -> Tracer:
        """A Tracer whose spans go to `exporter`, in batches from a background thread (or,
        without `batch`, each as it ends: tests)."""
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        provider.add_span_processor(processor)
        return cls(provider)

    def start_span(
        self,
        name: str,
        *,
        headers: Mapping[str, str] | None = None,
        parent: RequestSpan | None = None,
        kind: str = "server",
        attributes: dict | None = None,
    ) -> RequestSpan:
        """A span, the child of `parent` or else of the trace context in `headers`."""
        if parent is not None:
            context = trace.set_span_in_context(parent.span)
        else:
            context = _PROPAGATOR.extract(dict(headers or {}))
        span = self._tracer.start_span(
            name, context=context, kind=_KINDS[kind], attributes=attributes
        )
        return RequestSpan(self, span)

    def observe(self, engine) -> None:
        """Complete the spans of `engine`'s requests (once per engine)."""
        if self not in engine.observers:
            engine.add_observer(self)

    def shutdown(self) -> None:
        """Export what is pending and stop."""
        self.provider.shutdown()

    # -- engine observer (engine thread) ------------------------------------------------------
    def on_step(self, stats) -> None:
        pass

    def on_request_finished(self, output) -> None:
        with self._lock:
            span = self._by_request_id.pop(output.request_id, None)
        if span is not None:
            span.record_output(output)

    def _watch(self, request_ids: list[str], span: RequestSpan) -> None:
        with self._lock:
            for request_id in request_ids:
                self._by_request_id[request_id] = span

    def _forget(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._by_request_id.pop(request_id, None)


class RequestSpan:
    """One span of a served request (or of the router's call to a worker)."""

    def __init__(self, tracer: Tracer, span: trace.Span) -> None:
        self.tracer = tracer
        self.span = span
        self._request_ids: list[str] = []
        self._totals = genai.RequestTotals()

    def set_attributes(self, attributes: dict) -> None:
        self.span.set_attributes(attributes)

    def admitted(self, request_ids: list[str], params, model: str, response_id: str) -> None:
        """The engine requests this request became: the sampling attributes, the GenAI span
        name (`{operation} {model}`), and their outputs once they end."""
        self.span.set_attributes(genai.request_attributes(params, model, response_id))
        operation = self.span.attributes.get(genai.OPERATION)
        if operation:
            self.span.update_name(f"{operation} {model}")
        self._request_ids += request_ids
        self.tracer._watch(request_ids, self)

    def record_output(self, output) -> None:
        """An engine request of this span ended (engine thread)."""
        if not self.span.is_recording():  # the response already ended it (a client gone)
            return
        self.span.set_attributes(self._totals.add(output))
        for name, at in genai.phase_events(output):
            attributes = {genai.ENGINE_REQUEST_ID: output.request_id}
            self.span.add_event(name, attributes, timestamp=int(at * 1e9))

    def child(self, name: str, kind: str = "client", attributes: dict | None = None):
        return self.tracer.start_span(name, parent=self, kind=kind, attributes=attributes)

    def inject(self, headers: dict[str, str]) -> None:
        """Put this span's context in `headers` (`traceparent`, replacing the client's)."""
        headers.pop("tracestate", None)
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(self.span))

    def set_http_status(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.span.set_attribute("error.type", str(status))
        if status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))

    def fail(self, exc: BaseException) -> None:
        self.span.set_attribute("error.type", type(exc).__qualname__)
        self.span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200]))

    def end(self) -> None:
        self.tracer._forget(self._request_ids)
        self.span.end()
