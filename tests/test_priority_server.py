"""Priority scheduling over HTTP and gRPC: on a server started with `--scheduling-policy
priority` and a small KV pool, a high-priority request that arrives while the pool is full
of low-priority streams (preempting each other) finishes first, with greedy outputs equal to
unpreempted runs (that it starts within one step: `test_priority_scheduling.py`);
`priority` works on completions, chat and responses and in gRPC's SamplingParams; a fcfs
server refuses a non-zero priority with a 400 (vLLM's behaviour); hostile values are 400s
naming `priority`."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import openai
import pytest
from cluster_process import tiny_model_dir
from live_server import LiveServer, free_port, shared_server

from nanollmserve.api.grpc_client import connect

pytestmark = [pytest.mark.milestone("m23"), pytest.mark.timeout(300)]

API_KEY = "priority-test-key"
LOW_TOKENS = 60


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    # The tiny random-weight model: the scheduling is under test, and the contended streams
    # then take seconds, not half a minute.
    live = LiveServer.start(
        str(tiny_model_dir()),
        "--scheduling-policy", "priority",
        "--num-kv-blocks", "8",
        "--block-size", "16",
        "--max-model-len", "128",
        "--no-enable-prefix-caching",
        "--grpc-port", str(grpc_port),
        api_key=API_KEY,
    )  # fmt: skip
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


def _completion(client, prompt: str, max_tokens: int, priority: int, **kwargs):
    return client.completions.create(
        model=None,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"priority": priority, "ignore_eos": True},
        **kwargs,
    )


def _race(client, server, low_prompts, high_prompt):
    """Four low-priority streams fill the pool, then one high-priority request: (finish
    time per request, the low streams' texts, the high completion)."""
    finished: dict[str, float] = {}
    texts: dict[str, str] = {}

    def stream_low(i: int) -> None:
        chunks = _completion(client, low_prompts[i], LOW_TOKENS, 10, stream=True)
        texts[f"low{i}"] = "".join(c.choices[0].text for c in chunks if c.choices)
        finished[f"low{i}"] = time.monotonic()

    threads = [threading.Thread(target=stream_low, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while True:  # the pool is full: some low-priority requests run, others wait
        stats = server.stats()
        if stats["num_requests_running"] and stats["num_requests_waiting"]:
            break
        if not any(thread.is_alive() for thread in threads):
            # The streams all ended before a /stats answer caught them contending (a
            # loaded machine can take longer to answer /stats than the tiny model takes
            # to finish them): this race proves nothing either way.
            return None
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)
    high = _completion(client, high_prompt, 8, -1)
    finished["high"] = time.monotonic()
    for thread in threads:
        thread.join(120)
    return finished, texts, high


def test_high_priority_request_preempts_a_full_pool_and_finishes_first(server):
    client = server.openai(strict=False)
    low_prompts = [f"Story {i}: once upon a time there was a" for i in range(4)]
    high_prompt = "Quick question: what is two plus two?"
    # A low stream the engine was running when the high request reached it may be a few
    # tokens from its end and finish first; on a loaded machine the request can take that
    # long to arrive. So the race is run up to three times: under first-come-first-served
    # the high request waits for 4 x LOW_TOKENS tokens and never wins one.
    # A race whose low streams all end before /stats shows them contending is not counted.
    conclusive = 0
    for _ in range(8):
        race = _race(client, server, low_prompts, high_prompt)
        if race is None:
            continue
        finished, texts, high = race
        conclusive += 1
        if min(finished, key=finished.get) == "high" or conclusive == 3:
            break
    assert conclusive, "no race caught the pool contended"
    assert server.stats()["num_preemptions"] > 0  # the pool was contended
    assert min(finished, key=finished.get) == "high", finished
    # greedy outputs equal those of runs with nothing else going on
    assert high.choices[0].text == _completion(client, high_prompt, 8, 0).choices[0].text
    for i, prompt in enumerate(low_prompts):
        assert texts[f"low{i}"] == _completion(client, prompt, LOW_TOKENS, 0).choices[0].text


def test_priority_on_chat_responses_and_grpc(server, compat):
    client = server.openai(strict=True)
    messages = [{"role": "user", "content": "Say hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model="", messages=messages, max_tokens=3, temperature=0, extra_body={"priority": -7}
    )
    assert raw.parse().choices[0].message.content
    compat.exercised("priority", admitted=(-7, raw.status_code))
    response = client.responses.create(
        input="Say hi", max_output_tokens=3, temperature=0, extra_body={"priority": 2**31 - 1}
    )
    assert response.status in ("completed", "incomplete")  # 3 tokens may cut it short

    async def grpc_calls():
        async with await connect(server.grpc_target, api_key=API_KEY) as grpc_client:
            out = []
            for priority in (-(2**31), 0, 2**31 - 1):
                reply = await grpc_client.generate(
                    "Hello", max_tokens=3, temperature=0, priority=priority
                )
                out.append(reply)
            return out

    replies = asyncio.run(grpc_calls())
    assert len({reply.text for reply in replies}) == 1
    compat.exercised("grpc", reply=replies[0])  # priority -2**31, which fcfs would refuse


HOSTILE = [
    "NaN", "Infinity", "-Infinity", "1e400", "1.5", "1e3", '"3"', "true", "null!", "[]",
    "{}", "2147483648", "-2147483649", "99999999999999999999999",
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "base"),
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ],
)
def test_hostile_priorities_are_400s_naming_priority(server, route, base):
    with server.client() as client:
        for value in HOSTILE:
            body = json.dumps(base)[:-1] + f', "priority": {value}}}'
            response = client.post(
                route, content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 400, (value, response.text)
            error = response.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            if value != "null!":  # not JSON at all: no field to name
                assert error["param"] == "priority", (value, error)
        assert client.get("/health").status_code == 200


def test_fcfs_server_refuses_a_nonzero_priority():
    fcfs = shared_server()
    client = fcfs.openai(strict=True)
    for call in (
        lambda p: client.completions.create(
            model=None, prompt="Hi", max_tokens=2, extra_body={"priority": p}
        ),
        lambda p: client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=2,
            extra_body={"priority": p},
        ),
        lambda p: client.responses.create(
            input="Hi", max_output_tokens=2, extra_body={"priority": p}
        ),
    ):
        with pytest.raises(openai.BadRequestError) as error:
            call(5)
        assert error.value.body["param"] == "priority"
        assert "--scheduling-policy priority" in error.value.body["message"]
        call(0)  # the default is accepted


def test_grpc_priority_on_a_fcfs_server_is_invalid_argument(compat):
    grpc_port = free_port()
    live = LiveServer.start("--num-kv-blocks", "64", "--grpc-port", str(grpc_port))
    try:

        async def call():
            async with await connect(f"127.0.0.1:{grpc_port}") as grpc_client:
                return await grpc_client.generate("Hi", max_tokens=2, priority=1)

        with pytest.raises(grpc.aio.AioRpcError) as error:
            asyncio.run(call())
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "priority" in error.value.details()
        compat.exercised("grpc", reply=error.value)
        compat.exercised("priority", refused=error.value.details())
    finally:
        live.stop()
