"""OpenTelemetry request spans (m24) on an in-process server, with the SDK's in-memory
exporter: one SERVER span per generation request (chat, completions, responses, messages,
embeddings) named `{operation} {model}`, the GenAI attributes (request parameters, usage
equal to the response's, finish reasons, response id), the phase events in order, the
client's W3C `traceparent` as parent, hostile trace headers ignored, 400s traced with their
status, other routes untraced; the gRPC service's span; and spans with LoRA, structured
output with speculative decoding, and the bundled model's GGUF blocks.

The end-to-end test through a real router and an OTLP receiver is test_tracing_router.py;
the flags and startup errors are test_tracing_cli.py.
"""

from __future__ import annotations

import asyncio
import json
import math

import grpc
import openai
import pytest
from cluster_process import tiny_model_dir
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from nanollmserve.api import ServerSettings, create_app
from nanollmserve.api.grpc_client import connect, make_request
from nanollmserve.api.grpc_server import start_grpc_server
from nanollmserve.config import EngineConfig
from nanollmserve.frontend.async_engine import AsyncEngine
from nanollmserve.tracing.spans import Tracer

pytestmark = [pytest.mark.milestone("m24"), pytest.mark.timeout(300)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
EVENTS = ["queued", "scheduled", "first_token", "finished"]


class Traced:
    """An in-process server on the tiny model whose spans land in `exporter`."""

    def __init__(self, **engine_args) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer = Tracer.with_exporter(self.exporter, "nanollmserve-test", batch=False)
        defaults = {"model": str(tiny_model_dir()), "dtype": "float32", "num_kv_blocks": 64}
        config = EngineConfig(**{**defaults, **engine_args})
        self.engine = AsyncEngine(config)
        settings = ServerSettings(served_model_names=["tiny"], tracer=self.tracer)
        self.client = TestClient(create_app(self.engine, settings))
        self.client.__enter__()

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=self.client
        )

    def spans(self, count: int) -> list:
        """The spans ended since the last call: exactly `count` of them."""
        spans = list(self.exporter.get_finished_spans())
        self.exporter.clear()
        assert len(spans) == count, [s.name for s in spans]
        return spans

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        asyncio.run(self.engine.shutdown())
        self.tracer.shutdown()


@pytest.fixture(scope="module")
def traced():
    server = Traced()
    yield server
    server.close()


def _events(span) -> list[str]:
    return [event.name for event in span.events]


def _check_events(span) -> None:
    assert _events(span) == EVENTS
    times = [event.timestamp for event in span.events]
    assert times == sorted(times)
    assert span.start_time <= times[0] and times[-1] <= span.end_time


