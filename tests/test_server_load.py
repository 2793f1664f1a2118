"""A live server under load and cancellation, plus its non-OpenAI routes: clients that drop
mid-stream (or mid-request) are aborted and every KV block comes back; 32 concurrent chats
all complete and are batched; /generate, /batch_generate, /tokenize, /detokenize, /health
and /stats answer."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from live_server import shared_server

pytestmark = pytest.mark.milestone("m02")

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    return shared_server()


def _long_stream_body(i: int) -> dict:
    return {
        "prompt": f"Story number {i}: once upon a time",
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }


def test_dropped_streams_are_aborted_and_blocks_return(server):
    before = server.wait_idle()
    clients = [server.client() for _ in range(4)]
    streams = []
    for i, client in enumerate(clients):
        cm = client.stream("POST", "/v1/completions", json=_long_stream_body(i))
        streams.append((cm, cm.__enter__()))
    lines = [response.iter_lines() for _, response in streams]
    for it in lines:  # every stream is running: read a few chunks from each
        assert next(line for line in it if line.startswith("data: {"))
    for (cm, _), client in list(zip(streams, clients, strict=True))[:2]:
        cm.__exit__(None, None, None)  # drop the client mid-stream
        client.close()
    deadline = time.monotonic() + 20
    while server.stats()["num_requests_aborted"] < before["num_requests_aborted"] + 2:
        assert time.monotonic() < deadline, server.stats()
        time.sleep(0.05)
    for (cm, _), it in list(zip(streams, lines, strict=True))[2:]:
        rest = [line for line in it if line]
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2]
        cm.__exit__(None, None, None)
    for client in clients[2:]:
        client.close()
    after = server.wait_idle()
    assert after["num_requests_aborted"] == before["num_requests_aborted"] + 2
    assert after["num_requests_finished"] >= before["num_requests_finished"] + 2
    assert after["num_free_blocks"] == after["num_total_blocks"]
    assert after["kv_cache_usage"] == 0.0


def test_non_streaming_client_disconnect_aborts(server):
    before = server.wait_idle()
    # Far more tokens than any machine makes during the client's 1 s timeout.
    body = {"prompt": "Count slowly:", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), server.client(timeout=1.0) as client:
        client.post("/v1/completions", json=body)
    deadline = time.monotonic() + 20
    while server.stats()["num_requests_aborted"] < before["num_requests_aborted"] + 1:
        assert time.monotonic() < deadline, server.stats()
        time.sleep(0.05)
    after = server.wait_idle()
    assert after["num_free_blocks"] == after["num_total_blocks"]
    assert after["num_generation_tokens"] - before["num_generation_tokens"] < 2000


def test_32_concurrent_chats_are_batched(server):
    client = server.openai(asynchronous=True)

    async def one(i: int):
        return await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Say the number {i}."}],
            max_tokens=8,
            temperature=0,
        )

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(32)))

    before = server.wait_idle()
    results = asyncio.run(all_of_them())
    assert len(results) == 32
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    assert all(r.usage.completion_tokens >= 1 for r in results)
    stats = server.wait_idle()
    # Batched: far fewer engine steps than tokens (one request at a time needs one each).
    num_steps = stats["num_steps"] - before["num_steps"]
    num_tokens = sum(r.usage.completion_tokens for r in results)
    assert num_steps < num_tokens / 2, (num_steps, num_tokens)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_generate_and_batch_generate(server):
    with server.client() as http:
        one = http.post("/generate", json={"prompt": "The sky is", "max_new_tokens": 6}).json()
        assert set(one) >= {"generated_text", "tokens_generated", "latency_ms"}
        assert 1 <= one["tokens_generated"] <= 6 and one["latency_ms"] > 0
        prompts = ["The sky is", "Grass is", "Snow is"]
        batch = http.post("/batch_generate", json={"prompts": prompts, "max_new_tokens": 6}).json()
        assert len(batch["generated_texts"]) == 3
        # Greedy by default: the batched text equals the single one.
        assert batch["generated_texts"][0] == one["generated_text"]


def test_tokenize_detokenize(server):
    with server.client() as http:
        tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert tokens["count"] == len(tokens["tokens"]) >= 2
        assert tokens["max_model_len"] == 4096
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
        assert text == {"prompt": "Hello world", "content": "Hello world"}  # vLLM and llama.cpp
        chat = http.post(
            "/tokenize", json={"messages": [{"role": "user", "content": "Hello world"}]}
        ).json()
        assert chat["count"] > tokens["count"]


def test_health_and_stats(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "kv_role": "both"}
    stats = server.stats()
    for key in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage",
        "num_free_blocks",
        "prefix_cache_hit_rate",
        "num_prompt_tokens",
        "num_generation_tokens",
        "num_requests_finished",
        "num_requests_aborted",
        "peak_running_requests",
    ):
        assert key in stats
    assert stats["num_total_blocks"] == 256 and stats["is_healthy"]
    assert 0.0 <= stats["prefix_cache_hit_rate"] <= 1.0
