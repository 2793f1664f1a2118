"""Issue 41, "Replay and priority" (the priority half, m27): under `--scheduling-policy
priority` a client could claim the most urgent priority and starve the rest forever.

- Aging (`--priority-aging-steps N`): a waiting request's priority improves by one level per
  N engine steps, so a low-priority request finishes within a bound counted in engine steps
  while a flood of urgent requests keeps arriving (offline, stepping the engine; without
  aging it is still waiting at that bound).
- `--max-client-priority P`: a request asking a priority more urgent (lower) than P is a 400
  naming the limit (gRPC: INVALID_ARGUMENT), over HTTP, gRPC and offline.
- Hostile values of both flags (NaN, inf, negative, huge, not an int) fail at start.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import httpx
import pytest
from cluster_process import tiny_model_dir
from live_server import LiveServer, free_port

from nanollmserve.api.grpc_client import connect
from nanollmserve.config import EngineConfig
from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.errors import ParamError, UserError
from nanollmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.milestone("m27")

API_KEY = "priority-aging-key"
AGING_STEPS = 4
LOW, URGENT = 3, -3
LIMIT = -2
STEP_BOUND = 200
"""Steps within which the low request must finish. It ranks with the urgent ones that
arrive (LOW - URGENT) * AGING_STEPS = 24 steps after it; those before it (one per step) take
about 24 * 5 / 2 = 60 steps on two slots, then it runs its own 5: ~90 steps."""


def tiny_llm(make_llm, **engine_args):
    return make_llm(
        model=str(tiny_model_dir()),
        num_kv_blocks=64,
        block_size=16,
        max_model_len=128,
        max_num_seqs=2,
        enable_prefix_caching=False,
        scheduling_policy="priority",
        **engine_args,
    )


def steps_until_low_finishes(engine, max_steps: int) -> int | None:
    """Add the low request, then one urgent request per step (a flood: two slots serve
    fewer than one a step); the step the low one finished at, or None by `max_steps`."""
    params = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    low = SamplingParams(**params, priority=LOW)
    urgent = SamplingParams(**params, priority=URGENT)
    engine.add_request(EngineCoreRequest("low", list(range(100, 120)), low))
    finished_at = None
    for step in range(1, max_steps + 1):
        prompt = list(range(200 + step % 50, 220 + step % 50))
        engine.add_request(EngineCoreRequest(f"urgent{step}", prompt, urgent))
        outputs = engine.step().outputs
        if any(out.request_id == "low" and out.finished for out in outputs):
            finished_at = step
            break
    engine.abort_requests(list(engine.scheduler.requests))  # leave the engine empty
    return finished_at


@pytest.mark.timeout(300)
def test_a_low_priority_request_finishes_within_a_step_bound_under_a_flood(make_llm):
    llm = tiny_llm(make_llm, priority_aging_steps=AGING_STEPS)
    finished_at = steps_until_low_finishes(llm.engine, STEP_BOUND)
    assert finished_at is not None, f"the low request was still waiting after {STEP_BOUND} steps"
    assert finished_at <= STEP_BOUND


@pytest.mark.timeout(300)
def test_without_aging_the_flood_starves_it(make_llm):
    llm = tiny_llm(make_llm, priority_aging_steps=0)
    assert steps_until_low_finishes(llm.engine, STEP_BOUND) is None


def test_the_default_ages(make_llm):
    assert EngineConfig().priority_aging_steps > 0


def test_max_client_priority_offline(make_llm):
    llm = tiny_llm(make_llm, max_client_priority=LIMIT)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ParamError, match="--max-client-priority is -2") as error:
        llm.generate(["Hi"], params, use_tqdm=False, priority=[LIMIT - 1])
    assert error.value.param == "priority"
    [out] = llm.generate(["Hi"], params, use_tqdm=False, priority=[LIMIT])
    assert out.outputs[0].token_ids


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority_aging_steps", -1),
        ("priority_aging_steps", float("nan")),
        ("priority_aging_steps", float("inf")),
        ("priority_aging_steps", 2**31),
        ("priority_aging_steps", 1.5),
        ("max_client_priority", float("nan")),
        ("max_client_priority", float("-inf")),
        ("max_client_priority", 2**31),
        ("max_client_priority", -(2**31) - 1),
        ("max_client_priority", -1.5),
    ],
)
def test_hostile_config_values_are_refused(field, value):
    with pytest.raises(UserError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.parametrize(
    "flags",
    [
        ["--priority-aging-steps", "nan"],
        ["--priority-aging-steps", "inf"],
        ["--priority-aging-steps", "-1"],
        ["--priority-aging-steps", str(2**40)],
        ["--max-client-priority", "nan"],
        ["--max-client-priority", "1e309"],
        ["--max-client-priority", str(-(2**63))],
    ],
)
def test_hostile_flags_fail_at_start(flags):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANOLLMSERVE_")}
    result = subprocess.run(
        [sys.executable, "-m", "nanollmserve.cli.main", "serve", str(tiny_model_dir()), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "unrecognized arguments" not in result.stderr  # a flag this server knows
    assert flags[0].lstrip("-").replace("-", "_") in result.stderr.replace("-", "_")


@pytest.fixture(scope="module")
def server():
    grpc_port = free_port()
    live = LiveServer.start(
        str(tiny_model_dir()), "--scheduling-policy", "priority", "--num-kv-blocks", "64",
        "--max-client-priority", str(LIMIT), "--priority-aging-steps", "50",
        "--grpc-port", str(grpc_port), api_key=API_KEY,
    )  # fmt: skip
    live.grpc_target = f"127.0.0.1:{grpc_port}"
    yield live
    live.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    with server.client() as client:
        return client.post(path, json={"model": None, "max_tokens": 2, **body})


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_priority_above_the_limit_is_a_400_naming_it(server, route):
    base = {"prompt": "Hi"} if route == "/v1/completions" else {}
    if not base:
        base = {"messages": [{"role": "user", "content": "Hi"}]}
    for priority in (LIMIT - 1, -(2**31)):
        answer = post(server, route, {**base, "priority": priority})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "priority" and "--max-client-priority is -2" in error["message"]
    for priority in (LIMIT, 0, 2**31 - 1):
        assert post(server, route, {**base, "priority": priority}).status_code == 200


@pytest.mark.parametrize(
    "raw", ["NaN", "Infinity", "-Infinity", "1e309", "-1.5", str(2**63), str(-(2**63)), '"-3"']
)
def test_hostile_priorities_stay_400s(server, raw):
    text = '{"model": null, "prompt": "Hi", "max_tokens": 2, "priority": ' + raw + "}"
    with server.client() as client:
        answer = client.post(
            "/v1/completions", content=text, headers={"Content-Type": "application/json"}
        )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "priority"


def test_grpc_priority_above_the_limit_is_invalid_argument(server):
    async def generate(priority: int):
        async with await connect(server.grpc_target, api_key=API_KEY) as client:
            return await client.generate("Hi", max_tokens=2, temperature=0, priority=priority)

    for priority in (LIMIT - 1, -(2**31)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(generate(priority))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--max-client-priority is -2" in info.value.details()
    assert asyncio.run(generate(LIMIT)).text is not None
