"""The typed admission path (issue 39), in process on the tiny random model: the AsyncEngine
takes its RequestPolicy at construction (no HTTP app needed for its limits and generation
defaults to hold); the engine loop's inbox takes only typed commands (an unknown one is an
error in the sender's thread, and the loop goes on serving); an admitted request keeps its
fields (prompt, params after the policy, `n` children, LoRA, arrival) on the way through.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from nanollmserve.config import EngineConfig
from nanollmserve.errors import ParamError
from nanollmserve.frontend.async_engine import AsyncEngine, OutputKind
from nanollmserve.frontend.engine_commands import Abort, UnknownCommandError
from nanollmserve.frontend.request_policy import RequestPolicy
from nanollmserve.request_limits import RequestLimits
from nanollmserve.sampling_params import SamplingParams

pytestmark = [pytest.mark.milestone("m28"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def generation_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation")
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 7}))
    return folder


@pytest.fixture(scope="module")
def engine(generation_dir):
    from cluster_process import tiny_model_dir

    config = EngineConfig(model=str(tiny_model_dir()), dtype="float32", num_kv_blocks=64)
    policy = RequestPolicy(RequestLimits(max_stop_strings=1), generation_config=str(generation_dir))
    engine = AsyncEngine(config, request_policy=policy)
    yield engine
    asyncio.run(engine.shutdown())


async def _final(engine: AsyncEngine, prompt, params: SamplingParams):
    stream = await engine.add_request(prompt, params, output_kind=OutputKind.FINAL_ONLY)
    outputs = [output async for output in stream]
    return outputs[-1]


def test_the_policy_given_at_construction_holds_without_an_http_app(engine):
    policy = engine.request_policy
    assert policy.limits.max_stop_strings == 1
    assert dict(policy.generation_defaults) == {"temperature": 0.0, "top_k": 7}
    assert policy.max_num_seqs == engine.max_num_seqs  # completed for the engine
    params = SamplingParams(max_tokens=2, stop=["a", "b"])
    with pytest.raises(ParamError, match=r"--max-stop-strings 1") as info:
        asyncio.run(_final(engine, [1, 2, 3], params))
    assert info.value.param == "stop"
    # The defaults fill only the fields a frontend reports unset.
    filled = engine.admission.check_params(SamplingParams(temperature=0.5), {"top_k"})
    assert (filled.temperature, filled.top_k) == (0.5, 7)


def test_an_unknown_command_is_refused_and_the_loop_goes_on(engine):
    with pytest.raises(UnknownCommandError):
        engine.engine_loop.send(("abort", "req-0"))  # the old string-tagged form
    engine.engine_loop.send(Abort("no-such-request"))  # a typed one is taken (and ignored)
    output = asyncio.run(_final(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert output.finished and len(output.outputs[0].token_ids) == 3
    assert engine.is_healthy


def test_an_admitted_request_carries_every_field(engine):
    params = SamplingParams(n=2, seed=5, max_tokens=4, ignore_eos=True, priority=0)
    admitted = engine.admission.admit(
        "r", "text", [1, 2, 3], params, output_kind=OutputKind.DELTA, arrival_time=12.5
    )
    assert admitted.child_ids == ["r#0", "r#1"] and admitted.num_seqs == 2
    assert [c.sampling_params.seed for c in admitted.children] == [5, 6]
    assert all(c.arrival_time == 12.5 for c in admitted.children)
    assert (admitted.prompt, admitted.prompt_token_ids) == ("text", [1, 2, 3])
    assert admitted.output_kind is OutputKind.DELTA and admitted.lora_name is None
    with pytest.raises(ParamError, match="maximum context length") as info:
        engine.admission.admit("r", None, [1] * engine.max_model_len, SamplingParams())
    assert info.value.param == "prompt"
