"""EngineLoop: the one thread that drives the EngineCore for the AsyncEngine.

The thread builds and owns the EngineCore and the OutputProcessor; nothing else touches
them. It builds them itself because PyTorch's CPU thread pool (OpenMP) belongs to the thread
that first runs a parallel op: a model loaded on the main thread and stepped on another
runs its kernels about 1.5x slower (measured: a bf16 decode step 18.5 ms on the loading
thread, 28 ms on another). Each turn
it drains a thread-safe inbox of typed commands (`Add | Abort | Sleep | Wake | SlotCall`,
`engine_commands.py`; anything else is refused when queued), runs one `step()` if any request is
unfinished, publishes a stats snapshot, then hands the step's outputs to their request
streams (so a consumer that sees its request end also sees it counted). With nothing to do
it sleeps on a condition variable: no busy spin.

Observers are called on this thread after every step (`on_step(EngineStats)`) and for every
request that ends, finished or aborted (`on_request_finished(RequestOutput)`, the full final
output): the hook for a metrics collector.

A request whose own sampling raised ends alone inside the step (finish reason "error",
counted as failed; `engine/model_runner.py`), so a client cannot fail a step by what it
sends. A step that raises (the forward pass) fails every request in the engine with
`EngineStepError` (a 500: what the step left in the KV cache cannot be trusted), logs the
traceback, resets the engine's scheduling state (queues, block tables, prefix cache; the
model and the KV tensor stay) and goes on with the requests that arrive next. After
`MAX_CONSECUTIVE_STEP_FAILURES` failed steps in a row, or at once for an `EngineFatalError`
(a tensor-parallel rank died, even while the loop sleeps), the fault is taken to be
permanent: the loop stops, unhealthy, failing what is left with `EngineDeadError`, and
`nanollmserve serve` exits with status 1 so its supervisor restarts it.
`NANOLLMSERVE_FAIL_STEPS=5,6` (step numbers, counted from 1) makes those steps raise, to test this.

Slots (`engine/slot_save.py`): the loop gives each request it admits a sequence place
(`SlotTable`: the lowest free one, or the first to free up) and, when it finishes, the place
remembers its tokens; a `SlotCall` (llama.cpp's slot save / restore / erase) runs on this
thread between steps, refused while the engine sleeps.

Sleep mode (`sleep`, `wake_up`; docs/features/sleep-mode.md): a sleep command waits on this
thread until no request is in the engine (with `abort`, it ends them first), then frees the
KV pool (level 2: the weights too). From the command on, new requests end with
EngineSleepingError (a 503) until `wake_up`. With `sleep_idle_seconds` the loop also sleeps
by itself after that long with nothing to do, and then the next request wakes it and runs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from nanollmserve.engine.engine_core import EngineCore, EngineStats
from nanollmserve.engine.errors import EngineFatalError
from nanollmserve.engine.slot_save import SlotTable
from nanollmserve.errors import UserError
from nanollmserve.frontend.admission import AdmittedRequest
from nanollmserve.frontend.engine_commands import (
    COMMAND_TYPES,
    Abort,
    Add,
    EngineCommand,
    Sleep,
    SlotCall,
    UnknownCommandError,
    Wake,
)
from nanollmserve.frontend.engine_driver import EngineDriver
from nanollmserve.frontend.tokenizer import load_tokenizer
from nanollmserve.outputs import RequestOutput

if TYPE_CHECKING:
    from nanollmserve.frontend.async_engine import RequestStream

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
FAIL_STEPS_ENV = "NANOLLMSERVE_FAIL_STEPS"


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can run."""


class EngineDrainingError(EngineDeadError):
    """The server is draining (SIGTERM): it admits no new request while the running ones
    finish within `--shutdown-timeout`; another replica should take it (a 503)."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was in the engine (an internal error)."""


class InjectedStepFailure(RuntimeError):
    """Raised by the steps named in NANOLLMSERVE_FAIL_STEPS (fault-injection tests)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`max_queue_len`); try again later."""


class EngineSleepingError(RuntimeError):
    """The engine was put to sleep (`POST /sleep`); it serves again after `POST /wake_up`."""


class EngineObserver(Protocol):
    """Called on the engine thread; must be quick and must not touch the engine."""

    def on_step(self, stats: EngineStats) -> None: ...

    def on_request_finished(self, output: RequestOutput) -> None: ...


@dataclass(frozen=True)
class ServingStats:
    """A consistent snapshot published by the engine thread; safe to read from any thread."""

    engine: EngineStats
    num_requests_finished: int
    num_requests_aborted: int
    """Ended early: consumer gone, client disconnected, or shut down."""
    num_requests_failed: int
    peak_running_requests: int
    """The largest batch of one step so far."""
    is_healthy: bool


