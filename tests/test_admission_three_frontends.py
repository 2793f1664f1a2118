"""One admission path (issue 39): the same hostile request sent over HTTP (the openai client),
over gRPC (the project's client) and to the offline `LLM` gets the same refusal: the same
message, naming the same parameter; a 400 over HTTP, INVALID_ARGUMENT over gRPC, a
ParamError (a ValueError) offline. The server and the `LLM` are built with the same engine
flags and request limits; before `frontend/admission.py` the offline `LLM` skipped the
request policy (limits, `n <= max_num_seqs`) and the request's prompt-token total.
"""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest
from live_server import LiveServer, free_port

from nanollmserve import LLM, SamplingParams
from nanollmserve.api.grpc_client import connect
from nanollmserve.errors import ParamError
from nanollmserve.request_limits import RequestLimits

pytestmark = [pytest.mark.milestone("m28"), pytest.mark.timeout(300)]

PROMPT = "Once upon a time"
LONG_PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen"
ENGINE_FLAGS = {
    "num_kv_blocks": 64,
    "max_num_seqs": 4,
    "scheduling_policy": "priority",
    "max_client_priority": -5,
}
LIMITS = RequestLimits(max_logprobs=2, max_request_prompt_tokens=8)

# (case, prompt, sampling fields, whether gRPC has every one of them, the param named)
HOSTILE = [
    ("max_tokens past the context", PROMPT, {"max_tokens": 100_000}, True, "max_tokens"),
    ("prompt over --max-request-prompt-tokens", LONG_PROMPT, {"max_tokens": 1}, True, "prompt"),
    ("priority past --max-client-priority", PROMPT, {"priority": -10}, True, "priority"),
    (
        "prompt_logprobs past --max-logprobs",
        PROMPT,
        {"prompt_logprobs": 3},
        True,
        "prompt_logprobs",
    ),
    ("logprobs past --max-logprobs", PROMPT, {"logprobs": 3}, False, "logprobs"),
    ("min_tokens past max_tokens", PROMPT, {"min_tokens": 9, "max_tokens": 8}, True, "min_tokens"),
    ("17 stop strings", PROMPT, {"stop": [f"s{i}" for i in range(17)]}, True, "stop"),
    ("n past --max-num-seqs", PROMPT, {"n": 5}, False, "n"),
]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    flags = [arg for name, value in ENGINE_FLAGS.items() for arg in (_flag(name), str(value))]
    live = LiveServer.start(
        *flags,
        "--max-logprobs",
        str(LIMITS.max_logprobs),
        "--max-request-prompt-tokens",
        str(LIMITS.max_request_prompt_tokens),
        "--grpc-port",
        str(grpc_port),
    )
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


@pytest.fixture(scope="module")
def llm():
    with LLM(request_limits=LIMITS, **ENGINE_FLAGS) as offline:
        yield offline


def http_refusal(server, prompt: str, fields: dict) -> tuple[str, str]:
    """(message, param) of the 400 the openai client gets for a completion."""
    client = server.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=client.models.list().data[0].id, prompt=prompt, extra_body=fields
        )
    return info.value.body["message"], info.value.param


def grpc_refusal(server, prompt: str, fields: dict) -> str:
    """The details of the INVALID_ARGUMENT the project's gRPC client gets."""

    async def call():
        async with await connect(server.grpc_target) as client:
            await client.generate(prompt, **fields)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(call())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    return info.value.details()


def offline_refusal(llm, prompt: str, fields: dict) -> tuple[str, str]:
    with pytest.raises(ParamError) as info:
        llm.generate(prompt, SamplingParams(**fields), use_tqdm=False)
    return str(info.value), info.value.param


@pytest.mark.parametrize(
    ("case", "prompt", "fields", "grpc_has_fields", "param"),
    HOSTILE,
    ids=[c[0] for c in HOSTILE],
)
def test_the_same_hostile_request_gets_the_same_refusal_everywhere(
    server, llm, case, prompt, fields, grpc_has_fields, param
):
    http_message, http_param = http_refusal(server, prompt, fields)
    assert http_param == param, (case, http_message)
    offline_message, offline_param = offline_refusal(llm, prompt, fields)
    assert (offline_message, offline_param) == (http_message, param)
    if grpc_has_fields:  # the proto has no `logprobs` nor `n`
        assert grpc_refusal(server, prompt, fields) == http_message


def test_the_offline_llm_still_serves_what_the_limits_allow(llm):
    [output] = llm.generate(
        PROMPT,
        SamplingParams(max_tokens=4, temperature=0, logprobs=2, priority=-5),
        use_tqdm=False,
    )
    assert len(output.outputs[0].token_ids) == 4
    assert all(len(entry) <= 3 for entry in output.outputs[0].logprobs)
