"""Scheduler policy: token budget, max_num_seqs, decodes first, FCFS, chunking, preemption
of the newest request. Driven through EngineCore with a recording model runner wrapper."""

from __future__ import annotations

import pytest
from cluster_process import tiny_model_dir

from nanollmserve.engine.messages import EngineCoreRequest
from nanollmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.milestone("m05")


def record_steps(engine) -> list[list[tuple[str, int, int]]]:
    """Wrap the runner so each step records (request id, computed before, new tokens)."""
    steps = []
    execute = engine.model_runner.execute_model

    def recording(scheduled):
        steps.append(
            [
                (r.request_id, r.num_computed_tokens, n)
                for r, n in zip(scheduled.requests, scheduled.num_new_tokens, strict=True)
            ]
        )
        return execute(scheduled)

    engine.model_runner.execute_model = recording
    return steps


def test_budget_seqs_decodes_first_and_requests_joining_mid_generation(make_llm):
    llm = make_llm(max_num_seqs=4, max_num_batched_tokens=48, enable_prefix_caching=False)
    engine = llm.engine
    steps = record_steps(engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [list(range(200 + i, 230 + i)) for i in range(10)]
    for i, p in enumerate(prompts[:6]):
        engine.add_request(EngineCoreRequest(f"r{i}", p, params))
    for _ in range(3):
        engine.step()
    for i, p in enumerate(prompts[6:], start=6):  # more requests arrive mid-generation
        engine.add_request(EngineCoreRequest(f"r{i}", p, params))
    while engine.has_unfinished_requests():
        engine.step()
    for step in steps:
        assert sum(n for _, _, n in step) <= 48
        assert len(step) <= 4
        kinds = [n == 1 for _, _, n in step]
        assert kinds == sorted(kinds, reverse=True)  # decodes (1 token) first
    first_step = steps[0]
    assert first_step[0] == ("r0", 0, 30)  # FCFS: r0 whole, then r1 chunked to fit
    assert first_step[1] == ("r1", 0, 18)
    # every request's progress is contiguous: it resumes where it stopped
    progress: dict[str, int] = {}
    for step in steps:
        for request_id, computed, n in step:
            assert computed == progress.get(request_id, 0)
            progress[request_id] = computed + n
    assert sorted(progress) == sorted(f"r{i}" for i in range(10))
    assert all(progress[f"r{i}"] == 30 + 6 - 1 for i in range(10))


def test_preemption_picks_the_newest_and_requeues_it_first(make_llm):
    # The tiny random-weight model: the scheduling is under test, not the model.
    llm = make_llm(
        model=str(tiny_model_dir()),
        num_kv_blocks=6,
        block_size=16,
        max_model_len=96,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    steps = record_steps(engine)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(EngineCoreRequest(f"p{i}", list(range(300 + i, 330 + i)), params))
    preempted_seen = False
    before = 0
    while engine.has_unfinished_requests():
        stats = engine.step().stats
        if stats.num_preemptions > before and not preempted_seen:
            preempted_seen = True
            newest_running = [r.request_id for r in engine.scheduler.running]
            assert engine.scheduler.waiting[0].request_id not in newest_running
            assert engine.scheduler.waiting[0].request_id == "p2"
        before = stats.num_preemptions
    assert preempted_seen
    assert engine.stats().kv_cache.peak_used_blocks == 6  # the three prompts fill the pool
    recomputes = [(rid, n) for step in steps for rid, computed, n in step if computed == 0]
    assert [rid for rid, _ in recomputes].count("p2") >= 2  # started again from zero


@pytest.mark.milestone("m08")
def test_prefix_lookups_are_counted_once_per_request(make_llm):
    """A request waiting for blocks is looked up every step; it is counted once."""
    llm = make_llm(num_kv_blocks=8, block_size=16, max_model_len=128)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = list(range(400, 440))  # 40 tokens: 2 full blocks, then a partial one
    engine.add_request(EngineCoreRequest("first", prompt, params))
    engine.add_request(EngineCoreRequest("second", prompt + [7], params))
    engine.add_request(EngineCoreRequest("third", list(range(500, 560)), params))
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert stats.prefix_cache_queries == 40 + 41 + 60
    assert stats.prefix_cache_hits == 32  # "second" reuses the two full blocks of "first"
