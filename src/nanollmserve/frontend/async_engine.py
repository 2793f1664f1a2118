"""AsyncEngine: the EngineCore driven by one thread, used from asyncio.

The server's event loop never runs the model. One engine thread owns the EngineCore and the
OutputProcessor: it drains a thread-safe inbox of adds and aborts, calls `step()` while there
is work, turns engine outputs into RequestOutputs, and hands each one to its request's
asyncio queue with `loop.call_soon_threadsafe`. When nothing is running it sleeps on a
condition variable (no busy spin).

    engine = AsyncEngine(EngineConfig(dtype="float32"))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(output.outputs[0].text)  # cumulative text so far

A consumer that goes away (its task cancelled, the generator closed, a client disconnect
turned into `abort()`) aborts the request: its KV blocks return to the pool on the engine
thread's next turn. An exception inside the loop fails every in-flight request with
`EngineDeadError`, logs the traceback and leaves `is_healthy` False; it never dies silently.

Observers (`add_observer`) are called on the engine thread after every step with the
engine's stats and with every finished RequestOutput: the hook for a metrics collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from nanollmserve.config import EngineConfig
from nanollmserve.engine.engine_core import EngineCore, EngineStats
from nanollmserve.frontend.input_processor import InputProcessor
from nanollmserve.frontend.output_processor import OutputProcessor
from nanollmserve.frontend.tokenizer import chat_prompt_token_ids, load_tokenizer
from nanollmserve.outputs import RequestOutput
from nanollmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_LEN = 256

__all__ = [
    "DEFAULT_MAX_QUEUE_LEN",
    "AsyncEngine",
    "EngineDeadError",
    "EngineObserver",
    "EngineOverloadedError",
    "RequestStream",
    "ServingStats",
]


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can run."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (`max_queue_len`); try again later."""


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
    num_requests_failed: int
    peak_running_requests: int
    is_healthy: bool


