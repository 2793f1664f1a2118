"""Priority scheduling (`scheduling_policy="priority"`), offline: waiting requests are
admitted by (priority, arrival); a high-priority request that finds the KV pool full of
lower-priority ones preempts them, starts in the next step and finishes first; greedy
outputs stay those of unpreempted runs. Under fcfs a non-zero priority is refused."""

from __future__ import annotations

import pytest
from cluster_process import tiny_model_dir

from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.errors import ParamError
from nanollmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.milestone("m23")


def _scheduled_ids(engine) -> list[list[str]]:
    """Wrap the runner so each step records the ids of the requests it ran."""
    steps = []
    execute = engine.model_runner.execute_model

    def recording(scheduled):
        steps.append([r.request_id for r in scheduled.requests])
        return execute(scheduled)

    engine.model_runner.execute_model = recording
    return steps


def _run_to_end(engine) -> tuple[list[str], dict[str, list[int]]]:
    """Step until idle -> (request ids in the order they finished, their token ids)."""
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                order.append(out.request_id)
    return order, tokens


def eight_block_llm(make_llm, **engine_args):
    """A pool of 8 blocks of 16 tokens, prefix caching off, on the tiny random-weight model:
    the scheduling is under test, and ~370 steps of it take seconds instead of tens of
    seconds."""
    return make_llm(
        model=str(tiny_model_dir()),
        num_kv_blocks=8,
        block_size=16,
        max_model_len=128,
        enable_prefix_caching=False,
        **engine_args,
    )


@pytest.mark.timeout(300)
def test_high_priority_preempts_a_full_pool_starts_next_step_and_finishes_first(make_llm):
    llm = eight_block_llm(make_llm, scheduling_policy="priority")
    engine = llm.engine
    steps = _scheduled_ids(engine)
    low = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True, priority=10)
    high = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, priority=-5)
    prompts = {f"low{i}": list(range(300 + 7 * i, 320 + 7 * i)) for i in range(2)}
    prompts["high"] = list(range(1000, 1020))
    for name in ("low0", "low1"):
        engine.add_request(EngineCoreRequest(name, prompts[name], low))
    tokens: dict[str, list[int]] = {}
    # Run the low-priority requests until the pool cannot hold the high one's prompt.
    while engine.kv_cache.num_free_blocks >= 2:
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert all(r.request_id.startswith("low") for r in engine.scheduler.running)
    preemptions = engine.stats().num_preemptions
    engine.add_request(EngineCoreRequest("high", prompts["high"], high))
    num_steps = len(steps)

    order, rest = _run_to_end(engine)
    for request_id, ids in rest.items():
        tokens.setdefault(request_id, []).extend(ids)
    assert "high" in steps[num_steps]  # it started in the very next step
    assert engine.stats().num_preemptions > preemptions
    assert order[0] == "high"
    # Greedy outputs are those of a run with nothing preempted (each prompt alone).
    for request_id, prompt in prompts.items():
        params = high if request_id == "high" else low
        [alone] = llm.generate([prompt], SamplingParams(**{**vars(params), "priority": 0}))
        assert tokens[request_id] == alone.outputs[0].token_ids, request_id


@pytest.mark.timeout(300)
def test_fcfs_leaves_the_late_request_waiting_for_the_full_pool(make_llm):
    """The same scenario under fcfs: the late request waits (no preemption for it)."""
    llm = eight_block_llm(make_llm)
    engine = llm.engine
    steps = _scheduled_ids(engine)
    low = SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True)
    for i in range(2):
        engine.add_request(EngineCoreRequest(f"low{i}", list(range(300 + 7 * i, 320 + 7 * i)), low))
    while engine.kv_cache.num_free_blocks >= 2:
        engine.step()
    late = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request(EngineCoreRequest("late", list(range(1000, 1020)), late))
    num_steps = len(steps)
    order, _ = _run_to_end(engine)
    assert "late" not in steps[num_steps]
    assert order[0] != "late"


@pytest.mark.timeout(300)
def test_waiting_requests_are_admitted_by_priority_then_arrival(make_llm):
    llm = make_llm(max_num_seqs=1, scheduling_policy="priority")
    prompts = [f"Request number {i} says" for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[5, 1, 3, 1, -2])
    started = sorted(range(5), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert started == [4, 1, 3, 2, 0]
    # the same prompts, fcfs-ordered: identical greedy outputs
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in again]


def test_nonzero_priority_is_refused_under_fcfs(llm):
    with pytest.raises(ParamError, match="--scheduling-policy priority") as error:
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[3])
    assert error.value.param == "priority"
    # priority 0 (the default) is fine
    [out] = llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])
    assert out.outputs[0].token_ids


@pytest.mark.parametrize("value", [1.5, "1", True, 2**31, -(2**31) - 1, float("nan"), None])
def test_priority_must_be_an_int32(value):
    with pytest.raises(ParamError) as error:
        SamplingParams(priority=value)
    assert error.value.param == "priority"
