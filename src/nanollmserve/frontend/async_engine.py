"""AsyncEngine: the EngineCore used from asyncio, the one thing the API layer talks to.

The server's event loop never runs the model: an EngineLoop thread (`engine_loop.py`) owns
the EngineCore and hands each request's outputs to its RequestStream, an asyncio queue fed
with `loop.call_soon_threadsafe`. This side tokenizes, validates and admits requests.

    engine = AsyncEngine(EngineConfig(dtype="float32"))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(output.outputs[0].text)  # cumulative text so far

A consumer that goes away (its task cancelled, the generator closed, a client disconnect
turned into `abort()`) aborts the request: its KV blocks return to the pool on the engine
thread's next turn. Admission is bounded: at most `max_num_seqs + max_queue_len` sequences
(an `n`-choice request counts `n`) are in flight; beyond that `add_request` raises
EngineOverloadedError. Observers (`add_observer`) see every step and every ended request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator

from nanollmserve.config import EngineConfig
from nanollmserve.engine.engine_core import EngineCore
from nanollmserve.frontend.engine_loop import (
    EngineDeadError,
    EngineLoop,
    EngineObserver,
    EngineOverloadedError,
    ServingStats,
)
from nanollmserve.frontend.input_processor import InputProcessor
from nanollmserve.frontend.tokenizer import chat_prompt_token_ids
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


class RequestStream:
    """The asyncio side of one request: an async iterator of cumulative RequestOutputs.

    Outputs that pile up while the consumer is busy are merged (they are cumulative, so the
    newest holds everything). `abort()` before the end aborts the request.
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
        self.engine_loop = EngineLoop(lambda: engine or EngineCore(config))
        self.engine = self.engine_loop.engine
        self.tokenizer = self.engine_loop.tokenizer
        self.chat_template = chat_template
        self.max_model_len = self.engine.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_queue_len = max_queue_len
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, self.engine.model_config.vocab_size
        )
        self._ids = itertools.count()
        self._accepting = True

    # -- what the API layer reads ---------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.loaded.source.name

    @property
    def is_healthy(self) -> bool:
        return self.engine_loop.is_running

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.engine_loop.is_running

    @property
    def num_sequences_in_flight(self) -> int:
        """Sequences admitted and not yet ended (queued for the engine thread, waiting or
        running)."""
        return self.engine_loop.num_seqs_in_flight

    @property
    def num_requests_rejected(self) -> int:
        return self.engine_loop.num_requests_rejected

    @property
    def observers(self) -> list[EngineObserver]:
        return self.engine_loop.observers

    def stats(self) -> ServingStats:
        return self.engine_loop.stats()

    def add_observer(self, observer: EngineObserver) -> None:
        """`observer.on_step(EngineStats)` after every step and
        `observer.on_request_finished(RequestOutput)` for every ended request, both called on
        the engine thread."""
        self.engine_loop.observers.append(observer)

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

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
    ) -> RequestStream:
        """Validate and admit a request now and return its stream. Raises ValueError (bad
        input), EngineOverloadedError (queue full) or EngineDeadError (stopped) here, before
        any output, so a server can still answer with an error status."""
        if not self.is_accepting:
            reason = self.engine_loop.error or "the server is shutting down"
            raise EngineDeadError(f"engine is not accepting requests: {reason}")
        request_id = request_id or f"req-{next(self._ids)}"
        prompt_text, token_ids = self.input_processor.tokenize(prompt)
        children = self.input_processor.make_requests(request_id, token_ids, params)
        stream = RequestStream(self, request_id, len(children))
        capacity = self.max_num_seqs + self.max_queue_len
        self.engine_loop.add(stream, children, prompt_text, token_ids, params, capacity=capacity)
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
        self.engine_loop.abort(request_id)

    # -- lifecycle ------------------------------------------------------------------------------
    def stop_accepting(self) -> None:
        """New requests now fail with EngineDeadError; running ones go on (signal-safe)."""
        self._accepting = False

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` seconds, then
        abort the rest and stop the engine thread."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        while self.num_sequences_in_flight and self.is_healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.num_sequences_in_flight and self.is_healthy:
            logger.warning(
                "shutdown: aborting %d sequence(s) still running after %.1f s",
                self.num_sequences_in_flight,
                timeout,
            )
        await asyncio.to_thread(self.engine_loop.stop)
