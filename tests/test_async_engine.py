"""AsyncEngine in-process (bundled model): outputs stream as deltas, merged into one pending
output while the consumer lags; a consumer that leaves aborts its request and frees its
blocks at once; admission is bounded; a failed engine step fails the requests in the engine
and the engine goes on, while repeated failures mark it dead; shutdown aborts what is left;
observers see every step and finished request; an idle loop sleeps."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import pytest

from nanollmserve.config import EngineConfig
from nanollmserve.engine.engine_core import EngineCore
from nanollmserve.frontend.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    OutputKind,
)
from nanollmserve.frontend.engine_loop import FAIL_STEPS_ENV, MAX_CONSECUTIVE_STEP_FAILURES
from nanollmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.milestone("m02")

CONFIG = dict(dtype="float32", num_kv_blocks=64)
LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
FINAL = OutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(EngineConfig(**CONFIG))
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def tiny_engine():
    """The same engine on the tiny random-weight model (the bundled tokenizer): a request of
    a thousand tokens takes seconds, not a minute. For tests of the frontend, not the model."""
    from cluster_process import tiny_model_dir

    engine = AsyncEngine(EngineConfig(**{**CONFIG, "model": str(tiny_model_dir())}))
    yield engine
    asyncio.run(engine.shutdown())


def _another(engine: AsyncEngine, **kwargs) -> AsyncEngine:
    """A second AsyncEngine on the same loaded weights (its own KV pool and loop)."""
    config = EngineConfig(**{**CONFIG, **kwargs.pop("config", {})})
    loaded = engine.engine_loop.engine.loaded
    return AsyncEngine(config, engine=EngineCore(config, loaded=loaded), **kwargs)


def _wait_idle(engine: AsyncEngine, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats.engine.num_requests_running + stats.engine.num_requests_waiting == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)


def test_generate_streams_deltas_that_add_up_to_the_final_output(engine):
    params = SamplingParams(max_tokens=12, temperature=0)

    async def run():
        deltas = [o async for o in engine.generate("The sky is", params)]
        [final] = [o async for o in engine.generate("The sky is", params, None, FINAL)]
        return deltas, final

    deltas, final = asyncio.run(run())
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    assert len(deltas) > 1
    assert "".join(o.outputs[0].text for o in deltas) == final.outputs[0].text
    tokens = [t for o in deltas for t in o.outputs[0].token_ids]
    assert tokens == final.outputs[0].token_ids and len(tokens) <= 12


def test_a_lagging_reader_gets_one_merged_output(engine):
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)

    async def run():
        stream = await engine.add_request("Once upon a time", params)
        while engine.num_sequences_in_flight:
            await asyncio.sleep(0.05)  # not reading: every delta waits in one merged output
        outputs = [o async for o in stream]
        [final] = [o async for o in engine.generate("Once upon a time", params, None, FINAL)]
        return outputs, final

    outputs, final = asyncio.run(run())
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].outputs[0].token_ids == final.outputs[0].token_ids
    assert outputs[0].outputs[0].text == final.outputs[0].text


@pytest.mark.timeout(600)
def test_an_unread_stream_holds_memory_linear_in_its_output(tiny_engine):
    """1000 tokens nobody reads: one merged delta waits (tens of KB). Allocations are traced
    over the last 300 or so (tracing every step is slow on a loaded machine): a queue of
    cumulative copies would hold ~300 copies of ~850 token ids and their text there (~3 MB).
    The tiny model: what is measured is the frontend's queue, not the model."""
    engine = tiny_engine
    params = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)
    start_tracing_at = 700

    async def run():
        before = engine.stats().engine.num_generation_tokens
        stream = await engine.add_request("Once upon a time", params)
        try:
            while engine.num_sequences_in_flight:
                generated = engine.stats().engine.num_generation_tokens - before
                if generated >= start_tracing_at and not tracemalloc.is_tracing():
                    tracemalloc.start()
                await asyncio.sleep(0.01)
            assert tracemalloc.is_tracing(), "the request ended before tracing started"
            held, _ = tracemalloc.get_traced_memory()
            outputs = [o async for o in stream]
        finally:
            stream.abort()  # a no-op once read; frees the engine if this test is stopped
        return held, outputs

    try:
        held, outputs = asyncio.run(run())
    finally:
        tracemalloc.stop()
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 1000
    assert held < 1 << 20, f"{held} bytes held by an unread 1000-token stream"


def test_closing_the_generator_aborts_and_frees_blocks(engine):
    before = _wait_idle(engine)

    async def run():
        gen = engine.generate("Tell me a story", LONG)
        num_tokens = 0
        async for output in gen:
            num_tokens += len(output.outputs[0].token_ids)
            if num_tokens >= 3:
                break
        await gen.aclose()
        assert engine.stats().engine.kv_cache.num_free_blocks < before.engine.kv_cache.num_blocks

    asyncio.run(run())
    after = _wait_idle(engine)
    assert after.num_requests_aborted == before.num_requests_aborted + 1
    assert after.engine.kv_cache.num_free_blocks == after.engine.kv_cache.num_blocks
    assert after.engine.num_generation_tokens - before.engine.num_generation_tokens < 50


