"""AsyncEngine in-process (bundled model): outputs stream through per-request queues, a
consumer that leaves aborts its request and frees its blocks at once, admission is bounded,
an engine failure fails in-flight requests and marks the engine unhealthy, shutdown aborts
what is left, observers see every step and finished request, and an idle loop sleeps."""

from __future__ import annotations

import asyncio
import time

import pytest

from nanollmserve.config import EngineConfig
from nanollmserve.engine.engine_core import EngineCore
from nanollmserve.frontend.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
)
from nanollmserve.sampling_params import SamplingParams

pytestmark = pytest.mark.milestone("m02")

CONFIG = dict(dtype="float32", num_kv_blocks=64)
LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(EngineConfig(**CONFIG))
    yield engine
    asyncio.run(engine.shutdown())


def _another(engine: AsyncEngine, **kwargs) -> AsyncEngine:
    """A second AsyncEngine on the same loaded weights (its own KV pool and loop)."""
    config = EngineConfig(**{**CONFIG, **kwargs.pop("config", {})})
    return AsyncEngine(config, engine=EngineCore(config, loaded=engine.engine.loaded), **kwargs)


def _wait_idle(engine: AsyncEngine, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats.engine.num_requests_running + stats.engine.num_requests_waiting == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)


def test_generate_streams_cumulative_outputs(engine):
    async def run():
        return [o async for o in engine.generate("The sky is", SamplingParams(max_tokens=6))]

    outputs = asyncio.run(run())
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    texts = [o.outputs[0].text for o in outputs]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
    assert len(outputs[-1].outputs[0].token_ids) <= 6


def test_closing_the_generator_aborts_and_frees_blocks(engine):
    before = _wait_idle(engine)

    async def run():
        gen = engine.generate("Tell me a story", LONG)
        async for output in gen:
            if len(output.outputs[0].token_ids) >= 3:
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

    async def consume():
        async for _ in engine.generate("Count to a thousand:", LONG):
            pass

    async def run():
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    after = _wait_idle(engine)
    assert after.num_requests_aborted == before.num_requests_aborted + 1
    assert after.engine.kv_cache.num_free_blocks == after.engine.kv_cache.num_blocks


def test_concurrent_requests_are_batched_and_n_fans_out(engine):
    async def last(prompt, params):
        outputs = [o async for o in engine.generate(prompt, params)]
        return outputs[-1]

    async def run():
        params = SamplingParams(max_tokens=4, temperature=0)
        singles = [last(f"Number {i}:", params) for i in range(6)]
        pair = last("Pick a colour:", SamplingParams(max_tokens=4, n=2, seed=3))
        return await asyncio.gather(*singles, pair)

    outputs = asyncio.run(run())
    assert all(o.finished for o in outputs)
    assert [c.index for c in outputs[-1].outputs] == [0, 1]
    assert engine.stats().peak_running_requests > 1


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
            first = small.add_request("a", LONG)
            second = small.add_request("b", LONG)
            with pytest.raises(EngineOverloadedError, match="overloaded"):
                small.add_request("c", LONG)
            first.abort()
            second.abort()

        asyncio.run(run())
        assert small.num_requests_rejected == 1
    finally:
        asyncio.run(small.shutdown())


def test_engine_failure_fails_requests_and_marks_unhealthy(engine):
    broken = _another(engine)

    def explode():
        raise RuntimeError("boom")

    broken.engine.step = explode
    try:
        with pytest.raises(EngineDeadError, match="boom"):
            asyncio.run(_first(broken.generate("hi", SamplingParams(max_tokens=3))))
        assert not broken.is_healthy and not broken.stats().is_healthy
        assert broken.stats().num_requests_failed == 1
        with pytest.raises(EngineDeadError):
            asyncio.run(_first(broken.generate("hi", SamplingParams(max_tokens=3))))
    finally:
        asyncio.run(broken.shutdown())


def test_shutdown_aborts_in_flight_requests(engine):
    other = _another(engine)

    async def run():
        stream = other.add_request("Tell me everything", LONG)
        await stream.__anext__()
        await other.shutdown(timeout=0.1)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            other.add_request("hi", SamplingParams())

    asyncio.run(run())
    assert not other.is_healthy
    assert other.engine.kv_cache.stats().num_free_blocks == other.engine.num_kv_blocks


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
