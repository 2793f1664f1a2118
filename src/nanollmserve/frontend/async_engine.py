"""AsyncEngine: the EngineCore used from asyncio, the one thing the API layer talks to.

The server's event loop never runs the model, nor the tokenizer: an EngineLoop thread
(`engine_loop.py`) owns the EngineCore and hands each request's outputs to its RequestStream,
and tokenization and chat templating run on one worker thread (`asyncio.to_thread`-style, a
single-thread executor, as the tokenizer is not made for concurrent calls), so a multi-MB
prompt never stalls `/health` or other streams. This side admits requests, through its
`Admission` (`admission.py`: the `RequestPolicy` given to the constructor, the limits, the
model's limits), and hands each on to the engine loop as one `AdmittedRequest`.

    engine = AsyncEngine(EngineConfig(dtype="float32"))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=8)):
        print(output.outputs[0].text)  # the new text of this step (a DELTA output)

A request's outputs are DELTA outputs (only what is new) for streaming, or one FINAL_ONLY
output (`output_kind=`). A RequestStream holds at most one pending output: deltas that
arrive while the consumer is busy (or not reading at all) are merged into it, so a stalled
reader costs memory proportional to its unread text, never a copy per step.

A consumer that goes away (its task cancelled, the generator closed, a client disconnect
turned into `abort()`) aborts the request: its KV blocks return to the pool on the engine
thread's next turn. Admission is bounded: at most `max_num_seqs + max_queue_len` sequences
(an `n`-choice request counts `n`) are in flight, those still being tokenized or compiled
included; beyond that `add_request` (and `chat_token_ids`) raise EngineOverloadedError before
doing any work, and the tokenizer thread's queue is bounded by the same number. A request's
grammar compiles on the grammar workers (`grammar_pool.py`), within its deadline, never on
the tokenizer thread. Observers (`add_observer`) see every step and every ended request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from nanollmserve.config import EngineConfig
from nanollmserve.engine import slot_save
from nanollmserve.engine.engine_core import EngineCore
from nanollmserve.errors import ParamError, UserError
from nanollmserve.frontend.admission import Admission
from nanollmserve.frontend.engine_commands import SlotCall
from nanollmserve.frontend.engine_loop import (
    EngineDeadError,
    EngineDrainingError,
    EngineLoop,
    EngineObserver,
    EngineOverloadedError,
    EngineSleepingError,
    EngineStepError,
    ServingStats,
)
from nanollmserve.frontend.grammar_pool import GrammarCompilePool
from nanollmserve.frontend.input_processor import InputProcessor
from nanollmserve.frontend.request_policy import RequestPolicy
from nanollmserve.frontend.tokenizer import chat_prompt_token_ids
from nanollmserve.kv_transfer import KVTransferResult
from nanollmserve.outputs import OutputKind, RequestOutput
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.structured_output_limits import StructuredOutputLimits

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_LEN = 256
KV_HANDOFF_TIMEOUT_S = 30.0
"""Longest phase 1 of prefill/decode disaggregation waits for its blocks' writes: past it,
it answers with the blocks durable by then (the decode worker computes the rest)."""

T = TypeVar("T")

__all__ = [
    "DEFAULT_MAX_QUEUE_LEN",
    "AsyncEngine",
    "EngineDeadError",
    "EngineDrainingError",
    "EngineInfo",
    "EngineObserver",
    "EngineOverloadedError",
    "EngineSleepingError",
    "EngineStepError",
    "OutputKind",
    "RequestStream",
    "ServingStats",
]


@dataclass(frozen=True)
class EngineInfo:
    """What the engine is, fixed at start: what the API and the CLI may read about it."""

    model_name: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    device: str
    dtype: str
    quantization: str | None
    model_dir: str = ""
    """The HF directory the weights come from (generation_config.json, ...)."""
    runner: str = "generate"
    """generate, or pooling: the engine embeds prompts (/v1/embeddings) and generates nothing."""


class RequestStream:
    """The asyncio side of one request: an async iterator of its RequestOutputs.

    The engine thread `put`s outputs; at most one waits here, merged with the newer ones
    (DELTA outputs are added together, a FINAL_ONLY output is the only one there is). An
    error ends the stream after the output that was pending. `abort()` before the end aborts
    the request.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, num_seqs: int) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_seqs = num_seqs
        self.loop = asyncio.get_running_loop()
        self.finished = False
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: hand an output (or the error that ends the request) to the consumer."""
        with self._lock:
            was_empty = self._pending is None and self._error is None
            if isinstance(item, BaseException):
                self._error = item
            elif self._pending is None:
                self._pending = item
            else:
                self._pending.add(item)
        if was_empty:
            # RuntimeError: the consumer's event loop is closed; nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._ready.set)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self.finished:
            with self._lock:
                output, self._pending = self._pending, None
                error = self._error if output is None else None
                self._ready.clear()
            if output is not None:
                self.finished = output.finished
                return output
            if error is not None:
                self.finished = True
                raise error
            await self._ready.wait()
        raise StopAsyncIteration

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
        structured_output_limits: StructuredOutputLimits | None = None,
        sleep_idle_seconds: float | None = None,
        request_policy: RequestPolicy | None = None,
        default_chat_template_kwargs: dict | None = None,
    ) -> None:
        """`request_policy`: the limits and generation defaults every request is held to,
        whatever its frontend (built from the serve settings; completed for the model once
        it is loaded, `RequestPolicy.for_model`). `default_chat_template_kwargs`: template
        variables of every chat that does not set them (`--default-chat-template-kwargs`)."""
        self.config = config
        self.engine_loop = EngineLoop(lambda: engine or EngineCore(config), sleep_idle_seconds)
        self.kv_transport = None
        """`serve --kv-transfer ray`: the KV blocks of prefill/decode disaggregation go through
        Ray's object store (`engine/kv_ray_transfer.RayKVTransfer`); None: the shared store."""
        core = self.engine_loop.engine
        if sleep_idle_seconds is not None:
            try:
                core.check_sleep(1)
            except UserError:
                self.engine_loop.stop()
                raise
        self.info = EngineInfo(
            model_name=core.loaded.source.name,
            max_model_len=core.max_model_len,
            max_num_seqs=config.max_num_seqs,
            vocab_size=core.model_config.vocab_size,
            num_kv_blocks=core.num_kv_blocks,
            block_size=config.block_size,
            device=str(core.device),
            dtype=str(core.dtype).removeprefix("torch."),
            quantization=core.loaded.quantization,
            model_dir=str(core.loaded.model_dir),
            runner=config.runner,
        )
        self.tokenizer = self.engine_loop.tokenizer
        self.chat_template = chat_template
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        self.max_model_len = self.info.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_queue_len = max_queue_len
        grammar_limits = structured_output_limits or StructuredOutputLimits()
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.max_model_len,
            self.info.vocab_size,
            core.eos_token_ids,
            grammar_limits=grammar_limits,
            scheduling_policy=config.scheduling_policy,
            pooling=config.runner == "pooling",
            max_client_priority=config.max_client_priority,
        )
        self.grammar_pool = GrammarCompilePool(
            self.input_processor.grammar_compiler, grammar_limits
        )
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._admission_lock = threading.Lock()
        self._num_tokenizer_jobs = 0  # queued or running on the tokenizer thread
        self._num_seqs_preparing = 0  # admitted, being tokenized / compiled
        try:
            policy = (request_policy or RequestPolicy()).for_model(
                self.info.model_dir, config.max_num_seqs
            )
        except UserError:
            self.engine_loop.stop()
            raise
        self.admission = Admission(policy, self.input_processor)
        self._ids = itertools.count()
        self._accepting = True

    # -- what the API layer reads ---------------------------------------------------------------
    @property
    def request_policy(self) -> RequestPolicy:
        """Limits and generation defaults every request is held to, whatever its frontend."""
        return self.admission.policy

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def is_healthy(self) -> bool:
        return self.engine_loop.is_running

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine loop for good (None while it runs or after a shutdown)."""
        return self.engine_loop.error

    @property
    def is_accepting(self) -> bool:
        return self._accepting and self.engine_loop.is_running

    @property
    def is_draining(self) -> bool:
        """`stop_accepting` was called (SIGTERM) and the engine still runs: requests in
        flight finish, new ones get EngineDrainingError (a 503)."""
        return not self._accepting and self.engine_loop.is_running

    def not_ready_reason(self) -> tuple[str, str] | None:
        """Why the server should get no traffic now, as (message, code), or None when it is
        ready: the engine failed or stopped, the server drains, or `POST /sleep` holds (an
        engine asleep by itself, `--sleep-idle-seconds`, is ready: a request wakes it).
        What `GET /ready` answers, the readiness probe of docs/features/distributed.md."""
        if self.is_draining:
            return "the server is draining (shutting down)", "draining"
        if not self.is_accepting:
            return "engine is not available", "engine_unavailable"
        if self.sleep_requested:
            return "the server is sleeping (POST /wake_up wakes it)", "engine_sleeping"
        return None

    @property
    def num_sequences_in_flight(self) -> int:
        """Sequences admitted and not yet ended (queued for the engine thread, waiting or
        running)."""
        return self.engine_loop.num_seqs_in_flight

    def busy_slots(self) -> list[bool]:
        """Which sequence places (llama.cpp's slots, `SlotTable`) a request holds now."""
        return self.engine_loop.slots.busy()

    @property
    def num_requests_rejected(self) -> int:
        return self.engine_loop.num_requests_rejected

    @property
    def num_grammar_compiles_running(self) -> int:
        """Grammars compiling now on the grammar workers (overrunning ones included)."""
        return self.grammar_pool.num_running

    @property
    def observers(self) -> list[EngineObserver]:
        return self.engine_loop.observers

    def stats(self) -> ServingStats:
        return self.engine_loop.stats()

    def step_record_lines(self, since: int = 0, hide_paths: bool = False) -> Iterator[str] | None:
        """The flight record (the header line, then the steps from `since`) as JSON lines,
        built lazily from a copy of the ring, on whatever thread iterates; None when the
        recorder is off (`--step-record 0`). `hide_paths`: without the configuration's file
        system paths (what `/debug/steps` serves)."""
        recorder = self.engine_loop.engine.flight_recorder
        return None if recorder is None else recorder.json_lines(since, hide_paths)

    def add_observer(self, observer: EngineObserver) -> None:
        """`observer.on_step(EngineStats)` after every step and
        `observer.on_request_finished(RequestOutput)` for every ended request, both called on
        the engine thread."""
        self.engine_loop.observers.append(observer)

    async def tokenize(self, prompt: str | list[int | str]) -> tuple[str | None, list[int]]:
        return await self._off_loop(self.input_processor.tokenize, prompt)

    async def chat_token_ids(
        self, messages: list[dict], tools: list[dict] | None = None, **options
    ) -> list[int]:
        """Render messages (and function `tools`) with the chat template; a template error
        is a ParamError. A full server refuses (EngineOverloadedError) before rendering.
        `options`: `add_generation_prompt`, `continue_final_message` and `template_kwargs`
        of `chat_prompt_token_ids` (the latter over `default_chat_template_kwargs`)."""
        self._check_capacity(1)
        return await self._off_loop(self._chat_token_ids, messages, tools, options)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._off_loop(self._detokenize, token_ids)

    # -- requests -------------------------------------------------------------------------------
    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
        lora_name: str | None = None,
        pooling: bool = False,
    ) -> RequestStream:
        """Tokenize (off the event loop), validate and admit a request and return its
        stream. Raises ParamError/ValueError (bad input), EngineOverloadedError (queue full)
        or EngineDeadError (stopped) here, before any output, so a server can still answer
        with an error status. `request_id`: the engine's key, made by the server (a
        client's id is only echoed: keys must be unique, `n` children take `id#i`).
        `lora_name`: a loaded LoRA adapter to run with. `pooling`: an embedding request
        (its output's `embedding`), which only a pooling engine takes, and it takes no other."""
        self._check_accepting()
        self._check_runner(pooling)
        params = self.admission.check_params(params)  # every frontend's requests, before work
        self._check_kv_transfer(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if lora_name is not None and lora_name not in self.lora_adapters():
            raise ParamError(f"unknown LoRA adapter {lora_name!r}", "model")
        with self._admitting(params.n):  # a full server refuses before any work
            grammar_params = params.structured_outputs
            if grammar_params is not None:  # its size limits, before tokenizing
                self.input_processor.grammar_compiler.check(grammar_params)
            prompt_text, token_ids = await self._off_loop(self._prepare, prompt, params)
            await self._receive_kv(params)
            grammar = None
            if grammar_params is not None:
                grammar = await self.grammar_pool.compile(grammar_params)
            admitted = self.admission.admit_checked(
                request_id,
                prompt_text,
                token_ids,
                params,
                output_kind=output_kind,
                lora_name=lora_name,
                grammar=grammar,
            )
            self._check_accepting()  # it may have stopped while the prompt was prepared
            stream = RequestStream(self, request_id, admitted.num_seqs)
        capacity = self.max_num_seqs + self.max_queue_len
        self.engine_loop.add(stream, admitted, capacity=capacity)
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]:
        """The request's RequestOutputs (DELTA: what is new each step) until the last one
        (`finished`). Leaving early (break, cancellation, aclose) aborts the request."""
        stream = await self.add_request(prompt, params, request_id, output_kind)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Thread-safe; unknown or finished ids are ignored."""
        self.engine_loop.abort(request_id)

    async def hand_off_kv(
        self, output: RequestOutput, params: SamplingParams, lora_name: str | None = None
    ) -> KVTransferResult | None:
        """Phase 1 of prefill/decode disaggregation, once a `do_remote_decode` request has
        finished: wait until the store has no write of its prompt's full blocks queued any
        more (at most KV_HANDOFF_TIMEOUT_S; no thread blocks), then report how many of them,
        from the first, are on disk. The engine queued every one (its pool hits too) in the
        step that computed the prompt, before that step's output came out. None when the
        request sampled no token (it failed or was aborted): nothing to hand on."""
        token_ids = output.outputs[0].token_ids if output.outputs else []
        if not token_ids:
            return None
        first_token_id = token_ids[0]
        offload = self.engine_loop.engine.kv_offload
        adapter = None
        if lora_name is not None:
            adapter = self.engine_loop.engine.lora_manager.get(lora_name)
        names = offload.prompt_block_names(output.prompt_token_ids, params.cache_salt, adapter)
        written = asyncio.wrap_future(offload.store.when_written(names))
        await asyncio.wait([written], timeout=KV_HANDOFF_TIMEOUT_S)
        num_blocks = offload.store.num_stored(names)
        ray_blocks = None
        if self.kv_transport is not None and num_blocks:  # `--kv-transfer ray`
            ray_blocks = await asyncio.to_thread(self.kv_transport.send, names[:num_blocks])
            num_blocks = len(ray_blocks["blocks"]) if ray_blocks else 0
        return KVTransferResult(
            remote_tokens=num_blocks * self.info.block_size,
            remote_blocks=num_blocks,
            first_token_id=first_token_id,
            ray_blocks=ray_blocks,
        )

    # -- saved slots (`--slot-save-path`, engine/slot_save.py) ----------------------------------
    def enable_slot_save(self) -> None:
        """Places keep their last tokens from now on (called at start with
        `--slot-save-path`); UserError if this engine cannot save slots."""
        config = self.engine_loop.engine.config
        if not config.enable_prefix_caching or config.runner == "pooling":
            raise UserError(
                "--slot-save-path saves and restores prefix-cache blocks: it needs prefix "
                "caching on (not --no-enable-prefix-caching, not --runner pooling)"
            )
        if config.tensor_parallel_size > 1:
            raise UserError("--slot-save-path is not supported with tensor parallelism")
        if config.kv_cache_dtype not in ("auto", "float32", "float16"):
            raise UserError(
                f"--slot-save-path: kv_cache_dtype {config.kv_cache_dtype} is not supported "
                "(the saved block format has no scales): use auto, float32 or float16"
            )
        self.engine_loop.slots.keep_tokens = True

    async def slot_action(
        self, action: str, id_slot: int, filename: str | None, directory, key: bytes
    ) -> dict:
        """llama.cpp's slot action on sequence place `id_slot` (checked by the caller), on the
        engine thread between steps -> its answer in llama.cpp's shape. ParamError for a file
        that is refused; EngineSleepingError while the engine sleeps."""
        slot_dir = slot_save.SlotDir(directory, key)

        def run(engine, slots):
            started = time.perf_counter()
            if action == "erase":
                tokens = slots.tokens[id_slot] or []
                slot_save.erase(engine, tokens)
                slots.tokens[id_slot] = None
                return {"id_slot": id_slot, "n_erased": len(tokens)}
            if action == "save":
                n_tokens, n_bytes = slot_save.save(
                    engine, slot_dir, filename, slots.tokens[id_slot]
                )
                counts = {"n_saved": n_tokens, "n_written": n_bytes}
            else:
                tokens, n_tokens, n_bytes = slot_save.restore(engine, slot_dir, filename)
                slots.tokens[id_slot] = tokens
                counts = {"n_restored": n_tokens, "n_read": n_bytes}
            ms = (time.perf_counter() - started) * 1000
            return {
                "id_slot": id_slot,
                "filename": filename,
                **counts,
                "timings": {f"{action}_ms": ms},
            }

        done: Future = Future()
        self.engine_loop.send(SlotCall(run, done))
        return await asyncio.wrap_future(done)

    async def _receive_kv(self, params: SamplingParams) -> None:
        """Phase 2 under `--kv-transfer ray`: fetch the blocks phase 1 put into Ray's object
        store (within the transport's deadline; what does not arrive is recomputed) and stage
        them for the engine's prefix lookup."""
        transfer = params.kv_transfer_params
        if (
            self.kv_transport is None
            or transfer is None
            or not transfer.do_remote_prefill
            or not transfer.ray_blocks
        ):
            return
        await asyncio.to_thread(self.kv_transport.receive, transfer.ray_blocks)

    # -- LoRA adapters (`--enable-lora`) --------------------------------------------------------
    def lora_adapters(self) -> dict[str, str]:
        """Name -> path of the loaded LoRA adapters (empty without --enable-lora)."""
        manager = self.engine_loop.engine.lora_manager
        return manager.adapters() if manager is not None else {}

    async def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter directory under `name` (off the event loop); UserError if it
        cannot be served (LoRA off, name taken, rank, targets, another base model)."""
        manager = self.engine_loop.engine.lora_manager
        if manager is None:
            raise UserError("LoRA adapters are off (start the server with --enable-lora)")
        await asyncio.to_thread(manager.add_adapter, name, path)

    def unload_lora(self, name: str) -> bool:
        """Forget an adapter (requests already running with it finish); False if unknown."""
        manager = self.engine_loop.engine.lora_manager
        return manager is not None and manager.remove_adapter(name)

    # -- sleep mode (`--enable-sleep-mode`, `--sleep-idle-seconds`) -----------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.engine_loop.is_sleeping

    @property
    def sleep_requested(self) -> bool:
        """Put to sleep by `sleep` (not by itself when idle): requests are refused until
        `wake_up`; /health says `"status": "sleeping"`, so routers send it nothing."""
        return self.engine_loop.sleep_requested

    async def sleep(self, level: int = 1, abort: bool = False) -> None:
        """Free the KV pool (level 2: the weights too) once the requests in flight have
        finished (`abort`: ending them now); until `wake_up`, new requests raise
        EngineSleepingError. UserError for a level this engine cannot sleep at."""
        self.engine_loop.engine.check_sleep(level)
        await asyncio.wrap_future(self.engine_loop.sleep(level, abort))

    async def wake_up(self) -> None:
        """Reallocate what `sleep` freed (idempotent); returns once requests can run."""
        await asyncio.wrap_future(self.engine_loop.wake_up())

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
        if self.kv_transport is not None:
            await asyncio.to_thread(self.kv_transport.close)
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # -- admission ------------------------------------------------------------------------------
    @property
    def _capacity(self) -> int:
        return self.max_num_seqs + self.max_queue_len

    def refuse_if_full(self, num_seqs: int) -> None:
        """EngineOverloadedError if `num_seqs` more sequences would pass the capacity: a
        check before a request's own work (tokenizing its prompts), not a reservation."""
        with self._admission_lock:
            self._check_capacity(num_seqs)

    def _check_capacity(self, num_seqs: int) -> None:
        """EngineOverloadedError if `num_seqs` more would pass the capacity, counting the
        requests still being tokenized or compiled (call with `_admission_lock` held or
        for a check only)."""
        in_flight = self.engine_loop.num_seqs_in_flight + self._num_seqs_preparing
        if in_flight + num_seqs > self._capacity:
            self.engine_loop.num_requests_rejected += 1
            raise EngineOverloadedError(
                f"the server is overloaded ({in_flight} sequences in flight or being "
                f"prepared, at most {self._capacity} allowed); retry later"
            )

    @contextlib.contextmanager
    def _admitting(self, num_seqs: int):
        """Hold room for `num_seqs` while a request is prepared (EngineOverloadedError at
        once if there is none), so requests being tokenized or compiled count against the
        capacity and a full server does no work for a request it would refuse."""
        with self._admission_lock:
            self._check_capacity(num_seqs)
            self._num_seqs_preparing += num_seqs
        try:
            yield
        finally:
            with self._admission_lock:
                self._num_seqs_preparing -= num_seqs

    # -- on the tokenizer thread ----------------------------------------------------------------
    async def _off_loop(self, fn: Callable[..., T], *args) -> T:
        """Run `fn` on the tokenizer thread; its queue holds at most the server's capacity
        (EngineOverloadedError beyond, before the work is queued)."""
        with self._admission_lock:
            if self._num_tokenizer_jobs >= self._capacity:
                self.engine_loop.num_requests_rejected += 1
                raise EngineOverloadedError(
                    f"the tokenizer queue is full ({self._num_tokenizer_jobs} jobs); retry later"
                )
            self._num_tokenizer_jobs += 1
        job = self._tokenizer_thread.submit(fn, *args)
        job.add_done_callback(self._tokenizer_job_done)
        return await asyncio.wrap_future(job)

    def _tokenizer_job_done(self, _job) -> None:
        with self._admission_lock:
            self._num_tokenizer_jobs -= 1

    def _prepare(self, prompt, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check the prompt against the model's limits (before a grammar
        compiles for it)."""
        prompt_text, token_ids = self.input_processor.tokenize(prompt)
        self.admission.check_prompt(token_ids, params)
        return prompt_text, token_ids

    def _chat_token_ids(
        self, messages: list[dict], tools: list[dict] | None, options: dict
    ) -> list[int]:
        import jinja2

        options = dict(options)
        options["template_kwargs"] = {
            **self.default_chat_template_kwargs,
            **(options.get("template_kwargs") or {}),
        }
        try:
            return chat_prompt_token_ids(
                self.tokenizer, messages, self.chat_template, tools, **options
            )
        except jinja2.TemplateError as exc:
            raise ParamError(f"messages: the chat template failed: {exc}", "messages") from None

    def _detokenize(self, token_ids: list[int]) -> str:
        self.input_processor.tokenize(token_ids)  # validates the ids
        return self.tokenizer.decode(token_ids)

    def _check_runner(self, pooling: bool) -> None:
        if pooling and self.info.runner != "pooling":
            raise ParamError(
                "this server generates text: embeddings need a server started with "
                "--runner pooling (or --task embed)",
                "model",
            )
        if not pooling and self.info.runner == "pooling":
            raise ParamError(
                "this server embeds (--runner pooling): it serves /v1/embeddings, not text "
                "generation; start another without --runner pooling to generate",
                "model",
            )

    def _check_kv_transfer(self, params: SamplingParams) -> None:
        transfer = params.kv_transfer_params
        if transfer is None or not transfer.do_remote_decode:
            return
        if self.engine_loop.engine.kv_offload is None:
            raise ParamError(
                "kv_transfer_params: do_remote_decode hands the prompt's KV blocks on through "
                "the --kv-offload-dir store, and this server runs without one",
                "kv_transfer_params",
            )

    def _check_accepting(self) -> None:
        if self.is_draining:
            raise EngineDrainingError("the server is draining (shutting down); retry on another")
        if not self.is_accepting:
            reason = self.engine_loop.error or "the server is shutting down"
            raise EngineDeadError(f"engine is not accepting requests: {reason}")
        if self.engine_loop.sleep_requested:
            raise EngineSleepingError(
                "the server is sleeping (POST /wake_up wakes it); retry later"
            )
