"""`cache_salt`: only requests with the same salt share prefix-cache blocks, so one user
cannot learn from `cached_tokens` (or timing) what another user sent. Checked over HTTP
(completions, chat, responses, with the openai client's `extra_body`) and gRPC, plus the
400 / INVALID_ARGUMENT for a bad salt."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import openai
import pytest
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect

pytestmark = [pytest.mark.milestone("m21"), pytest.mark.timeout(300)]

API_KEY = "salt-test-key"
MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    live = LiveServer.start(
        "--num-kv-blocks", "256", "--grpc-port", str(grpc_port), api_key=API_KEY
    )
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


def unique_prompt() -> str:
    """Nobody sent it before; 40+ tokens, so whole blocks can be reused."""
    return f"{uuid.uuid4().hex} " + "one two three four five six seven eight nine ten " * 4


def grpc_cached_tokens(server, prompt: str, **sampling) -> int:
    async def main():
        async with await connect(server.grpc_target, api_key=API_KEY) as client:
            reply = await client.generate(prompt, max_tokens=1, **sampling)
            return reply.cached_tokens

    return asyncio.run(main())


def test_completions_share_blocks_only_within_one_salt(server):
    client = server.openai()
    prompt = unique_prompt()

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra
        )
        return result.usage.prompt_tokens_details.cached_tokens

    assert cached(None) == 0
    assert cached("alice") == 0  # the unsalted blocks are not the salted ones
    hit = cached("alice")
    assert hit > 0 and hit % BLOCK_SIZE == 0  # the same salt shares
    assert cached("bob") == 0  # another salt does not
    assert cached(None) > 0  # without a salt: today's sharing


def test_chat_and_responses_honour_the_salt(server):
    client = server.openai()
    content = unique_prompt()
    messages = [{"role": "user", "content": content}]

    def chat_cached(salt: str) -> int:
        result = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return result.usage.prompt_tokens_details.cached_tokens

    # Even the chat template's common opening is not shared across salts.
    assert chat_cached("alice") == 0
    assert chat_cached("alice") > 0
    assert chat_cached("bob") == 0

    def responses_cached(salt: str) -> int:
        result = client.responses.create(
            model=MODEL,
            input=content,
            max_output_tokens=1,
            store=False,
            extra_body={"cache_salt": salt},
        )
        return result.usage.input_tokens_details.cached_tokens

    assert responses_cached("carol") == 0
    assert responses_cached("carol") > 0
    assert responses_cached("dave") == 0


def test_grpc_salt_is_the_same_salt_as_http(server):
    prompt = unique_prompt()
    assert grpc_cached_tokens(server, prompt, cache_salt="erin") == 0
    assert grpc_cached_tokens(server, prompt, cache_salt="erin") > 0
    assert grpc_cached_tokens(server, prompt, cache_salt="frank") == 0
    assert grpc_cached_tokens(server, prompt) == 0  # unsalted: nothing cached yet
    http = server.openai().completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "frank"}
    )
    assert http.usage.prompt_tokens_details.cached_tokens > 0  # one salt space for both


@pytest.mark.parametrize("salt", ["", "s" * 257])
def test_a_bad_salt_is_refused_naming_it(server, salt):
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_body={"cache_salt": salt}
        )
    error = info.value.body
    assert error["param"] == "cache_salt" and error["type"] == "invalid_request_error"
    assert "256 characters" in error["message"]
    assert salt not in error["message"] or not salt  # a long salt is not echoed back

    with pytest.raises(grpc.aio.AioRpcError) as grpc_info:
        grpc_cached_tokens(server, "hi", cache_salt=salt)
    assert grpc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt" in grpc_info.value.details()

    assert server.process.poll() is None