def test_cancelled_task_aborts(engine):
    before = _wait_idle(engine)

    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate("Count to a thousand:", LONG):
            started.set()

    async def run():
        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    after = _wait_idle(engine)
    assert after.num_requests_aborted == before.num_requests_aborted + 1
    assert after.engine.kv_cache.num_free_blocks == after.engine.kv_cache.num_blocks


def test_concurrent_requests_are_batched_and_n_fans_out(engine):
    async def last(prompt, params):
        outputs = [o async for o in engine.generate(prompt, params, None, FINAL)]
        return outputs[-1]

    async def run():
        params = SamplingParams(max_tokens=4, temperature=0)
        singles = [last(f"Number {i}:", params) for i in range(6)]
        pair = last("Pick a colour:", SamplingParams(max_tokens=4, n=2, seed=3))
        return await asyncio.gather(*singles, pair)

    before = _wait_idle(engine).engine
    outputs = asyncio.run(run())
    assert all(o.finished for o in outputs)
    assert [c.index for c in outputs[-1].outputs] == [0, 1]
    after = _wait_idle(engine).engine
    # A request gets at most one token a step: more tokens than steps in this test means
    # some of its steps ran several requests together.
    num_tokens = after.num_generation_tokens - before.num_generation_tokens
    assert num_tokens > after.num_steps - before.num_steps


def test_bad_requests_raise_before_any_output(engine):
    with pytest.raises(ValueError, match="maximum context length"):
        asyncio.run(_first(engine.generate("hi", SamplingParams(max_tokens=5000))))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(_first(engine.generate("", SamplingParams())))


async def _first(gen):
    async for output in gen:
        return output


def test_admission_is_bounded(engine):
    small = _another(engine, config={"max_num_seqs": 1}, max_queue_len=1)
    try:

        async def run():
            first = await small.add_request("a", LONG)
            second = await small.add_request("b", LONG)
            with pytest.raises(EngineOverloadedError, match="overloaded"):
                await small.add_request("c", LONG)
            first.abort()
            second.abort()

        asyncio.run(run())
        assert small.num_requests_rejected == 1
    finally:
        asyncio.run(small.shutdown())


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(engine, monkeypatch):
    monkeypatch.setenv(FAIL_STEPS_ENV, "3")
    flaky = _another(engine)
    try:

        async def run():
            first = await flaky.add_request("Tell me a story", LONG)
            await first.__anext__()  # it is running when step 3 fails
            with pytest.raises(EngineStepError, match="step 3 failed"):
                async for _ in first:
                    pass
            return [o async for o in flaky.generate("hi", SamplingParams(max_tokens=3))]

        outputs = asyncio.run(run())
        assert outputs[-1].finished and flaky.is_healthy
        stats = _wait_idle(flaky)
        assert stats.num_requests_failed == 1 and stats.num_requests_finished == 1
        assert stats.engine.kv_cache.num_free_blocks == stats.engine.kv_cache.num_blocks
    finally:
        asyncio.run(flaky.shutdown())


def test_repeated_step_failures_mark_the_engine_dead(engine, monkeypatch):
    steps = ",".join(str(i) for i in range(1, MAX_CONSECUTIVE_STEP_FAILURES + 1))
    monkeypatch.setenv(FAIL_STEPS_ENV, steps)
    broken = _another(engine)
    try:
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
            with pytest.raises(EngineStepError):
                asyncio.run(_first(broken.generate("hi", SamplingParams(max_tokens=3))))
        deadline = time.monotonic() + 10
        while broken.is_healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not broken.is_healthy and not broken.stats().is_healthy
        assert broken.error is not None
        assert broken.stats().num_requests_failed == MAX_CONSECUTIVE_STEP_FAILURES
        with pytest.raises(EngineDeadError):
            asyncio.run(_first(broken.generate("hi", SamplingParams(max_tokens=3))))
    finally:
        asyncio.run(broken.shutdown())


def test_shutdown_aborts_in_flight_requests(engine):
    other = _another(engine)

    async def run():
        stream = await other.add_request("Tell me everything", LONG)
        await stream.__anext__()
        await other.shutdown(timeout=0.1)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await other.add_request("hi", SamplingParams())

    asyncio.run(run())
    assert not other.is_healthy
    core = other.engine_loop.engine
    assert core.kv_cache.stats().num_free_blocks == core.num_kv_blocks


def test_observers_see_steps_and_finished_requests(engine):
    class Recorder:
        def __init__(self):
            self.steps, self.finished = [], []

        def on_step(self, stats):
            self.steps.append(stats)

        def on_request_finished(self, output):
            self.finished.append(output)

    recorder = Recorder()
    engine.add_observer(recorder)
    try:

        async def run():
            async for _ in engine.generate("One two", SamplingParams(max_tokens=3)):
                pass

        asyncio.run(run())
    finally:
        engine.observers.remove(recorder)
    assert recorder.steps and recorder.finished[-1].finished
    assert recorder.steps[-1].num_generation_tokens >= 1


def test_idle_loop_does_not_spin(engine):
    _wait_idle(engine)
    steps = engine.stats().engine.num_steps
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.1
    assert engine.stats().engine.num_steps == steps and engine.is_healthy
