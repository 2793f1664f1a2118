"""`--reasoning-parser` with the other features, for the compatibility matrix
(scripts/compat_matrix.py), on the scripted Qwen3 checkpoint of `reasoning_model.py`
(greedy output `<think>THINKING</think>ANSWER`):

- a 2-rank CPU worker (tensor parallelism) scheduling by priority, with its gRPC port and a
  router in front: chat splits the thinking through the router and directly, with
  `priority` and `return_token_ids`; the Messages API gives a thinking block; gRPC chats
  get `reasoning_content`, `return_token_ids` and `prompt_logprobs` equal to HTTP's;
  llama.cpp's `/completion` answers a prompt through the router and as gRPC does;
- a worker on int8 weights: the same split, in chat and in the Messages API, with
  `priority`, and token-level output (token ids, prompt logprobs near float32's).
"""

from __future__ import annotations

import math

import anthropic
import grpc
import httpx
import pytest
from compat_stack import CompatStack
from live_server import LiveServer
from reasoning_model import ANSWER, SCRIPT, THINKING, make_reasoning_model

from nanollmserve import LLM, SamplingParams

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(400), pytest.mark.slow]

MESSAGES = [{"role": "user", "content": "Is it ok?"}]
PROMPT = "Is it ok?\n"  # a completions prompt ending in the newline the script follows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_reasoning_model(tmp_path_factory.mktemp("qwen3-reasoning"))


@pytest.fixture(scope="module")
def stack(model_dir):
    stack = CompatStack.start(
        str(model_dir), "--tensor-parallel-size", "2", "--num-kv-blocks", "64",
        "--reasoning-parser", "qwen3", "--scheduling-policy", "priority",
    )  # fmt: skip
    yield stack
    stack.stop()


def _chat(url: str, **extra) -> dict:
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, **extra}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _token_ids(url: str, text: str) -> list[int]:
    return httpx.post(f"{url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]


def _messages_blocks(url: str, **extra) -> list[tuple[str, str]]:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    message = client.messages.create(
        model="", max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0, **extra}
    )
    return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def _native(url: str) -> dict:
    """llama.cpp's `/completion` answer to PROMPT, greedy, with its token ids."""
    body = {"prompt": PROMPT, "n_predict": 40, "temperature": 0, "return_tokens": True}
    reply = httpx.post(f"{url}/completion", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _lps(prompt_logprobs) -> list[float]:
    """The prompt tokens' own logprobs (the first entry of each position, the first None)."""
    return [next(iter(p.values()))["logprob"] for p in prompt_logprobs[1:]]


def test_sharded_worker_splits_the_thinking_through_the_router(stack, compat):
    script_ids = _token_ids(stack.worker.url, SCRIPT)
    for url in (stack.router.url, stack.worker.url):
        reply = _chat(url, priority=-2, return_token_ids=True)
        message = reply["choices"][0]["message"]
        assert message["reasoning_content"] == THINKING and message["content"] == ANSWER
        assert reply["choices"][0]["token_ids"][: len(script_ids)] == script_ids
        assert reply["prompt_token_ids"][-1] == _token_ids(url, "\n")[0]
        compat.exercised("reasoning", reasoning_content=message["reasoning_content"])
        compat.exercised("tokenio", token_ids=reply["choices"][0]["token_ids"])
    assert "rank 1 of 2" in stack.worker.log()
    compat.exercised("tp", ranks=compat.ranks_in_log(stack.worker.log()))
    compat.exercised("router", routed=stack.router.stats()["workers"][0]["num_routed"])
    raw = httpx.post(
        f"{stack.router.url}/v1/chat/completions", timeout=120,
        json={"messages": MESSAGES, "max_tokens": 4, "priority": -2},
    )  # fmt: skip
    compat.exercised("priority", admitted=(-2, raw.status_code))
    stream = stack.router.openai().chat.completions.create(
        model="", messages=MESSAGES, max_tokens=40, temperature=0, stream=True,
        extra_body={"priority": 5},
    )  # fmt: skip
    thinking, answer = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            thinking += delta.get("reasoning_content") or ""
            answer += delta.get("content") or ""
    assert (thinking, answer) == (THINKING, ANSWER)


def test_messages_on_the_sharded_worker_through_the_router(stack, compat):
    for url in (stack.router.url, stack.worker.url):
        assert _messages_blocks(url, priority=-1) == [("thinking", THINKING), ("text", ANSWER)]
    client = anthropic.Anthropic(
        base_url=stack.router.url, api_key="unused", max_retries=0, timeout=120
    )
    raw = client.messages.with_raw_response.create(
        model="", max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0, "priority": -1}
    )
    compat.exercised("messages", message=raw.parse())
    compat.exercised("priority", admitted=(-1, raw.status_code))
    compat.exercised("router", routed=stack.router.stats()["workers"][0]["num_routed"])
    compat.exercised("tp", ranks=compat.ranks_in_log(stack.worker.log()))
    # llama.cpp's /completion through the router and on the worker: the same sharded engine,
    # the raw text of the prompt (not split: a prompt, as on /v1/completions).
    routed = stack.router.stats()["workers"][0]["num_routed"]
    for url in (stack.router.url, stack.worker.url):
        native = _native(url)
        assert native["content"] == SCRIPT and native["stop_type"] == "eos"
        compat.exercised("llamacpp", completion=native)
    assert stack.router.stats()["workers"][0]["num_routed"] == routed + 1
    compat.exercised("router", routed=stack.router.stats()["workers"][0]["num_routed"] - routed)
    # /completion has no `priority` (llama.cpp's API), on this priority-scheduling worker too.
    body = {"prompt": PROMPT, "n_predict": 2, "priority": -1}
    refused = httpx.post(f"{stack.router.url}/completion", json=body, timeout=120)
    assert refused.status_code == 400, refused.text
    assert "Unrecognized request argument supplied: priority" in refused.json()["error"]["message"]
    compat.refused("llamacpp", "priority", refused.json()["error"]["message"])


