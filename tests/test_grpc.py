"""The gRPC service of a live `nanollmserve serve --grpc-port` driven by a real grpc client
(`nanollmserve.api.grpc_client`): every RPC, the same greedy text as HTTP, invalid
arguments, authentication, cancellation (the KV blocks come back) and 16 concurrent calls on
the one engine HTTP also serves."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect

pytestmark = pytest.mark.milestone("m11")

API_KEY = "grpc-test-key"
NUM_BLOCKS = 128
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    live = LiveServer.start(
        "--num-kv-blocks", str(NUM_BLOCKS), "--grpc-port", str(grpc_port), api_key=API_KEY
    )
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


def run(server, body, api_key=API_KEY):
    """Run `await body(client)` with a fresh client on a fresh event loop."""

    async def main():
        async with await connect(server.grpc_target, api_key=api_key) as client:
            return await body(client)

    return asyncio.run(main())


def grpc_error(server, body, api_key=API_KEY) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        run(server, body, api_key)
    return info.value


def wait_blocks_back(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        idle = stats["num_requests_running"] == 0 and stats["num_sequences_in_flight"] == 0
        if idle and stats["num_free_blocks"] == NUM_BLOCKS:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_health(server):
    health = run(server, lambda c: c.health(), api_key=None)  # open, like HTTP /health
    assert health.healthy and health.model == MODEL
    assert health.num_requests_running == 0 and health.kv_cache_usage == 0


def test_generate_matches_http_greedy(server):
    prompt = "The capital of France is"
    reply = run(server, lambda c: c.generate(prompt, max_tokens=8, temperature=0))
    http = server.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0
    )
    assert reply.text == http.choices[0].text
    assert reply.finish_reason == http.choices[0].finish_reason
    assert reply.prompt_tokens == http.usage.prompt_tokens
    assert reply.completion_tokens == http.usage.completion_tokens
    assert reply.request_id.startswith("grpc-")
    assert 0 < reply.time_to_first_token_ms <= reply.latency_ms


def test_generate_with_messages_matches_chat(server):
    messages = [{"role": "user", "content": "Name a color."}]
    reply = run(server, lambda c: c.generate(messages=messages, max_tokens=6, temperature=0))
    http = server.openai().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    assert reply.text == http.choices[0].message.content
    assert reply.prompt_tokens == http.usage.prompt_tokens


def test_stream_deltas_join_to_the_generate_text(server):
    prompt = "Once upon a time"

    async def body(client):
        whole = await client.generate(prompt, max_tokens=10, temperature=0, ignore_eos=True)
        chunks = [
            c async for c in client.stream(prompt, max_tokens=10, temperature=0, ignore_eos=True)
        ]
        return whole, chunks

    whole, chunks = run(server, body)
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == whole.text
    assert sum(len(c.token_ids) for c in chunks) == 10
    assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    last = chunks[-1]
    assert last.finish_reason == "length" and last.completion_tokens == 10
    assert last.prompt_tokens == whole.prompt_tokens and last.latency_ms > 0


def test_batch_generate_keeps_order_and_matches_single_calls(server):
    prompts = ["One, two,", "Red, green,", "Monday, Tuesday,"]

    async def body(client):
        batch = await client.batch_generate(prompts, max_tokens=5, temperature=0)
        singles = [await client.generate(p, max_tokens=5, temperature=0) for p in prompts]
        return batch, singles

    batch, singles = run(server, body)
    assert [r.text for r in batch.results] == [s.text for s in singles]
    assert [r.completion_tokens for r in batch.results] == [s.completion_tokens for s in singles]
    assert batch.latency_ms > 0


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c: c.generate("hi", max_tokens=0), "max_tokens must be an integer >= 1"),
        (lambda c: c.generate("hi", temperature=-1), "temperature must be in [0, 100]"),
        (lambda c: c.generate("hi", top_p=0), "top_p must be in (0, 1]"),
        (lambda c: c.generate(), "give exactly one of prompt and messages"),
        (
            lambda c: c.generate("hi", messages=[{"role": "user", "content": "x"}]),
            "give exactly one of prompt and messages",
        ),
        (lambda c: c.generate("hi", max_tokens=100_000), "maximum context length"),
        (lambda c: c.batch_generate([]), "prompts must hold 1 to 256 prompts"),
        (lambda c: c.batch_generate(["a", ""]), "prompts[1] must not be empty"),
        (lambda c: _drain(c.stream("hi", min_p=2)), "min_p must be in [0, 1]"),
        (
            lambda c: c.generate("hi", structured_outputs={"regex": "[0-9"}),
            "invalid regex",
        ),
        (
            lambda c: c.generate("hi", structured_outputs={"regex": "a", "grammar": "b"}),
            "exactly one of json, regex, choice, grammar or json_object",
        ),
    ],
)
def test_invalid_arguments(server, call, message):
    error = grpc_error(server, call)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()


async def _drain(stream):
    return [chunk async for chunk in stream]


@pytest.mark.milestone("m15")
def test_structured_outputs_constrain_generate_and_stream(server, compat):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}

    async def body(client):
        choice = await client.generate(
            "Is the sky blue?", max_tokens=8, structured_outputs={"choice": ["yes", "no"]}
        )
        chunks = await _drain(
            client.stream(
                "Answer in JSON:", max_tokens=24, structured_outputs={"json": json.dumps(schema)}
            )
        )
        return choice, chunks

    choice, chunks = run(server, body)
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert chunks[-1].finish_reason == "stop"
    assert isinstance(json.loads("".join(c.text for c in chunks))["ok"], bool)
    compat.exercised("grpc", reply=choice)
    compat.exercised("grpc", reply=chunks[-1])
    compat.exercised("structured", output=choice.text, choice=["yes", "no"])
    compat.exercised("structured", output="".join(c.text for c in chunks), schema=schema)


def test_wrong_or_missing_key_is_unauthenticated(server):
    for key in (None, "wrong"):
        error = grpc_error(server, lambda c: c.generate("hi", max_tokens=1), api_key=key)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        error = grpc_error(server, lambda c: _drain(c.stream("hi", max_tokens=1)), api_key=key)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cancelled_stream_aborts_and_frees_blocks(server):
    aborted_before = server.stats()["num_requests_aborted"]

    async def body(client):
        received = 0
        async for chunk in client.stream("Write a long essay.", max_tokens=1000, ignore_eos=True):
            received += len(chunk.token_ids)
            if received >= 3:
                break  # closes the generator: the call is cancelled
        return received

    assert run(server, body) >= 3
    stats = wait_blocks_back(server)
    assert stats["num_requests_aborted"] == aborted_before + 1


def test_deadline_exceeded_aborts_and_frees_blocks(server):
    aborted_before = server.stats()["num_requests_aborted"]
    error = grpc_error(
        server,
        lambda c: c.generate("Write a long essay.", max_tokens=1000, ignore_eos=True, timeout=1),
    )
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_blocks_back(server)
    assert stats["num_requests_aborted"] == aborted_before + 1


def test_sixteen_concurrent_calls(server):
    async def body(client):
        async def streamed(i):
            chunks = [c async for c in client.stream(f"Item {i}:", max_tokens=4, temperature=0)]
            return "".join(c.text for c in chunks), chunks[-1].completion_tokens

        async def unary(i):
            reply = await client.generate(f"Item {i}:", max_tokens=4, temperature=0)
            return reply.text, reply.completion_tokens

        calls = [streamed(i) if i % 2 else unary(i) for i in range(16)]
        return await asyncio.gather(*calls)

    before = wait_blocks_back(server)
    results = run(server, body)
    assert len(results) == 16
    assert all(1 <= n <= 4 for _, n in results)
    stats = wait_blocks_back(server)
    # Each step gives a request at most one token: more tokens than steps during this test
    # means some step ran several of these calls together.
    num_steps = stats["num_steps"] - before["num_steps"]
    num_tokens = stats["num_generation_tokens"] - before["num_generation_tokens"]
    assert num_tokens > num_steps, ("the calls were not batched together", num_tokens, num_steps)


def test_grpc_requests_show_in_metrics(server):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def generated() -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "nanollmserve:generation_tokens_total":
                    return sample.value
        raise AssertionError("no nanollmserve:generation_tokens_total")

    before = generated()
    reply = run(server, lambda c: c.generate("Hello", max_tokens=6, temperature=0))
    server.wait_idle()
    assert generated() - before == reply.completion_tokens


def test_server_log_has_no_traceback(server):
    """Cancellations, deadlines and bad arguments above never crash a handler."""
    assert "Traceback" not in server.log(), server.log()
