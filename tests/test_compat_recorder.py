"""The flight recorder with the other features (compatibility matrix), on in-process servers
(the in-memory OpenTelemetry exporter of test_tracing.py beside the recorder):

- int8 weights of the scripted Qwen3 checkpoint (`reasoning_model.py`) with the qwen3
  reasoning parser, scheduling by priority and traced: a chat with `return_token_ids` and
  `prompt_logprobs`, an Anthropic message and llama.cpp's `/completion` are traced, recorded
  with their parameters, and the record replays identically offline (`nanollmserve replay`);
- the pooling runner (embeddings): its prefill-only steps are recorded and replay.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import anthropic
import openai
import pytest
from cluster_process import tiny_model_dir
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from reasoning_model import ANSWER, SCRIPT, THINKING, make_reasoning_model

from nanollmserve.api import ServerSettings, create_app
from nanollmserve.config import EngineConfig
from nanollmserve.frontend.async_engine import AsyncEngine
from nanollmserve.tracing.spans import Tracer

pytestmark = [pytest.mark.milestone("m24"), pytest.mark.timeout(400), pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Is it ok?"}]


class RecordedServer:
    """An in-process server whose steps are recorded and whose spans land in `exporter`."""

    def __init__(self, engine_args: dict, **settings) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer = Tracer.with_exporter(self.exporter, "nanollmserve-test", batch=False)
        config = EngineConfig(
            dtype="float32", num_kv_blocks=64, step_record_prompts=True, **engine_args
        )  # the prompts: the tests replay the record
        self.engine = AsyncEngine(config)
        settings = ServerSettings(served_model_names=["tiny"], tracer=self.tracer, **settings)
        self.client = TestClient(create_app(self.engine, settings))
        self.client.__enter__()

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=self.client
        )

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url="http://testserver", api_key="unused", http_client=self.client
        )

    def arrivals(self) -> list[dict]:
        import json

        lines = [json.loads(line) for line in self.engine.step_record_lines()]
        return [a for step in lines[1:] for a in step["arrivals"]]

    def replay(self, path) -> subprocess.CompletedProcess:
        path.write_text("".join(line + "\n" for line in self.engine.step_record_lines()))
        command = [sys.executable, "-m", "nanollmserve.cli.main", "replay", str(path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    def close(self) -> None:
        self.client.__exit__(None, None, None)
        asyncio.run(self.engine.shutdown())
        self.tracer.shutdown()


@pytest.fixture(scope="module")
def reasoning_int8(tmp_path_factory):
    model = make_reasoning_model(tmp_path_factory.mktemp("qwen3-reasoning"))
    engine_args = {"model": str(model), "quantization": "int8", "scheduling_policy": "priority"}
    server = RecordedServer(engine_args, reasoning_parser="qwen3")
    yield server
    server.close()


def test_a_traced_int8_reasoning_chat_with_token_io_is_recorded(reasoning_int8, compat):
    before = len(reasoning_int8.arrivals())
    reasoning_int8.exporter.clear()
    chat = reasoning_int8.openai().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"priority": -1, "return_token_ids": True, "prompt_logprobs": 1},
    )  # fmt: skip
    message = chat.choices[0].message
    assert (message.reasoning_content, message.content) == (THINKING, ANSWER)
    [span] = reasoning_int8.exporter.get_finished_spans()
    assert span.name == "chat tiny"
    assert span.attributes["gen_ai.usage.output_tokens"] == chat.usage.completion_tokens
    [arrival] = reasoning_int8.arrivals()[before:]
    assert arrival["prompt_token_ids"] == chat.prompt_token_ids
    params = arrival["sampling_params"]
    assert params["priority"] == -1 and params["prompt_logprobs"] == 1
    compat.exercised("int8", quantization=reasoning_int8.engine.info.quantization)
    compat.exercised("priority", recorded=params["priority"])
    compat.exercised("reasoning", reasoning_content=message.reasoning_content)
    compat.exercised("recorder", records=len(reasoning_int8.arrivals()) - before)
    compat.exercised("tokenio", token_ids=chat.prompt_token_ids)
    compat.exercised("tokenio", prompt_logprobs=chat.prompt_logprobs)
    compat.exercised("tracing", spans=len(reasoning_int8.exporter.get_finished_spans()))


def test_an_anthropic_message_is_recorded(reasoning_int8, compat):
    before = len(reasoning_int8.arrivals())
    message = reasoning_int8.anthropic().messages.create(
        model="tiny", max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0}
    )
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[1].text == ANSWER
    assert len(reasoning_int8.arrivals()) == before + 1
    compat.exercised("messages", message=message)
    compat.exercised("recorder", records=len(reasoning_int8.arrivals()) - before)
    compat.exercised("reasoning", reasoning_content=message.content[0].thinking)
    # llama.cpp's /completion on the same int8 server: recorded and traced like the others.
    before = len(reasoning_int8.arrivals())
    reasoning_int8.exporter.clear()
    body = {"prompt": "Is it ok?\n", "n_predict": 40, "temperature": 0}
    native = reasoning_int8.client.post("/completion", json=body)
    assert native.status_code == 200, native.text
    assert native.json()["content"] == SCRIPT  # a prompt's text is not split by the parser
    [arrival] = reasoning_int8.arrivals()[before:]
    assert len(arrival["prompt_token_ids"]) == native.json()["tokens_evaluated"]
    [span] = reasoning_int8.exporter.get_finished_spans()
    assert span.name == "text_completion tiny"
    assert span.attributes["gen_ai.usage.output_tokens"] == native.json()["tokens_predicted"]
    compat.exercised("llamacpp", completion=native.json())
    compat.exercised("int8", quantization=reasoning_int8.engine.info.quantization)
    compat.exercised("recorder", records=len(reasoning_int8.arrivals()) - before)
    compat.exercised("tracing", spans=len(reasoning_int8.exporter.get_finished_spans()))


def test_the_int8_reasoning_record_replays_identically(reasoning_int8, tmp_path, compat):
    """The record of a completion, a chat with token-level output and reasoning, and an
    Anthropic message replays identically."""
    before = len(reasoning_int8.arrivals())
    reasoning_int8.openai().completions.create(model="tiny", prompt="Is it ok?\n", max_tokens=8)
    chat = reasoning_int8.openai().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0,
        extra_body={"return_token_ids": True, "prompt_logprobs": 1},
    )  # fmt: skip
    message = reasoning_int8.anthropic().messages.create(
        model="tiny", max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0}
    )
    result = reasoning_int8.replay(tmp_path / "int8.jsonl")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical" in result.stdout
    compat.exercised("int8", quantization=reasoning_int8.engine.info.quantization)
    compat.exercised("recorder", records=len(reasoning_int8.arrivals()) - before)
    compat.exercised("reasoning", reasoning_content=chat.choices[0].message.reasoning_content)
    compat.exercised("tokenio", token_ids=chat.prompt_token_ids)
    compat.exercised("messages", message=message)


def test_embeddings_are_recorded_and_replay(tmp_path, compat):
    server = RecordedServer({"model": str(tiny_model_dir()), "runner": "pooling"})
    try:
        reply = server.openai().embeddings.create(
            model="tiny", input=["a b c", "d e"], encoding_format="float"
        )
        compat.exercised("embed", embedding=reply.data[0].embedding)
        arrivals = server.arrivals()
        assert len(arrivals) == 2
        compat.exercised("recorder", records=len(arrivals))
        result = server.replay(tmp_path / "pooling.jsonl")
    finally:
        server.close()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical" in result.stdout