def test_grpc_chat_splits_the_thinking_and_returns_token_level_output(stack, compat):
    http = _chat(stack.worker.url, return_token_ids=True, prompt_logprobs=1)

    async def body(client):
        sampling = dict(max_tokens=40, temperature=0, priority=-1, prompt_logprobs=1)
        reply = await client.generate(messages=MESSAGES, return_token_ids=True, **sampling)
        chunks = [m async for m in client.stream(messages=MESSAGES, **sampling)]
        return reply, chunks

    reply, chunks = stack.grpc(body)
    assert (reply.reasoning_content, reply.text) == (THINKING, ANSWER)
    assert list(reply.token_ids) == http["choices"][0]["token_ids"]
    assert list(reply.prompt_token_ids) == http["prompt_token_ids"]
    ours = [p.logprobs[0].logprob for p in reply.prompt_logprobs[1:]]
    assert len(reply.prompt_logprobs[0].logprobs) == 0
    assert [p.logprobs[0].token_id for p in reply.prompt_logprobs[1:]] == (
        http["prompt_token_ids"][1:]
    )
    assert ours == pytest.approx(_lps(http["prompt_logprobs"]), rel=1e-5, abs=1e-5)
    assert "".join(m.reasoning_content for m in chunks) == THINKING
    assert "".join(m.text for m in chunks) == ANSWER
    assert len(chunks[0].prompt_logprobs) == len(http["prompt_token_ids"])
    assert not chunks[0].prompt_token_ids  # not asked for in the stream
    assert _messages_blocks(stack.worker.url)[1] == ("text", reply.text)
    compat.exercised("grpc", reply=reply)
    compat.exercised("reasoning", reasoning_content=reply.reasoning_content)
    compat.exercised("tokenio", token_ids=list(reply.token_ids))
    compat.exercised("tokenio", prompt_logprobs=list(reply.prompt_logprobs))
    client = anthropic.Anthropic(
        base_url=stack.worker.url, api_key="unused", max_retries=0, timeout=120
    )
    message = client.messages.create(
        model="", max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0}
    )
    compat.exercised("messages", message=message)

    async def raw(client):
        return await client.generate(PROMPT, max_tokens=40, temperature=0, return_token_ids=True)

    completion = stack.grpc(raw)  # a prompt over gRPC and llama.cpp's /completion: one answer
    native = _native(stack.worker.url)
    assert native["content"] == completion.text == SCRIPT
    assert native["tokens"] == list(completion.token_ids)
    compat.exercised("grpc", reply=completion)
    compat.exercised("llamacpp", completion=native)