def test_chat_span_carries_genai_attributes_events_and_the_clients_parent(traced) -> None:
    chat = traced.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        n=2,
        extra_headers={"traceparent": TRACEPARENT},
    )
    [span] = traced.spans(1)
    assert span.name == "chat tiny" and span.kind == SpanKind.SERVER
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == PARENT_ID and span.parent.is_remote
    attributes = dict(span.attributes)
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == "tiny"
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert math.isclose(attributes["gen_ai.request.temperature"], 0.5)
    assert math.isclose(attributes["gen_ai.request.top_p"], 0.9)
    assert attributes["gen_ai.request.seed"] == 7
    assert attributes["gen_ai.request.choice.count"] == 2
    assert attributes["gen_ai.response.id"] == chat.id
    assert attributes["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
    reasons = sorted(choice.finish_reason for choice in chat.choices)
    assert sorted(attributes["gen_ai.response.finish_reasons"]) == reasons
    assert attributes["http.response.status_code"] == 200
    for key in ("time_in_queue", "time_to_first_token", "e2e"):
        assert attributes[f"gen_ai.latency.{key}"] >= 0
    _check_events(span)


def test_streamed_completion_is_a_new_trace_with_the_streams_usage(traced) -> None:
    stream = traced.openai().completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    [span] = traced.spans(1)
    assert span.name == "text_completion tiny" and span.parent is None
    attributes = dict(span.attributes)
    assert attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 6
    assert list(attributes["gen_ai.response.finish_reasons"]) == ["length"]
    assert attributes["gen_ai.response.id"] == chunks[0].id
    _check_events(span)


def test_two_prompts_are_one_span_with_both_requests(traced) -> None:
    completion = traced.openai().completions.create(
        model="tiny", prompt=["one", "two three"], max_tokens=3, temperature=0
    )
    [span] = traced.spans(1)
    attributes = dict(span.attributes)
    assert attributes["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
    assert len(attributes["gen_ai.response.finish_reasons"]) == 2
    by_request: dict[str, list[str]] = {}
    for event in span.events:
        by_request.setdefault(event.attributes["nanollmserve.request_id"], []).append(event.name)
    assert list(by_request.values()) == [EVENTS, EVENTS]


def test_responses_and_messages_are_chat_spans_and_other_routes_have_none(traced, compat) -> None:
    client = traced.client
    headers = {"traceparent": TRACEPARENT}
    answer = client.post(
        "/v1/responses",
        json={"model": "tiny", "input": "Hi", "max_output_tokens": 4},
        headers=headers,
    )
    assert answer.status_code == 200, answer.text
    message = client.post(
        "/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert message.status_code == 200, message.text
    generate = client.post("/generate", json={"prompt": "Hi", "max_tokens": 3})
    assert generate.status_code == 200, generate.text
    spans = traced.spans(3)
    responses_span, messages_span, generate_span = spans
    assert responses_span.name == messages_span.name == "chat tiny"
    compat.exercised("messages", message=message.json())
    compat.exercised("tracing", spans=len(spans))
    assert generate_span.name.startswith("text_completion ")
    assert f"{responses_span.context.trace_id:032x}" == TRACE_ID
    usage = message.json()["usage"]
    assert messages_span.attributes["gen_ai.usage.output_tokens"] == usage["output_tokens"]
    for span in (responses_span, messages_span, generate_span):
        _check_events(span)
    assert client.get("/v1/models").status_code == 200
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 200
    assert client.get("/health").status_code == 200
    traced.spans(0)


@pytest.mark.milestone("m30")
def test_llamacpp_native_completion_is_a_text_completion_span(traced) -> None:
    client = traced.client
    answer = client.post(
        "/completion",
        json={"prompt": "Hi", "n_predict": 3, "temperature": 0},
        headers={"traceparent": TRACEPARENT},
    )
    assert answer.status_code == 200, answer.text
    [span] = traced.spans(1)
    assert span.name == "text_completion tiny"
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.attributes["gen_ai.usage.output_tokens"] == answer.json()["tokens_predicted"]
    _check_events(span)
    traced.spans(0)


HOSTILE_TRACE_HEADERS = [
    {"traceparent": "garbage"},
    {"traceparent": f"00-{'0' * 32}-{PARENT_ID}-01"},  # the invalid all-zero trace id
    {"traceparent": f"00-{TRACE_ID}-{'0' * 16}-01"},  # the invalid all-zero parent id
    {"traceparent": f"ff-{TRACE_ID}-{PARENT_ID}-01"},  # the forbidden version
    {"traceparent": f"00-{TRACE_ID.upper()}-{PARENT_ID}-01"},  # upper case is invalid
    {"traceparent": "00-" + "a" * 8000},
    {"traceparent": TRACEPARENT, "tracestate": ",".join(f"k{i}=v" for i in range(500))},
    {"traceparent": "\u00e9\u00e8"},
]


@pytest.mark.parametrize("headers", HOSTILE_TRACE_HEADERS)
def test_hostile_trace_headers_start_a_fresh_trace_or_are_ignored(traced, headers) -> None:
    encoded = {k: v.encode() for k, v in headers.items()}  # non-ASCII bytes as sent
    response = traced.client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
        headers=encoded,
    )
    assert response.status_code == 200, response.text
    [span] = traced.spans(1)
    if headers["traceparent"] == TRACEPARENT:  # a valid parent, a tracestate beyond limits
        assert f"{span.context.trace_id:032x}" == TRACE_ID
    else:
        assert span.parent is None and span.context.is_valid
        assert f"{span.context.trace_id:032x}" != TRACE_ID


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"max_tokens": 10**12}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"top_p": 1e-320}, None),  # tiny: accepted or refused, the server goes on
    ],
)
def test_bad_requests_are_traced_with_their_status_and_the_server_goes_on(
    traced, body, param
) -> None:
    payload = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, **body}
    content = json.dumps(payload)  # NaN and Infinity as Python's JSON writes them
    response = traced.client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    [span] = traced.spans(1)
    assert span.attributes["http.response.status_code"] == response.status_code
    if param is None:
        assert response.status_code in (200, 400)
    else:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert span.attributes["error.type"] == "400"
        assert "gen_ai.usage.input_tokens" not in span.attributes
    ok = traced.client.post("/v1/completions", json={"model": "tiny", "prompt": "a"})
    assert ok.status_code == 200
    traced.spans(1)


