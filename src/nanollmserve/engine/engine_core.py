"""EngineCore: the engine's loop body. `step()` = schedule -> execute -> update.

It owns the scheduler (with the KV block manager) and the model runner, takes
EngineCoreRequests (token ids and sampling params), and returns EngineCoreOutputs (new token
ids, finish reasons). It never sees text. Construction loads the model and makes the one KV
allocation, sized from `num_kv_blocks` or `kv_cache_memory`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from nanollmserve.config import EngineConfig
from nanollmserve.engine.kv_cache import KVCacheManager, KVCacheStats
from nanollmserve.engine.messages import EngineCoreOutput, EngineCoreRequest
from nanollmserve.engine.model_loading import LoadedModel, load_engine_model
from nanollmserve.engine.model_runner import ModelRunner
from nanollmserve.engine.request import Request, RequestStatus
from nanollmserve.engine.scheduler import Scheduler
from nanollmserve.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
DEFAULT_MAX_MODEL_LEN_CAP = 8192


@dataclass
class StepStats:
    """What the latest step did: the per-step numbers of the metrics (see `metrics/`)."""

    num_scheduled_tokens: int
    """Tokens the model ran: prompt chunks plus one per decoding request."""
    inter_token_latencies: list[float]
    """Seconds since the previous token of each request that got a token (not its first)."""


@dataclass
class EngineStats:
    """A snapshot of the engine for /stats, metrics and logs."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache: KVCacheStats
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    """Prompt tokens of the requests that produced their first token."""
    num_generation_tokens: int
    last_step: StepStats | None = None
    """The latest step (None before the first); observers read it in `on_step`."""

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_engine_model(config)
        model_config = self.loaded.model_config
        self.model_config = model_config
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        block_size = config.block_size
        self.num_kv_blocks = self._num_kv_blocks(block_size)
        self.max_model_len = self._max_model_len(self.num_kv_blocks * block_size)
        self.eos_token_ids = set(model_config.eos_token_ids)
        self.kv_cache = KVCacheManager(self.num_kv_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.model_runner = ModelRunner(
            self.loaded.model,
            num_blocks=self.num_kv_blocks,
            block_size=block_size,
            device=self.device,
            dtype=self.dtype,
            seed=config.seed,
        )
        self.num_steps = 0
        self.last_step: StepStats | None = None

    # -- requests -------------------------------------------------------------------------
    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Admit a request, or raise ValueError if it can never run."""
        if core_request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {core_request.request_id!r} is already running")
        num_prompt = len(core_request.prompt_token_ids)
        if not num_prompt:
            raise ValueError("prompt must not be empty")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt has {num_prompt} tokens, but the maximum context length is "
                f"{self.max_model_len} tokens (KV pool: {self.num_kv_blocks} blocks of "
                f"{self.config.block_size})"
            )
        params = core_request.sampling_params
        room = self.max_model_len - num_prompt
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.scheduler.add_request(Request(core_request, self.eos_token_ids, max_tokens))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish the requests now; every block they hold returns to the pool."""
        for request_id in request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the loop body --------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        sampled = self.model_runner.execute_model(scheduled, self.kv_cache)
        self.num_steps += 1
        outputs = self.scheduler.update_from_output(scheduled, sampled)
        self.last_step = StepStats(
            scheduled.total_num_tokens, self.scheduler.step_inter_token_latencies
        )
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            kv_cache=self.kv_cache.stats(),
            prefix_cache_queries=self.kv_cache.prefix_cache_queries,
            prefix_cache_hits=self.kv_cache.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_prompt_tokens=self.scheduler.num_prompt_tokens,
            num_generation_tokens=self.scheduler.num_generation_tokens,
            last_step=self.last_step,
        )

    # -- sizing ---------------------------------------------------------------------------
    def _num_kv_blocks(self, block_size: int) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        bytes_per_block = self.model_config.kv_bytes_per_token(self.dtype) * block_size
        memory = self.config.kv_cache_memory
        if memory is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                memory = int(free * 0.9)
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
