"""`--otlp-traces-endpoint URL`, the tracing flag of `serve`, `router` and `cluster` (vLLM's
name), and the Tracer it makes. OpenTelemetry's own `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
turns tracing on too when the flag is not given (and, for `serve`, so does
`NANOLLMSERVE_OTLP_TRACES_ENDPOINT`, as for every serve flag).
"""

from __future__ import annotations

import argparse
import os

OTEL_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


def add_tracing_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "tracing (OpenTelemetry; needs pip install 'nanollmserve[otel]')"
    )
    group.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export one span per request (GenAI attributes; a client's traceparent is "
        "honoured) over OTLP to this collector URL, e.g. http://localhost:4318/v1/traces "
        f"(default: ${OTEL_ENDPOINT_ENV}, else off; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc "
        "for OTLP/gRPC)",
    )


def traces_endpoint(args: argparse.Namespace) -> str | None:
    """The collector URL the flags and the environment name; None: tracing off."""
    return args.otlp_traces_endpoint or os.environ.get(OTEL_ENDPOINT_ENV) or None


def tracer_from_args(args: argparse.Namespace, service_name: str):
    """The Tracer of `--otlp-traces-endpoint` (None without one); a bad URL or missing
    packages fail here, as one line, before anything starts."""
    endpoint = traces_endpoint(args)
    if endpoint is None:
        return None
    from nanollmserve.tracing.exporter import tracer_for_endpoint

    return tracer_for_endpoint(endpoint, service_name)