class EngineLoop:
    def __init__(
        self, build_engine: Callable[[], EngineCore], sleep_idle_seconds: float | None = None
    ) -> None:
        """Start the thread; it runs `build_engine()`. Returns once the engine is built, or
        raises what building it raised (a bad --model, say). `sleep_idle_seconds`: sleep
        after that long with nothing to do (None: never by itself)."""
        self.observers: list[EngineObserver] = []
        self.num_requests_rejected = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._inbox: list[EngineCommand] = []  # guarded by _cond
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._outbox: list[tuple[RequestStream, RequestOutput | BaseException]] = []  # ditto
        self._num_seqs_in_flight = 0  # guarded by _cond
        self._stopping = False
        self._counts = {"finished": 0, "aborted": 0, "failed": 0, "peak_running": 0}
        self._num_steps = 0
        self._num_failed_steps_in_a_row = 0
        self._fail_steps = _parse_fail_steps(os.environ.get(FAIL_STEPS_ENV, ""))
        self._built = threading.Event()
        self.sleep_idle_seconds = sleep_idle_seconds
        self.sleep_requested = False
        """A sleep command came and no wake_up since: new requests are refused."""
        self._pending_sleeps: list[tuple[int, Future]] = []  # engine thread only
        self._slept_when_idle = False
        self._last_active = time.monotonic()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(build_engine,), name="engine-loop", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    # -- any thread ---------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self.error is None and not self._stopping and self._thread.is_alive()

    @property
    def num_seqs_in_flight(self) -> int:
        return self._num_seqs_in_flight

    def stats(self) -> ServingStats:
        return self._stats

    def add(self, stream: RequestStream, request: AdmittedRequest, *, capacity: int) -> None:
        """Queue an admitted request (its `n` child requests) for the engine thread, or
        raise if the loop is gone or more than `capacity` sequences would be in flight."""
        with self._cond:
            if self._stopping or self.error is not None:
                raise EngineDeadError("engine is not accepting requests: it has stopped")
            if self._num_seqs_in_flight + stream.num_seqs > capacity:
                self.num_requests_rejected += 1
                raise EngineOverloadedError(
                    f"the server is overloaded ({self._num_seqs_in_flight} sequences in "
                    f"flight, at most {capacity} allowed); retry later"
                )
            self._num_seqs_in_flight += stream.num_seqs
            self.send(Add(stream, request))

    def abort(self, request_id: str) -> None:
        """Unknown or finished ids are ignored."""
        with self._cond:
            self.send(Abort(request_id))

    def send(self, command: EngineCommand) -> None:
        """Queue a typed command for the engine thread (what `add`, `abort`, `sleep` and
        `wake_up` do, after their checks); UnknownCommandError for anything else, here, in
        the caller's thread."""
        if not isinstance(command, COMMAND_TYPES):
            raise UnknownCommandError(f"not an engine-loop command: {command!r}")
        with self._cond:  # re-entrant: the callers above hold it already
            self._inbox.append(command)
            self._cond.notify()

    @property
    def is_sleeping(self) -> bool:
        return self.engine.sleep_level is not None

    def sleep(self, level: int, abort: bool) -> Future:
        """Queue a sleep at `level` (EngineCore.sleep); the future is done once the engine
        sleeps: when its requests have finished, or at once with `abort` (they end with
        EngineSleepingError). New requests are refused from now on."""
        done: Future = Future()
        with self._cond:
            if self._stopping or self.error is not None:
                raise EngineDeadError("engine is not accepting requests: it has stopped")
            self.sleep_requested = True
            self.send(Sleep(level, abort, done))
        return done

    def wake_up(self) -> Future:
        """Queue a wake-up; the future is done once the engine can serve again."""
        done: Future = Future()
        with self._cond:
            self.sleep_requested = False
            self.send(Wake(done))
        return done

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------
    def _build(self, build_engine: Callable[[], EngineCore]) -> bool:
        try:
            self.engine = build_engine()
            self.tokenizer = load_tokenizer(
                self.engine.config.tokenizer or self.engine.loaded.model_dir
            )
            self.driver = EngineDriver(self.engine, self.tokenizer)
            self.engine.add_failure_listener(self._on_engine_failure)
            self.slots = SlotTable(self.engine.config.max_num_seqs)
            self._stats = self._make_stats(self.engine.stats())
        except BaseException as exc:
            self._build_error = exc
        finally:
            self._built.set()
        return self._build_error is None

    def _run(self, build_engine: Callable[[], EngineCore]) -> None:
        if not self._build(build_engine):
            return
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or self._has_work() or self.error):
                        timeout = self._idle_sleep_timeout()
                        if timeout is not None and timeout <= 0:
                            break
                        self._cond.wait(timeout)
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                if self.error is not None:  # set by _on_engine_failure
                    raise self.error
                self._apply(commands)
                if stopping:
                    self._fail_all(EngineDeadError("the server shut down"), count_as="aborted")
                    break
                if self._has_work():
                    try:
                        self._step()
                    except EngineFatalError:
                        raise
                    except Exception as exc:
                        self._recover(exc)
                self._settle_sleep()
                self._stats = self._make_stats(self.engine.stats())
                self._deliver()
        except BaseException as exc:  # the loop must report, never vanish
            logger.exception("engine loop failed; failing all in-flight requests")
            self.error = exc  # before failing the requests: they must see an unhealthy engine
            self._fail_all(EngineDeadError(f"engine loop failed: {exc!r}"), count_as="failed")
        finally:
            for _, done in self._pending_sleeps:
                done.set_exception(EngineDeadError("the engine stopped before it could sleep"))
            self._stats = self._make_stats(self._last_engine_stats())
            self.engine.shutdown()

    def _on_engine_failure(self, error: EngineFatalError) -> None:
        """From the tensor-parallel monitor thread: a rank died. The engine is unhealthy from
        now on (the server exits) and the loop wakes to fail what is in flight."""
        with self._cond:
            self.error = error
            self._cond.notify()

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _apply(self, commands: list[EngineCommand]) -> None:
        if commands:
            self._last_active = time.monotonic()
        for command in commands:
            match command:
                case Add(stream, request):
                    self._add(stream, request)
                case Abort(request_id):
                    self._abort(request_id)
                case Sleep(level, abort, done):
                    self._queue_sleep(level, abort, done)
                case Wake(done):
                    self._wake_up(done)
                case SlotCall(fn, done):
                    self._slot_call(fn, done)
                case _:  # `send` refuses these: reaching here is a bug
                    raise UnknownCommandError(f"not an engine-loop command: {command!r}")

    def _add(self, stream: RequestStream, request: AdmittedRequest) -> None:
        request_id = stream.request_id
        if self._pending_sleeps or (self.is_sleeping and not self._slept_when_idle):
            self._end(stream, EngineSleepingError("the server is sleeping; retry later"))
            return
        if self.is_sleeping:  # it slept by itself: the request wakes it and runs
            logger.info("a request arrived: waking up")
            self._wake_engine()
        try:  # a ParamError too if the id is already running (the driver checks)
            self.driver.add_request(request)
        except ValueError as exc:
            self._end(stream, exc)
            return
        self._streams[request_id] = stream
        params = request.params
        self.slots.assign(request_id, request.lora_name is None and params.cache_salt is None)

    def _slot_call(self, fn: Callable, done: Future) -> None:
        if self.is_sleeping or self._pending_sleeps:
            done.set_exception(EngineSleepingError("the server is sleeping; retry later"))
            return
        try:
            done.set_result(fn(self.engine, self.slots))
        except Exception as exc:  # the caller's error (a refused file): the loop goes on
            done.set_exception(exc)

    def _abort(self, request_id: str) -> None:
        aborted = self.driver.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and aborted is not None:
            self._counts["aborted"] += 1
            self._notify("on_request_finished", aborted.final_output)
            self._end(stream, aborted.output)

    # -- sleep mode (the engine thread) ---------------------------------------------------------
    def _queue_sleep(self, level: int, abort: bool, done: Future) -> None:
        self._pending_sleeps.append((level, done))
        if abort:
            error = EngineSleepingError("aborted: the server is sleeping (mode=abort)")
            self._fail_all(error, count_as="aborted", include_inbox=False)

    def _wake_up(self, done: Future) -> None:
        """Wake the engine; a sleep still waiting for requests to finish is called off."""
        for _, pending in self._pending_sleeps:
            pending.set_exception(EngineSleepingError("called off by a wake_up"))
        self._pending_sleeps = []
        try:
            self._wake_engine()
        except Exception as exc:
            logger.exception("waking the engine failed")
            done.set_exception(exc)
        else:
            done.set_result(None)

    def _wake_engine(self) -> None:
        if self.is_sleeping:
            started = time.perf_counter()
            self.engine.wake_up()
            logger.info("woke up in %.2f s", time.perf_counter() - started)
        self._slept_when_idle = False
        self._last_active = time.monotonic()

    def _idle_sleep_timeout(self) -> float | None:
        """Seconds until the loop sleeps by itself (<= 0: now), None if it will not."""
        if self.sleep_idle_seconds is None or self.is_sleeping or self._pending_sleeps:
            return None
        return self._last_active + self.sleep_idle_seconds - time.monotonic()

    def _settle_sleep(self) -> None:
        """With no request in the engine: sleep as asked, or when idle long enough."""
        if self._has_work():
            self._last_active = time.monotonic()
            return
        if self._pending_sleeps:
            pending, self._pending_sleeps = self._pending_sleeps, []
            level = max(level for level, _ in pending)
            try:
                self._sleep_engine(level)
            except Exception as exc:
                for _, done in pending:
                    done.set_exception(exc)
            else:
                for _, done in pending:
                    done.set_result(None)
            return
        timeout = self._idle_sleep_timeout()
        if timeout is not None and timeout <= 0:
            level = 2
            try:
                self.engine.check_sleep(level)
            except UserError:
                level = 1
            logger.info("idle for %.0f s: sleeping (level %d)", self.sleep_idle_seconds, level)
            self._sleep_engine(level)
            self._slept_when_idle = True

    def _sleep_engine(self, level: int) -> None:
        started = time.perf_counter()
        self.engine.sleep(level)
        self._slept_when_idle = False
        logger.info("asleep (level %d) in %.2f s", level, time.perf_counter() - started)

    def _step(self) -> None:
        self._num_steps += 1
        if self._num_steps in self._fail_steps:
            raise InjectedStepFailure(f"step {self._num_steps} failed ({FAIL_STEPS_ENV})")
        step = self.driver.step()
        self._num_failed_steps_in_a_row = 0
        for final in step.finished:
            failed = any(c.finish_reason == "error" for c in final.outputs)
            self._counts["failed" if failed else "finished"] += 1
            self._notify("on_request_finished", final)
            if not failed and final.outputs:
                self.slots.record(
                    final.request_id, final.prompt_token_ids, final.outputs[0].token_ids
                )
        for output in step.outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                self._end(stream, output)
            else:
                self._outbox.append((stream, output))
        stats = self.engine.stats()
        batch_size = max(step.num_engine_outputs, stats.num_requests_running)
        self._counts["peak_running"] = max(self._counts["peak_running"], batch_size)
        self._notify("on_step", stats)

    def _recover(self, exc: Exception) -> None:
        """A step raised: fail the requests in the engine, reset its state, go on; or, after
        too many failures in a row, re-raise (the loop then stops, unhealthy)."""
        self._num_failed_steps_in_a_row += 1
        failures = self._num_failed_steps_in_a_row
        logger.error(
            "engine step failed (%d in a row); failing the requests in the engine",
            failures,
            exc_info=exc,
        )
        error = EngineStepError(f"the engine step failed: {exc!r}")
        self._fail_all(error, count_as="failed", include_inbox=False)
        if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise exc
        self.engine.reset()

    def _end(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        """The last item of a request: it leaves the in-flight count."""
        with self._cond:
            self._num_seqs_in_flight -= stream.num_seqs
        self.slots.release(stream.request_id)
        self._outbox.append((stream, item))

    def _deliver(self) -> None:
        outbox, self._outbox = self._outbox, []
        for stream, item in outbox:
            stream.put(item)

    def _fail_all(self, error: BaseException, count_as: str, include_inbox: bool = True) -> None:
        """End every request with `error` (with `include_inbox`, also those not yet taken
        from the inbox); the stats say so before any consumer hears."""
        streams = list(self._streams.values())
        for stream in streams:
            try:
                self.driver.abort_request(stream.request_id)
            except Exception:  # the engine may be broken; the stream still fails
                logger.exception("could not abort %s", stream.request_id)
        self._streams.clear()
        if include_inbox:
            with self._cond:  # adds that arrived after the last drain
                leftovers, self._inbox = self._inbox, []
            streams += [command.stream for command in leftovers if isinstance(command, Add)]
        self._counts[count_as] += len(streams)
        for stream in streams:
            self._end(stream, error)
        self._stats = self._make_stats(self._last_engine_stats())
        self._deliver()

    def _notify(self, method: str, arg) -> None:
        for observer in self.observers:
            try:
                getattr(observer, method)(arg)
            except Exception:  # an observer never breaks the loop
                logger.exception("observer %r failed in %s", observer, method)

    def _last_engine_stats(self) -> EngineStats:
        try:
            return self.engine.stats()
        except Exception:  # a broken engine: keep the last snapshot
            return self._stats.engine

    def _make_stats(self, engine_stats: EngineStats) -> ServingStats:
        counts = self._counts
        return ServingStats(
            engine=engine_stats,
            num_requests_finished=counts["finished"],
            num_requests_aborted=counts["aborted"],
            num_requests_failed=counts["failed"],
            peak_running_requests=counts["peak_running"],
            is_healthy=self.error is None,
        )


def _parse_fail_steps(value: str) -> frozenset[int]:
    try:
        return frozenset(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        logger.warning(
            "ignoring %s=%r: not a comma-separated list of step numbers", FAIL_STEPS_ENV, value
        )
        return frozenset()