def test_embeddings_span(compat) -> None:
    server = Traced(runner="pooling")
    try:
        reply = server.openai().embeddings.create(
            model="tiny", input=["a b c", "d"], extra_headers={"traceparent": TRACEPARENT}
        )
        spans = server.spans(1)
        [span] = spans
        assert span.name == "embeddings tiny"
        compat.exercised("tracing", spans=len(spans))
        compat.exercised("embed", embedding=reply.data[0].embedding)
        assert f"{span.context.trace_id:032x}" == TRACE_ID
        assert span.attributes["gen_ai.usage.input_tokens"] == reply.usage.prompt_tokens
        assert span.attributes["gen_ai.usage.output_tokens"] == 0
    finally:
        server.close()


def test_grpc_calls_are_spans_in_the_callers_trace(traced, compat) -> None:
    async def calls():
        server, port = await start_grpc_server(
            traced.engine, "127.0.0.1", 0, model_name="tiny", tracer=traced.tracer
        )
        try:
            async with await connect(f"127.0.0.1:{port}") as client:
                chat = make_request(
                    messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
                )
                reply = await client.stub.Generate(chat, metadata=(("traceparent", TRACEPARENT),))
                hostile = (("traceparent", "00-" + "z" * 4000),)
                await client.stub.Generate(make_request("Hi", max_tokens=2), metadata=hostile)
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await client.stub.Generate(make_request("Hi", temperature=math.nan))
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                return reply
        finally:
            await server.stop(0)

    reply = asyncio.run(calls())
    spans = traced.spans(3)
    chat_span, hostile_span, bad_span = spans
    compat.exercised("grpc", reply=reply)
    compat.exercised("tracing", spans=len(spans))
    assert chat_span.name == "chat tiny" and chat_span.kind == SpanKind.SERVER
    assert f"{chat_span.context.trace_id:032x}" == TRACE_ID
    assert chat_span.attributes["rpc.method"] == "Generate"
    assert chat_span.attributes["gen_ai.usage.output_tokens"] == reply.completion_tokens
    assert chat_span.attributes["gen_ai.usage.input_tokens"] == reply.prompt_tokens
    _check_events(chat_span)
    assert hostile_span.name == "text_completion tiny" and hostile_span.parent is None
    assert bad_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not bad_span.status.is_ok


def test_structured_output_with_speculative_decoding_is_traced(compat) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    server = Traced(speculative_config=spec)
    # Each choice repeats a word: the ngram drafts its next repetition (within the grammar).
    choices = ["la la la la la", "no no no no no"]
    try:
        chat = server.openai().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Pick one"}],
            max_tokens=12,
            temperature=0,
            extra_body={"structured_outputs": {"choice": choices}},
            extra_headers={"traceparent": TRACEPARENT},
        )
        assert chat.choices[0].message.content in choices
        spans = server.spans(1)
        assert spans[0].name == "chat tiny"
        assert f"{spans[0].context.trace_id:032x}" == TRACE_ID
        assert spans[0].attributes["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
        _check_events(spans[0])
        compat.exercised("tracing", spans=len(spans))
        compat.exercised("structured", output=chat.choices[0].message.content, choice=choices)
        drafts = server.engine.stats().engine.spec_decode.num_drafts
        compat.exercised("spec", num_drafts=drafts)
    finally:
        server.close()


def test_a_lora_request_names_its_adapter(tmp_path, compat) -> None:
    from lora_adapters import make_adapter
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    adapter = make_adapter(tmp_path / "adapter", seed=0, base=base)
    server = Traced(enable_lora=True)
    try:
        asyncio.run(server.engine.load_lora("tiny-lora", str(adapter)))
        completion = server.openai().completions.create(
            model="tiny-lora", prompt="Hi", max_tokens=3, temperature=0
        )
        spans = server.spans(1)
        [span] = spans
        assert span.name == "text_completion tiny-lora"
        assert span.attributes["gen_ai.request.model"] == "tiny-lora"
        assert span.attributes["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens
        compat.exercised("tracing", spans=len(spans))
        base = server.openai().completions.create(
            model="tiny", prompt="Hi", max_tokens=3, temperature=0
        )
        compat.exercised("lora", output=completion.choices[0].text, base=base.choices[0].text)
    finally:
        server.close()


def test_the_bundled_models_gguf_blocks_are_traced(compat) -> None:
    server = Traced(model=None, dtype="auto", quantization="gguf")
    try:
        assert server.engine.info.quantization == "gguf"
        compat.exercised("gguf", quantization=server.engine.info.quantization)
        chat = server.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        spans = server.spans(1)
        compat.exercised("tracing", spans=len(spans))
        [span] = spans
        assert span.name == "chat tiny"
        assert span.attributes["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
        _check_events(span)
    finally:
        server.close()
