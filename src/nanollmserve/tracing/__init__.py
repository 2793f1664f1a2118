"""OpenTelemetry request tracing (`--otlp-traces-endpoint URL`, docs/features/observability.md).

One span per generation request, on the worker (`serve`: HTTP and gRPC) and on the router,
exported over OTLP; a client's W3C `traceparent` is honoured and the router passes its own
context on to the worker, so one trace shows router -> worker -> engine.

- `flags.py`: the flag, shared by `serve`, `router` and `cluster`, and the Tracer it makes.
- `exporter.py`: the OTLP exporter (HTTP/protobuf or gRPC) behind a Tracer; the one place
  that says which extra to install when the packages are missing.
- `spans.py`: `Tracer` (its own TracerProvider; the engine observer that fills the spans)
  and `RequestSpan`.
- `genai.py`: the GenAI semantic-convention attributes and events of a request.
- `context.py`: the span of the request being served (a context variable) and the hook
  the admission layer calls; `asgi.py`: the middleware that opens the span per request.

Without the flag nothing here imports OpenTelemetry: `context.py`, `asgi.py` and
`flags.py` are plain Python, and `spans.py` / `exporter.py` load only when a Tracer is made.
The package imports none of api/, frontend/, engine/, so the router can use it.
"""