def test_a_grpc_grammar_applies_after_the_thinking(stack, compat):
    async def body(client):
        return await client.generate(
            messages=MESSAGES, max_tokens=40, temperature=0,
            structured_outputs={"choice": ["yes", "no"]},
        )  # fmt: skip

    reply = stack.grpc(body)
    assert reply.reasoning_content == THINKING and reply.text in ("yes", "no")
    compat.exercised("grpc", reply=reply)
    compat.exercised("reasoning", reasoning_content=reply.reasoning_content)
    compat.exercised("structured", output=reply.text, choice=["yes", "no"])


def test_grpc_prompt_logprobs_beyond_the_limit_are_invalid_argument(stack, compat):
    async def body(client):
        return await client.generate("Hi", max_tokens=2, prompt_logprobs=10**6)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.grpc(body)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in info.value.details()
    assert stack.worker.process.poll() is None

    async def within_the_limit(client):
        return await client.generate("Hi", max_tokens=2, prompt_logprobs=1, return_token_ids=True)

    good = stack.grpc(within_the_limit)
    compat.exercised("grpc", reply=good)
    compat.exercised("tokenio", prompt_logprobs=list(good.prompt_logprobs))


# -- int8 weights ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def int8_server(model_dir):
    # --dtype float32: the test compares the server's prompt logprobs with an offline
    # float32 int8 engine's to 1e-4 (dtype auto is bfloat16 on a CPU with bfloat16).
    live = LiveServer.start(
        str(model_dir), "--dtype", "float32", "--quantization", "int8", "--num-kv-blocks", "64",
        "--reasoning-parser", "qwen3", "--scheduling-policy", "priority",
    )  # fmt: skip
    yield live
    live.stop()


def test_int8_weights_think_answer_and_score_the_prompt(int8_server, model_dir, compat):
    assert "quantization=int8" in int8_server.log()
    message = _chat(int8_server.url, priority=-3)["choices"][0]["message"]
    assert message["reasoning_content"] == THINKING and message["content"] == ANSWER
    blocks = _messages_blocks(int8_server.url, priority=3)
    assert blocks == [("thinking", THINKING), ("text", ANSWER)]
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "priority": 1,
            "return_token_ids": True, "prompt_logprobs": 1}  # fmt: skip
    reply = httpx.post(f"{int8_server.url}/v1/completions", json=body, timeout=120).json()
    choice = reply["choices"][0]
    assert choice["text"] == SCRIPT
    assert choice["token_ids"][:-1] == _token_ids(int8_server.url, SCRIPT)  # then <|im_end|>
    ours = _lps(choice["prompt_logprobs"])
    offline = {}
    for quantization in ("int8", "none"):  # the server's weights offline, then float32's
        llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=16, quantization=quantization)
        try:
            [ref] = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=1))
        finally:
            llm.shutdown()
        assert choice["prompt_token_ids"] == ref.prompt_token_ids
        offline[quantization] = [next(iter(p.values())).logprob for p in ref.prompt_logprobs[1:]]
    # The server scores the prompt as the offline engine on the same int8 weights does: the
    # same numbers (measured 0 apart, on the AMX and the AVX2 builds alike). A prompt logprob
    # the server shifted by 0.05 passed the float32 bar below alone.
    worst = max(abs(a - b) for a, b in zip(ours, offline["int8"], strict=True))
    print(f"prompt logprobs: server vs offline int8 {worst:.2g} apart at most")
    assert worst < 1e-4, (ours, offline["int8"])
    # ...and near float32's: these prompt tokens are unlikely (logprobs -12 to -27), int8
    # weights move them by +0.0036, +0.073, -0.023, +0.052 (measured, AMX and AVX2 builds
    # alike: the PyTorch int8 matmul); weights truncated instead of rounded move them by up
    # to 0.28.
    for a, b in zip(ours, offline["none"], strict=True):
        assert math.isclose(a, b, abs_tol=0.1), (ours, offline["none"])
    compat.exercised("int8", quantization=compat.quantization_in_log(int8_server.log()))
    compat.exercised("reasoning", reasoning_content=message["reasoning_content"])
    compat.exercised("tokenio", token_ids=choice["token_ids"])
    compat.exercised("tokenio", prompt_logprobs=choice["prompt_logprobs"])
    client = anthropic.Anthropic(
        base_url=int8_server.url, api_key="unused", max_retries=0, timeout=120
    )
    raw = client.messages.with_raw_response.create(
        model="", max_tokens=40, messages=MESSAGES, extra_body={"temperature": 0, "priority": 3}
    )
    compat.exercised("messages", message=raw.parse())
    compat.exercised("priority", admitted=(3, raw.status_code))
