"""`tracer_for_endpoint(url, service_name)`: a Tracer that exports its spans over OTLP to a
collector, in batches from a background thread (a collector that is down costs dropped
spans and a log line, never a request).

The protocol is OpenTelemetry's variable `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or
`OTEL_EXPORTER_OTLP_PROTOCOL`): `http/protobuf` (the default: POST to the URL, whose path
defaults to /v1/traces) or `grpc`. The service name is `OTEL_SERVICE_NAME` if set, and
`OTEL_RESOURCE_ATTRIBUTES` adds resource attributes, as in any OpenTelemetry SDK. The
`OTEL_BSP_*` variables tune the batches (`OTEL_BSP_SCHEDULE_DELAY`, ms).
"""

from __future__ import annotations

import os
import urllib.parse

from nanollmserve.errors import UserError

EXTRA_HINT = "pip install 'nanollmserve[otel]'"
PROTOCOLS = ("http/protobuf", "grpc")


def otlp_protocol() -> str:
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol not in PROTOCOLS:
        raise UserError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: choose http/protobuf or grpc"
        )
    return protocol


def check_endpoint(url: str) -> str:
    """The URL spans go to (`/v1/traces` added to an HTTP one without a path)."""
    try:
        parsed = urllib.parse.urlsplit(url)
        valid = parsed.scheme in ("http", "https") and bool(parsed.hostname)
    except ValueError:  # e.g. an unclosed [IPv6 address
        valid = False
    if not valid:
        raise UserError(
            f"--otlp-traces-endpoint must be an http:// or https:// URL "
            f"(e.g. http://localhost:4318/v1/traces), got {url!r}"
        )
    if otlp_protocol() == "http/protobuf" and parsed.path in ("", "/"):
        return urllib.parse.urlunsplit(parsed._replace(path="/v1/traces"))
    return url


def tracer_for_endpoint(url: str, service_name: str):
    """A Tracer exporting to `url`; a UserError naming the extra when the OpenTelemetry
    packages are not installed, or for a bad URL or protocol."""
    endpoint = check_endpoint(url)
    protocol = otlp_protocol()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        from nanollmserve.tracing.spans import Tracer
    except ImportError as exc:
        raise UserError(
            f"--otlp-traces-endpoint needs the OpenTelemetry packages ({exc.name} is missing): "
            f"{EXTRA_HINT}"
        ) from None
    if protocol == "grpc":
        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    else:
        exporter = OTLPSpanExporter(endpoint=endpoint)
    return Tracer.with_exporter(exporter, os.environ.get("OTEL_SERVICE_NAME") or service_name)
