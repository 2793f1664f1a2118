"""The scheduler: which requests run this step, and how many tokens each.

There is no prefill phase and no decode phase. Each step fills a token budget
(`max_num_batched_tokens`): first the running requests (usually one decode token each; a
request part-way through a chunked prefill continues with what the budget allows), then
waiting requests in arrival order, their prompts chunked to fit what is left of the budget,
up to `max_num_seqs` running at once.

When the pool has no block for a running request, the newest running request is preempted:
its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
later (its computed blocks often survive in the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanollmserve.engine.kv_cache import KVCacheManager
from nanollmserve.engine.messages import EngineCoreOutput, TokenLogprobs
from nanollmserve.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """Requests to run this step and how many new tokens each, decodes (1 token) first."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class SampledToken:
    """What the model runner sampled for one request this step."""

    token_id: int
    logprobs: TokenLogprobs | None = None


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # of requests that produced their first token
        self.num_generation_tokens = 0
        self.step_inter_token_latencies: list[float] = []  # of the latest update

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running.pop()  # the newest running request
                self._preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                index += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        while (
            self.waiting
            and budget > 0
            and not out.num_preempted
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            computed_blocks = self.kv_cache.get_computed_blocks(request)
            num_computed = len(computed_blocks) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:  # first admission (not a resume)
                request.num_cached_tokens = num_computed
                request.first_scheduled_time = time.time()
                self.kv_cache.record_prefix_lookup(request.num_tokens, num_computed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        # Decodes first: the model runner batches them into one attention call.
        scheduled.sort(key=lambda item: item[1] != 1)
        out.requests = [request for request, _ in scheduled]
        out.num_new_tokens = [n for _, n in scheduled]
        return out

    def update_from_output(
        self, scheduled: SchedulerOutput, sampled: list[SampledToken | None]
    ) -> list[EngineCoreOutput]:
        """Advance each request by what ran, append sampled tokens, finish what is done."""
        outputs = []
        now = time.time()
        self.step_inter_token_latencies = []
        for request, num_new, sample in zip(
            scheduled.requests, scheduled.num_new_tokens, sampled, strict=True
        ):
            request.num_computed_tokens += num_new
            if sample is None:  # a prefill chunk that did not reach the end of the prompt
                continue
            request.append_token(sample.token_id)
            self.num_generation_tokens += 1
            if request.last_token_time is not None:
                self.step_inter_token_latencies.append(now - request.last_token_time)
            request.last_token_time = now
            if request.num_output_tokens == 1:
                self.num_prompt_tokens += request.num_prompt_tokens
            status = self._check_stop(request, sample.token_id)
            if status is not None:
                self.finish(request, status)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[sample.token_id],
                    new_logprobs=[sample.logprobs] if sample.logprobs else None,
                    finish_reason=status.finish_reason if status else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    first_scheduled_time=request.first_scheduled_time,
                    num_preemptions=request.num_preemptions,
                )
            )
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens > params.min_tokens:  # the sampler masks stops until then
            if token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request (finished or aborted) and give its blocks back."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        self.requests.pop(request.request_id, None)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
