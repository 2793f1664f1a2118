"""`nanollmserve serve --kv-cache-dtype int8` (m25) end to end: the OpenAI client and the gRPC
client get the same greedy answer from a server whose KV pool is int8, and the log names the
pool's blocks and dtype."""

from __future__ import annotations

import asyncio
import re

import pytest
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect

pytestmark = [pytest.mark.milestone("m25"), pytest.mark.timeout(300)]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    live = LiveServer.start(
        "--dtype", "auto", "--kv-cache-dtype", "int8", "--kv-cache-memory", "32MiB",
        "--grpc-port", str(grpc_port),
    )  # fmt: skip
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


def test_http_and_grpc_answer_from_an_int8_pool(server, compat):
    completion = server.openai().completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=12, temperature=0
    )
    text = completion.choices[0].text
    assert completion.usage.completion_tokens == 12 and text.strip()

    async def grpc_reply():
        async with await connect(server.grpc_target) as client:
            return await client.generate(PROMPT, max_tokens=12, temperature=0)

    reply = asyncio.run(grpc_reply())
    assert reply.text == text
    compat.exercised("grpc", reply=reply)
    compat.exercised("kvdtype", kv_cache_dtype=compat.kv_dtype_in_log(server.log()))
    compat.exercised("gguf", quantization=compat.quantization_in_log(server.log()))
    assert "run as one native call" in server.log()  # int8 K/V on the native step
    match = re.search(r"KV cache: (\d+) blocks of 16 tokens, torch.int8 codes", server.log())
    assert match, server.log()[-2000:]
    # 32 MiB of int8 codes and scales: 68 bytes per token, KV head and layer (float32: 256)
    assert int(match.group(1)) * 16 * 2 * 30 * 3 * 68 <= 32 << 20
    assert int(match.group(1)) > (32 << 20) // (16 * 2 * 30 * 3 * 256) * 3