class RequestStream:
    """The asyncio side of one request: an async iterator of cumulative RequestOutputs.

    Several outputs that pile up while the consumer is busy are merged (they are cumulative,
    so the newest one holds everything). Closing it before the end aborts the request.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, num_seqs: int) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: hand an output (or the error that ends the request) to the consumer."""
        # RuntimeError: the consumer's event loop is closed; nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        while not isinstance(item, BaseException) and not self.queue.empty():
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Abort the request if it is still running (idempotent)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
        chat_template: str | None = None,
        engine: EngineCore | None = None,
    ) -> None:
        self.config = config
        self.engine = engine or EngineCore(config)
        self.tokenizer = load_tokenizer(self.engine.loaded.model_dir)
        self.chat_template = chat_template
        self.max_model_len = self.engine.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_queue_len = max_queue_len
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, self.engine.model_config.vocab_size
        )
        self.output_processor = OutputProcessor(self.tokenizer)  # engine thread only
        self.observers: list[EngineObserver] = []
        self.num_requests_rejected = 0
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, object]] = []  # ("add", (stream, ...)) | ("abort", id)
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._outbox: list[tuple[RequestStream, RequestOutput | BaseException]] = []  # ditto
        self._num_seqs_in_flight = 0  # guarded by _cond
        self._accepting = True
        self._stopping = False
        self._error: BaseException | None = None
        self._counts = {"finished": 0, "aborted": 0, "failed": 0, "peak_running": 0}
        self._stats = self._make_stats(self.engine.stats())
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- what the API layer reads -----------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.loaded.source.name

    @property
    def is_healthy(self) -> bool:
        return self._error is None and not self._stopping and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.is_healthy

    @property
    def num_sequences_in_flight(self) -> int:
        """Sequences admitted and not yet ended (queued in the inbox, waiting or running)."""
        return self._num_seqs_in_flight

    def stats(self) -> ServingStats:
        return self._stats

    def add_observer(self, observer: EngineObserver) -> None:
        self.observers.append(observer)

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        """Render messages with the chat template; a template error is a ValueError."""
        import jinja2

        try:
            return chat_prompt_token_ids(self.tokenizer, messages, self.chat_template)
        except jinja2.TemplateError as exc:
            raise ValueError(f"messages: the chat template failed: {exc}") from None

    def detokenize(self, token_ids: list[int]) -> str:
        self.input_processor.tokenize(token_ids)  # validates the ids
        return self.tokenizer.decode(token_ids)

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> RequestStream:
        """Validate and admit a request now (ValueError, EngineOverloadedError or
        EngineDeadError are raised here, before any output); iterate the returned stream."""
        if not self.is_accepting:
            reason = self._error or "the server is shutting down"
            raise EngineDeadError(f"engine is not accepting requests: {reason}")
        request_id = request_id or f"req-{next(self._ids)}"
        prompt_text, token_ids = self.input_processor.tokenize(prompt)
        children = self.input_processor.make_requests(request_id, token_ids, params)
        stream = RequestStream(self, request_id, len(children))
        with self._cond:
            if self._stopping or self._error is not None:  # the loop may already be gone
                raise EngineDeadError("engine is not accepting requests: it has stopped")
            capacity = self.max_num_seqs + self.max_queue_len
            if self._num_seqs_in_flight + len(children) > capacity:
                self.num_requests_rejected += 1
                raise EngineOverloadedError(
                    f"the server is overloaded ({self._num_seqs_in_flight} sequences in "
                    f"flight, {self.max_num_seqs} running + {self.max_queue_len} waiting "
                    f"allowed); retry later"
                )
            self._num_seqs_in_flight += len(children)
            self._inbox.append(("add", (stream, prompt_text, token_ids, children, params)))
            self._cond.notify()
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs until the last one (`finished`). Leaving early (break,
        cancellation, aclose) aborts the request."""
        stream = self.add_request(prompt, params, request_id)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Thread-safe; unknown or finished ids are ignored."""
        with self._cond:
            self._inbox.append(("abort", request_id))
            self._cond.notify()

    # -- lifecycle --------------------------------------------------------------------------
    def stop_accepting(self) -> None:
        """New requests now fail with EngineDeadError; running ones go on (signal-safe)."""
        self._accepting = False

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` seconds, abort
        the rest, and stop the engine thread."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        while self._num_seqs_in_flight and time.monotonic() < deadline and self.is_healthy:
            await asyncio.sleep(0.05)
        if self._num_seqs_in_flight and self.is_healthy:
            logger.warning(
                "shutdown: aborting %d sequence(s) still running after %.1f s",
                self._num_seqs_in_flight,
                timeout,
            )
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join, 10.0)

    # -- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or self._has_work()):
                        self._cond.wait()
                    commands, self._inbox = self._inbox, []
                    stopping = self._stopping
                self._apply(commands)
                if stopping:
                    self._fail_all(EngineDeadError("the server shut down"), count_as="aborted")
                    break
                stats = self._step() if self._has_work() else self.engine.stats()
                # Stats first, then outputs: a consumer that sees its request end also sees
                # it counted.
                self._stats = self._make_stats(stats)
                self._deliver()
        except BaseException as exc:  # the loop must report, never vanish
            logger.exception("engine loop failed; failing all in-flight requests")
            self._error = exc  # before failing the requests: they must see an unhealthy engine
            self._fail_all(EngineDeadError(f"engine loop failed: {exc!r}"), count_as="failed")
        finally:
            self._stats = self._make_stats(self._last_engine_stats())

    def _last_engine_stats(self) -> EngineStats:
        try:
            return self.engine.stats()
        except Exception:  # a broken engine: keep the last snapshot
            return self._stats.engine

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _apply(self, commands: list[tuple[str, object]]) -> None:
        for kind, payload in commands:
            if kind == "add":
                self._add(*payload)
            else:
                self._abort(payload)

    def _add(self, stream, prompt_text, token_ids, children, params) -> None:
        child_ids = [c.request_id for c in children]
        if stream.request_id in self._streams:
            self._end(stream, ValueError(f"request id {stream.request_id!r} is already running"))
            return
        self.output_processor.add_request(
            stream.request_id, prompt_text, token_ids, child_ids, params, children[0].arrival_time
        )
        self._streams[stream.request_id] = stream
        try:
            for child in children:
                self.engine.add_request(child)
        except ValueError as exc:
            child_ids, _ = self.output_processor.abort_request(stream.request_id)
            self.engine.abort_requests(child_ids)
            self._end(self._streams.pop(stream.request_id), exc)

    def _abort(self, request_id: str) -> None:
        child_ids, final = self.output_processor.abort_request(request_id)
        self.engine.abort_requests(child_ids)
        stream = self._streams.pop(request_id, None)
        if stream is not None and final is not None:
            self._counts["aborted"] += 1
            self._notify("on_request_finished", final)
            self._end(stream, final)

    def _step(self) -> EngineStats:
        engine_outputs = self.engine.step()
        processed = self.output_processor.process_outputs(engine_outputs)
        self.engine.abort_requests(processed.child_ids_to_abort)
        for output in processed.request_outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                self._counts["finished"] += 1
                self._notify("on_request_finished", output)
                self._end(stream, output)
            else:
                self._outbox.append((stream, output))
        stats = self.engine.stats()
        batch_size = max(len(engine_outputs), stats.num_requests_running)
        self._counts["peak_running"] = max(self._counts["peak_running"], batch_size)
        self._notify("on_step", stats)
        return stats

    def _end(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        """The last item of a request: it leaves the in-flight count."""
        with self._cond:
            self._num_seqs_in_flight -= stream.num_seqs
        self._outbox.append((stream, item))

    def _deliver(self) -> None:
        outbox, self._outbox = self._outbox, []
        for stream, item in outbox:
            stream.put(item)

    def _fail_all(self, error: BaseException, count_as: str) -> None:
        """End every request with `error`; the stats say so before any consumer hears."""
        streams = list(self._streams.values())
        for stream in streams:
            try:
                child_ids, _ = self.output_processor.abort_request(stream.request_id)
                self.engine.abort_requests(child_ids)
            except Exception:  # the engine may be broken; the stream still fails
                logger.exception("could not abort %s", stream.request_id)
        self._streams.clear()
        with self._cond:  # adds that arrived after the last drain
            leftovers, self._inbox = self._inbox, []
        streams += [payload[0] for kind, payload in leftovers if kind == "add"]
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

    def _make_stats(self, engine_stats: EngineStats) -> ServingStats:
        counts = self._counts
        return ServingStats(
            engine=engine_stats,
            num_requests_finished=counts["finished"],
            num_requests_aborted=counts["aborted"],
            num_requests_failed=counts["failed"],
            peak_running_requests=counts["peak_running"],
            is_healthy=self._error is None,
        )
