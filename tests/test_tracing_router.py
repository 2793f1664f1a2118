"""One trace across the router and its worker (m24), end to end: a real `nanollmserve
cluster` (router + one worker on the tiny model) started with `--otlp-traces-endpoint`
exports over OTLP/HTTP to a minimal receiver started by the test, which decodes the
protobuf with the opentelemetry-proto package. A request with the client's `traceparent`
shows up as the router's SERVER span (the client's child), its CLIENT span to the worker,
and the worker's GenAI span below that, all in the client's trace; a request without one
gets a fresh trace that still spans both processes.
"""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cluster_process import (
    WORKER_ARGS,
    ClusterProcess,
    free_consecutive_ports,
    tiny_model_dir,
    wait_until,
)
from live_server import free_port
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

pytestmark = [pytest.mark.milestone("m24"), pytest.mark.timeout(300)]

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
SERVER, CLIENT = 2, 3  # OTLP's Span.SpanKind values


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    """A collector stand-in: POST /v1/traces (OTLP/HTTP protobuf) -> `spans`, as dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    found.append(
                        {
                            "service": resource.get("service.name"),
                            "name": span.name,
                            "kind": span.kind,
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "events": [event.name for event in span.events],
                        }
                    )
        with self.lock:
            self.spans += found

    def received(self) -> list[dict]:
        with self.lock:
            return list(self.spans)

    def trace(self, trace_id: str) -> list[dict]:
        return [span for span in self.received() if span["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def traced_cluster():
    receiver = OtlpReceiver()
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: export batches at once
    base_port, router_port = free_consecutive_ports(1), free_port()
    cluster = ClusterProcess.start(
        "cluster",
        router_port,
        "--workers",
        "1",
        "--base-port",
        str(base_port),
        "--router-port",
        str(router_port),
        "--health-interval",
        "0.5",
        "--shutdown-timeout",
        "5",
        "--otlp-traces-endpoint",
        receiver.url,
        str(tiny_model_dir()),
        *WORKER_ARGS,
        num_workers=1,
    )
    monkeypatch.undo()
    yield cluster, receiver
    cluster.stop()
    receiver.close()


def _three_spans(receiver: OtlpReceiver, trace_id: str) -> dict[str, dict]:
    """The router's, its call's and the worker's span of one trace, once all arrived."""

    def arrived():
        spans = receiver.trace(trace_id)
        router = [s for s in spans if s["service"] == "nanollmserve-router"]
        worker = [s for s in spans if s["service"] == "nanollmserve"]
        return len(router) == 2 and len(worker) == 1 and (router, worker)

    router, [worker] = wait_until(arrived, 60, f"the spans of trace {trace_id}")
    [server] = [s for s in router if s["kind"] == SERVER]
    [call] = [s for s in router if s["kind"] == CLIENT]
    return {"router": server, "call": call, "worker": worker}


def test_one_trace_shows_router_then_worker_from_the_clients_parent(traced_cluster, compat) -> None:
    cluster, receiver = traced_cluster
    chat = cluster.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0,
        extra_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
    )
    spans = _three_spans(receiver, TRACE_ID)
    router, call, worker = spans["router"], spans["call"], spans["worker"]
    assert router["parent_id"] == PARENT_ID
    assert router["name"] == "POST /v1/chat/completions"
    assert call["parent_id"] == router["span_id"]
    assert worker["parent_id"] == call["span_id"] and worker["kind"] == SERVER
    assert worker["name"] == "chat tiny"
    assert call["attributes"]["nanollmserve.router.worker"].startswith("http://127.0.0.1:")
    assert router["attributes"]["http.response.status_code"] == 200
    attributes = worker["attributes"]
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.request.max_tokens"] == 4
    assert attributes["gen_ai.response.id"] == chat.id
    assert attributes["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
    assert worker["events"] == ["queued", "scheduled", "first_token", "finished"]
    compat.exercised("tracing", spans=len(spans))
    compat.exercised("router", routed=sum(w["num_routed"] for w in cluster.stats()["workers"]))


def test_a_streamed_request_without_traceparent_gets_one_trace_across_both(
    traced_cluster,
) -> None:
    cluster, receiver = traced_cluster
    stream = cluster.openai().completions.create(
        model="tiny", prompt="Once", max_tokens=5, temperature=0, stream=True
    )
    ids = {chunk.id for chunk in stream}

    def worker_span():
        spans = [
            s
            for s in receiver.received()
            if s["service"] == "nanollmserve" and s["attributes"].get("gen_ai.response.id") in ids
        ]
        return spans and spans[0]

    worker = wait_until(worker_span, 60, "the worker's span of the stream")
    spans = _three_spans(receiver, worker["trace_id"])
    assert spans["router"]["parent_id"] == ""  # the router started the trace
    assert spans["worker"]["parent_id"] == spans["call"]["span_id"]
    assert spans["worker"]["attributes"]["gen_ai.usage.output_tokens"] == 5
