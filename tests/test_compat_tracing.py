"""OpenTelemetry tracing with the other features (compatibility matrix), on an in-process
server with the SDK's in-memory exporter: a 2-rank tensor-parallel engine on the scripted
Qwen3 checkpoint (`reasoning_model.py`) with the qwen3 reasoning parser and scheduling by
priority: a chat with `priority`, `return_token_ids` and `prompt_logprobs` is one span in the
client's trace, its usage equal to the response's. (int8 weights traced with the same
features: tests/test_compat_recorder.py.)"""

from __future__ import annotations

import asyncio

import openai
import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from reasoning_model import ANSWER, THINKING, make_reasoning_model

from nanollmserve.api import ServerSettings, create_app
from nanollmserve.config import EngineConfig
from nanollmserve.frontend.async_engine import AsyncEngine
from nanollmserve.tracing.spans import Tracer

pytestmark = [pytest.mark.milestone("m24"), pytest.mark.timeout(400), pytest.mark.slow]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def test_a_sharded_reasoning_chat_with_priority_and_token_io_is_traced(tmp_path, capfd, compat):
    model = make_reasoning_model(tmp_path / "qwen3-reasoning")
    exporter = InMemorySpanExporter()
    tracer = Tracer.with_exporter(exporter, "nanollmserve-test", batch=False)
    config = EngineConfig(
        model=str(model), dtype="float32", num_kv_blocks=64, tensor_parallel_size=2,
        scheduling_policy="priority",
    )  # fmt: skip
    engine = AsyncEngine(config)
    settings = ServerSettings(served_model_names=["tiny"], tracer=tracer, reasoning_parser="qwen3")
    client = TestClient(create_app(engine, settings))
    client.__enter__()
    try:
        api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
        raw = api.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "Is it ok?"}], max_tokens=40,
            temperature=0, extra_headers={"traceparent": TRACEPARENT},
            extra_body={"priority": 3, "return_token_ids": True, "prompt_logprobs": 1},
        )  # fmt: skip
        chat = raw.parse()
        message = chat.choices[0].message
        assert (message.reasoning_content, message.content) == (THINKING, ANSWER)
        assert len(chat.prompt_logprobs) == len(chat.prompt_token_ids)
        err = capfd.readouterr().err
        assert "rank 1 of 2" in err
        compat.exercised("tp", ranks=compat.ranks_in_log(err))
        compat.exercised("reasoning", reasoning_content=message.reasoning_content)
        compat.exercised("priority", admitted=(3, raw.status_code))
        compat.exercised("tokenio", token_ids=chat.prompt_token_ids)
        compat.exercised("tokenio", prompt_logprobs=chat.prompt_logprobs)
        compat.exercised("tracing", spans=len(exporter.get_finished_spans()))
        [span] = exporter.get_finished_spans()
        assert span.name == "chat tiny" and span.kind == SpanKind.SERVER
        assert f"{span.context.trace_id:032x}" == TRACE_ID
        assert span.attributes["gen_ai.usage.input_tokens"] == chat.usage.prompt_tokens
        assert span.attributes["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
    finally:
        client.__exit__(None, None, None)
        asyncio.run(engine.shutdown())
        tracer.shutdown()
