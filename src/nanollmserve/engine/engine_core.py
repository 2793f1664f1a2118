"""EngineCore: the engine's loop body. `step()` = schedule -> execute -> update.

It owns the scheduler (with the KV block manager), the model runner and the counters, takes
EngineCoreRequests (token ids and sampling params), and returns an `EngineStepResult`: the
EngineCoreOutputs (new token ids, finish reasons) and the stats after the step. It never sees
text. Construction loads the model and makes the one KV allocation, sized from
`num_kv_blocks` or `kv_cache_memory`. Sleep mode (`sleep`, `wake_up`) frees that allocation
(level 2: the weights too) while no request is in the engine and makes it again on wake.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from nanollmserve.config import EngineConfig
from nanollmserve.engine.flight_recorder import FlightRecorder, StepRecord, config_json
from nanollmserve.engine.kv_budget import gpu_kv_cache_bytes
from nanollmserve.engine.kv_cache import KVCacheManager
from nanollmserve.engine.kv_offload import KVOffload
from nanollmserve.engine.lora_manager import LoRAManager
from nanollmserve.engine.messages import EngineCoreOutput, EngineCoreRequest
from nanollmserve.engine.model_loading import LoadedModel, load_engine_model
from nanollmserve.engine.model_runner import ModelRunner
from nanollmserve.engine.pooling import Pooler
from nanollmserve.engine.request import Request, RequestStatus
from nanollmserve.engine.scheduler import Scheduler
from nanollmserve.engine.spec_decode.proposer import make_speculative_decoder
from nanollmserve.engine.stats import EngineCounters, EngineStats, StepStats
from nanollmserve.errors import UserError
from nanollmserve.layers.kv_quant import (
    kv_bytes_per_token,
    kv_cache_storage_dtype,
    resolve_kv_cache_dtype,
)

if TYPE_CHECKING:
    from nanollmserve.engine.tensor_parallel.executor import TensorParallelExecutor

__all__ = ["EngineCore", "EngineStats", "EngineStepResult", "StepStats"]

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
"""Per rank under tensor parallelism."""
DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass
class EngineStepResult:
    """What one `EngineCore.step()` returns."""

    outputs: list[EngineCoreOutput]
    """One per request that got a token this step (empty when nothing was scheduled)."""
    stats: EngineStats
    """The engine after this step; `stats.last_step` is this step (if it ran anything)."""


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.kv_offload: KVOffload | None = None
        self.tensor_parallel = start_tensor_parallel(config)  # None with one rank
        try:
            self._build(config, loaded)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, loaded: LoadedModel | None) -> None:
        self.loaded = loaded or load_engine_model(config)
        model_config = self.loaded.model_config
        self.model_config = model_config
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.loaded.quantization
        )
        block_size = config.block_size
        self.num_kv_blocks = self._num_kv_blocks(block_size)
        self.max_model_len = self._max_model_len(self.num_kv_blocks * block_size)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.flight_recorder = (  # --step-record N: the last N steps (0: none)
            FlightRecorder(
                config.step_record,
                config_json(config),
                self.num_kv_blocks,
                block_size,
                max_bytes=config.step_record_max_bytes,
                keep_prompts=config.step_record_prompts,
            )
            if config.step_record
            else None
        )
        # --runner pooling: prefill-only requests, their hidden states pooled (no sampling).
        self.pooler = Pooler(config.pooler_config) if config.runner == "pooling" else None
        self.lora_manager = (
            LoRAManager(self.loaded.model, model_config, config.max_loras, config.max_lora_rank)
            if config.enable_lora
            else None
        )
        self.model_runner = self._make_model_runner()
        # --kv-offload-dir: read through the current runner (sleep mode makes new pools).
        self.kv_offload = KVOffload.open(config, self.loaded, lambda: self.model_runner.kv_cache)
        self._make_scheduler()
        self.sleep_level: int | None = None
        """1 or 2 while asleep (`sleep`), None while awake."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.start_workers(self.num_kv_blocks)
            self.model_runner.step_sender = self.tensor_parallel.send_step
        self.spec_decoder = make_speculative_decoder(config, self.loaded, self.num_kv_blocks)
        self.counters = EngineCounters(spec_decode=self.spec_decoder is not None)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Take a request, or raise ValueError if it cannot run. A request's user-facing
        checks are the frontend's (`frontend/admission.py`, whose messages clients see);
        what is left here is the engine's own state (asleep, an id already running) and
        invariants a caller that skipped admission would trip."""
        if self.sleep_level is not None:
            raise ValueError("the engine is asleep: wake it up first")
        if core_request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {core_request.request_id!r} is already running")
        num_prompt = len(core_request.prompt_token_ids)
        if not num_prompt:
            raise ValueError("prompt must not be empty")
        # A pooling request needs no room for output: a prompt of max_model_len fits.
        if num_prompt >= self.max_model_len + (self.pooler is not None):
            raise ValueError(
                f"prompt has {num_prompt} tokens, but the maximum context length is "
                f"{self.max_model_len} tokens (KV pool: {self.num_kv_blocks} blocks of "
                f"{self.config.block_size})"
            )
        params = core_request.sampling_params
        room = self.max_model_len - num_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        request = Request(core_request, self.eos_token_ids, max_tokens)
        if core_request.lora_name is not None:
            if self.lora_manager is None:
                raise ValueError("LoRA adapters are off: start the engine with enable_lora")
            request.lora = self.lora_manager.get(core_request.lora_name)
        self.scheduler.add_request(request)
        if self.flight_recorder is not None:
            self.flight_recorder.add_arrival(
                request.request_id,
                core_request.prompt_token_ids,
                params,
                request.arrival_time,
                core_request.lora_name,
            )

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish the requests now; every block they hold returns to the pool."""
        if self.flight_recorder is not None and request_ids:
            self.flight_recorder.add_aborts(request_ids)
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the loop body --------------------------------------------------------------------
    def step(self) -> EngineStepResult:
        started = time.perf_counter()
        if self.spec_decoder is not None:  # drafts for the decoding requests
            self.spec_decoder.propose(self.scheduler.running)
        proposed = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.counters.record_schedule(scheduled)
        recorder = self.flight_recorder
        # Before the update moves them on: how much each request had left decides its phase.
        batch = _recorded_batch(scheduled) if recorder is not None else None
        outputs: list[EngineCoreOutput] = []
        sampled = None
        scheduled_at = executed = time.perf_counter()
        if not scheduled.is_empty:
            if self.lora_manager is not None:
                self.lora_manager.set_batch(scheduled.requests, scheduled.num_new_tokens)
            sampled = self._execute_model(scheduled)
            self.kv_cache.offload_computed_blocks(scheduled.requests)
            executed = time.perf_counter()
            if self.pooler is not None:
                outputs, step = self.pooler.update(self.scheduler, scheduled, sampled)
                sampled = None  # embeddings, not tokens
            else:
                outputs, step = self.scheduler.update_from_output(scheduled, sampled)
            self.counters.record_step(step)
        if recorder is not None:
            times = (started, proposed, scheduled_at, executed)
            self._record_step(recorder, scheduled, batch, sampled, outputs, times)
        return EngineStepResult(outputs, self.stats())

    def _record_step(self, recorder, scheduled, batch, sampled, outputs, times) -> None:
        """One StepRecord of what this step did; `times`: perf_counter() when it started,
        proposed drafts, scheduled and executed the model."""
        started, proposed, scheduled_at, executed = times
        now = time.perf_counter()
        block_events, self.kv_cache.block_events = self.kv_cache.block_events, []
        recorder.append(
            StepRecord(
                step=recorder.num_steps,
                wall_time=time.time() - (now - started),
                durations=(
                    proposed - started,
                    scheduled_at - proposed,
                    executed - scheduled_at,
                    now - executed,
                ),
                batch=batch,
                drafts=scheduled.spec_token_ids,
                sampled=sampled,
                preemptions=scheduled.preemptions,
                finished=[(o.request_id, o.finish_reason) for o in outputs if o.finish_reason],
                block_events=block_events,
                num_waiting=len(self.scheduler.waiting),
                num_running=len(self.scheduler.running),
                num_used_blocks=self.kv_cache.num_used_blocks,
                inputs=recorder.take_inputs(),
            )
        )

    def _execute_model(self, scheduled):
        """The sampled tokens of each request (or, pooling, its embedding once complete)."""
        if self.pooler is not None:
            execute = functools.partial(self.pooler.execute, self.model_runner)
        else:
            execute = self.model_runner.execute_model
        if self.tensor_parallel is None:
            return execute(scheduled)
        self.tensor_parallel.check_alive()
        try:
            return execute(scheduled)
        except Exception as exc:  # the ranks are out of step now: no retry can help
            raise self.tensor_parallel.fail(f"a tensor-parallel step failed: {exc!r}") from exc

    def add_failure_listener(self, listener) -> None:
        """`listener(EngineFatalError)` is called, from another thread, when the engine can
        no longer step (a tensor-parallel rank died)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.add_failure_listener(listener)

    def shutdown(self) -> None:
        """Finish the KV offload tier's writes; stop the other tensor-parallel ranks."""
        if self.kv_offload is not None:
            self.kv_offload.close()
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()

    def stats(self) -> EngineStats:
        """A snapshot of the engine now (also between steps, when it is idle)."""
        return self.counters.snapshot(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_cache=self.kv_cache.stats(),
        )

    def reset(self) -> None:
        """Forget every request and every cached prefix, after a step that raised: what it
        wrote to the KV cache (and the prefix hashes registered for it) cannot be trusted.
        The model, the KV tensor and the counters stay."""
        self._make_scheduler()
        if self.spec_decoder is not None:
            self.spec_decoder.reset()

    def _make_model_runner(self) -> ModelRunner:
        return ModelRunner(
            self.loaded.model,
            num_blocks=self.num_kv_blocks,
            block_size=self.config.block_size,
            device=self.device,
            dtype=self.dtype,
            seed=self.config.seed,
            kv_cache_dtype=self.kv_cache_dtype,
        )

    # -- sleep mode -----------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Free memory while no request is in the engine: level 1 the KV pool (the draft
        model's too), level 2 also the weights (reloaded from the model source on wake).
        Every cached prefix is forgotten. Sleeping deeper than now frees the rest; raises
        UserError for what cannot sleep (see `check_sleep`)."""
        self.check_sleep(level)
        if self.has_unfinished_requests():
            raise RuntimeError("the engine can only sleep with no request in it")
        if self.sleep_level is not None and self.sleep_level >= level:
            return
        if self.flight_recorder is not None:  # replay sleeps too: the prefix cache empties
            self.flight_recorder.add_sleep(level)
        self.reset()  # the prefix cache describes a pool about to be gone
        for runner in self._model_runners():
            if not runner.kv_cache_released:
                runner.release_kv_cache()
        if level == 2:
            self.model_runner = None
            self.loaded = replace(self.loaded, model=None)
        self.sleep_level = level
        release_freed_memory()

    def wake_up(self) -> None:
        """Undo `sleep`: reload the weights (level 2), make fresh KV pools. Idempotent."""
        if self.sleep_level is None:
            return
        if self.model_runner is None:
            self.loaded = load_engine_model(self.config)
            self.model_runner = self._make_model_runner()
        for runner in self._model_runners():
            if runner.kv_cache_released:
                runner.reallocate_kv_cache()
        self.sleep_level = None

    def check_sleep(self, level: int) -> None:
        """UserError unless this engine can sleep at `level` (1 or 2): not under tensor
        parallelism (the other ranks hold their own pools); level 2 not with LoRA adapters
        or a draft model (both wrap or pair with the weights it would reload)."""
        if level not in (1, 2):
            raise UserError(f"sleep level must be 1 or 2, got {level}")
        if self.tensor_parallel is not None:
            raise UserError("sleep mode is not supported with tensor parallelism")
        if level == 2 and self.lora_manager is not None:
            raise UserError("sleep level 2 is not supported with LoRA adapters: use level 1")
        if level == 2 and self._model_runners()[1:]:
            raise UserError("sleep level 2 is not supported with a draft model: use level 1")

    def _model_runners(self) -> list[ModelRunner]:
        """The runners that hold a KV pool: the target's, then a draft model's."""
        runners = [] if self.model_runner is None else [self.model_runner]
        draft_runner = getattr(getattr(self.spec_decoder, "proposer", None), "runner", None)
        return runners + ([draft_runner] if draft_runner is not None else [])

    def _make_scheduler(self) -> None:
        config = self.config
        # Pooling pools every prompt token's hidden state: a cached prefix would skip some.
        self.kv_cache = KVCacheManager(
            self.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching and config.runner != "pooling",
            offload=self.kv_offload,
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_loras=config.max_loras if config.enable_lora else 0,
            policy=config.scheduling_policy,
            priority_aging_steps=config.priority_aging_steps,
        )
        if self.flight_recorder is not None:
            self.kv_cache.block_events = []

    # -- sizing ---------------------------------------------------------------------------
    def _num_kv_blocks(self, block_size: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        tp_size = self.config.tensor_parallel_size
        kv_dtype = kv_cache_storage_dtype(self.kv_cache_dtype, self.dtype)
        bytes_per_block = kv_bytes_per_token(self.model_config, kv_dtype, tp_size) * block_size
        memory = self.config.kv_cache_memory
        if memory is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                memory = gpu_kv_cache_bytes(
                    total=total,
                    free=free,
                    used_by_engine=torch.cuda.memory_reserved(self.device),
                    utilization=self.config.gpu_memory_utilization,
                )
            else:
                memory = DEFAULT_CPU_KV_CACHE_MEMORY
        num_blocks = memory // bytes_per_block
        if num_blocks < 1:
            raise UserError(
                f"kv_cache_memory {memory} bytes holds no block ({bytes_per_block} bytes each)"
            )
        return num_blocks

    def _max_model_len(self, pool_tokens: int) -> int:
        model_limit = self.model_config.max_context_len
        if self.config.max_model_len is not None:
            if self.config.max_model_len > model_limit:
                raise UserError(
                    f"max_model_len {self.config.max_model_len} is more than the model's "
                    f"context length {model_limit}"
                )
            if self.config.max_model_len > pool_tokens:
                raise UserError(
                    f"max_model_len {self.config.max_model_len} does not fit the KV cache "
                    f"({pool_tokens} tokens); raise --kv-cache-memory or --num-kv-blocks"
                )
            return self.config.max_model_len
        # Every request must fit the pool on its own, or it could never finish.
        return min(model_limit, DEFAULT_MAX_MODEL_LEN_CAP, pool_tokens)


def _recorded_batch(scheduled) -> list[tuple[str, int, int, bool]]:
    """The flight recorder's view of a schedule: per request (id, tokens scheduled, tokens
    it had left to compute, whether a grammar masks its sampling)."""
    return [
        (r.request_id, n, r.num_tokens - r.num_computed_tokens, r.grammar is not None)
        for r, n in zip(scheduled.requests, scheduled.num_new_tokens, strict=True)
    ]


def release_freed_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc's malloc_trim),
    so what `sleep` dropped leaves the process's RSS, not only its heap."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        libc = ctypes.CDLL(libc_name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def start_tensor_parallel(config: EngineConfig) -> TensorParallelExecutor | None:
    """With `tensor_parallel_size` > 1: start the other ranks and join their group (this
    process is rank 0), so the model built next is this rank's shard."""
    if config.tensor_parallel_size == 1:
        return None
    from nanollmserve.engine.tensor_parallel.executor import TensorParallelExecutor

    return TensorParallelExecutor(config)
