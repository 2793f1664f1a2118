"""The scheduler: which requests run this step, and how many tokens each.

There is no prefill phase and no decode phase. Each step fills a token budget
(`max_num_batched_tokens`): first the running requests (usually one decode token each; a
request part-way through a chunked prefill continues with what the budget allows), then
waiting requests in arrival order, their prompts chunked to fit what is left of the budget,
up to `max_num_seqs` running at once.

When the pool has no block for a running request, the newest running request is preempted:
its blocks are freed and it goes back to the front of the waiting queue, to be recomputed
later (its computed blocks often survive in the prefix cache).

Scheduling policy (`--scheduling-policy`): under `fcfs` requests are served in arrival order
and `SamplingParams.priority` is 0. Under `priority` the order is (priority, arrival time),
lower first, everywhere: the running requests get the budget in that order, the waiting one
admitted next is the first in that order, the running one preempted for lack of blocks is
the last in it, and a waiting request that finds the pool (or `max_num_seqs`) full preempts
running requests later in that order than itself, even ones already scheduled this step.

Aging (`--priority-aging-steps N`, default 1000; 0: off, vLLM's strict order): a request's
effective priority improves by one level per N engine steps since it arrived, so the order is
(priority * N + the step it arrived at, arrival time): a request that has waited N steps ranks
as one of the next more urgent level arriving now. A request asking a more urgent priority
than one that arrived k levels earlier therefore passes it only within k * N steps of its
arrival: nobody starves behind a flood of urgent requests. The gap a client can open is
bounded with `--max-client-priority` (input_processor.py), which bounds the wait.

Prompt logprobs: a request that wants them computes its whole prompt (no prefix-cache hit),
and the model runner fills `Request.prompt_logprobs` chunk by chunk; they go out with the
request's first token.

Speculative decoding: a running request may carry draft tokens (`Request.spec_token_ids`, set
by the proposer before the step); it is budgeted its last token plus the drafts (fewer drafts
if the budget is short) and gets KV slots for all of them. After the step, the positions of
rejected drafts are given back (`KVCacheManager.trim`): the cache and the prefix hashes only
ever hold accepted tokens.

The scheduler keeps no counters: what a step did (preemptions, prefix-cache lookups, blocks
in use, tokens produced, inter-token latencies) goes out in its `SchedulerOutput` and
`StepStats`, and `EngineCore` keeps the totals (`engine/stats.py`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from nanollmserve.engine.kv_cache import KVCacheManager
from nanollmserve.engine.messages import EngineCoreOutput, RequestFailure, SampledToken
from nanollmserve.engine.request import Request, RequestStatus
from nanollmserve.engine.stats import StepStats

logger = logging.getLogger(__name__)

PREEMPT_KV_CACHE_FULL = "kv_cache_full"
PREEMPT_PRIORITY = "priority"


@dataclass
class SchedulerOutput:
    """Requests to run this step and how many new tokens each, decodes (1 token) first:
    everything the model runner needs, and what scheduling did for the engine's counters."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    """Each request's block table, with this step's slots allocated."""
    num_decodes: int = 0
    """The first `num_decodes` requests run one token each."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> draft tokens scheduled after its last token (speculative decoding)."""
    num_preempted: int = 0
    preemptions: list[tuple[str, str, str]] = field(default_factory=list)
    """(request id, why, the request it made room for) of each preemption: `kv_cache_full`
    (a running request needed a block and the pool had none) or `priority` (a waiting
    request of a lower priority value needed the slot or the blocks)."""
    prefix_cache_queries: int = 0
    """Tokens of the requests admitted for the first time (0 with prefix caching off)."""
    prefix_cache_hits: int = 0
    """Of those, tokens found in the prefix cache."""
    peak_used_blocks: int = 0
    """The most KV blocks in use at any point while scheduling."""
    remote_prefill_loaded: int = 0
    """Of the prompt tokens a prefill worker computed for the requests admitted for the first
    time (`kv_transfer_params` do_remote_prefill), those found in the pool or the store."""
    remote_prefill_recomputed: int = 0
    """Of those, the ones computed again here (missing, corrupt or past the last full block)."""

    def count_remote_prefill(self, request: Request, num_computed: int) -> None:
        transfer = request.sampling_params.kv_transfer_params
        if transfer is not None and transfer.do_remote_prefill:
            remote = min(transfer.remote_tokens, request.num_prompt_tokens)
            self.remote_prefill_loaded += min(remote, num_computed)
            self.remote_prefill_recomputed += remote - min(remote, num_computed)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int = 0,
        policy: str = "fcfs",
        priority_aging_steps: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        self.by_priority = policy == "priority"
        self.priority_aging_steps = priority_aging_steps
        """Steps of waiting per level of priority gained (0: no aging)."""
        self.num_steps = 0
        """Steps scheduled so far (the clock of aging)."""
        self._arrival_steps: dict[str, int] = {}
        """The step each unfinished request arrived at."""
        self._first_preempted_key: tuple[int, float] = (0, 0.0)
        """The smallest `_priority_key` among the requests preempted this step."""
        self.max_loras = max_loras
        """Most distinct LoRA adapters among the running requests (their slots)."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._arrival_steps[request.request_id] = self.num_steps
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput(peak_used_blocks=self.kv_cache.num_used_blocks)
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        if self.by_priority:  # the budget goes in priority order; the last is the victim
            self.running.sort(key=self._priority_key)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_left = request.num_tokens - request.num_computed_tokens
            drafts, request.spec_token_ids = request.spec_token_ids, []
            num_new = min(num_left + len(drafts), budget)
            drafts = drafts[: max(0, num_new - num_left)]
            while not self._allocate(out, request, num_new):
                victim = self.running.pop()  # the newest (under priority: the last) one
                self._preempt(victim, out, PREEMPT_KV_CACHE_FULL, request)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                if drafts:
                    out.spec_token_ids[request.request_id] = drafts
                budget -= num_new
                index += 1

        # Admit waiting requests only when nothing had to be preempted this step; under
        # priority, those that come before every request preempted this step still are.
        while self.waiting and budget > 0:
            request = self._next_waiting()
            if out.num_preempted and not (
                self.by_priority and self._priority_key(request) < self._first_preempted_key
            ):
                break
            if not self._has_lora_slot(request):
                break
            computed_blocks = self._computed_blocks(request)
            num_computed = len(computed_blocks) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if len(self.running) >= self.max_num_seqs or not self._allocate(
                out, request, num_new, computed_blocks
            ):
                freed = self._preempt_for(request, out, scheduled)
                if freed is None:
                    break
                budget += freed
                continue
            self.waiting.remove(request)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens is None:  # first admission (not a resume)
                request.num_cached_tokens = num_computed
                request.first_scheduled_time = time.time()
                if self.kv_cache.enable_prefix_caching:  # a resume recomputes: no hit
                    out.prefix_cache_queries += request.num_tokens
                    out.prefix_cache_hits += num_computed
                out.count_remote_prefill(request, num_computed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

        # Decodes first: the model runner batches them into one attention call.
        scheduled.sort(key=lambda item: item[1] != 1)
        out.requests = [request for request, _ in scheduled]
        out.num_new_tokens = [n for _, n in scheduled]
        out.block_ids = [self.kv_cache.block_ids(r.request_id) for r in out.requests]
        out.num_decodes = sum(1 for n in out.num_new_tokens if n == 1)
        return out

    def _next_waiting(self) -> Request:
        """The waiting request to admit next: the first to arrive (or be preempted), or
        under priority the first in (priority, arrival) order."""
        if self.by_priority:
            return min(self.waiting, key=self._priority_key)
        return self.waiting[0]

    def _computed_blocks(self, request: Request):
        """The prefix-cache blocks a request starts from; none while it still needs prompt
        logprobs, which only a computed position gives."""
        if request.needs_prompt_logprobs:
            return ()
        return self.kv_cache.get_computed_blocks(request)

    def _preempt_for(
        self, request: Request, out: SchedulerOutput, scheduled: list[tuple[Request, int]]
    ) -> int | None:
        """Under priority, make room for a waiting `request`: preempt the last running
        request in priority order if it comes after `request` (taking it out of this step
        if it was scheduled). Returns the budget that gives back (None: nothing to preempt)."""
        if not self.by_priority or not self.running:
            return None
        victim = max(self.running, key=self._priority_key)
        if self._priority_key(victim) <= self._priority_key(request):
            return None
        self.running.remove(victim)
        freed = 0
        for i, (scheduled_request, num_new) in enumerate(scheduled):
            if scheduled_request is victim:
                del scheduled[i]
                out.spec_token_ids.pop(victim.request_id, None)
                freed = num_new
                break
        self._preempt(victim, out, PREEMPT_PRIORITY, request)
        return freed

    def _has_lora_slot(self, request: Request) -> bool:
        """A request with a LoRA adapter runs only while its adapter has a slot: it is
        already running, or fewer than `max_loras` adapters are."""
        if request.lora is None:
            return True
        running = {r.lora_id for r in self.running if r.lora is not None}
        return request.lora_id in running or len(running) < self.max_loras

    def _allocate(
        self, out: SchedulerOutput, request: Request, num_new: int, computed_blocks=()
    ) -> bool:
        """`allocate_slots`, noting the most blocks in use for the engine's peak."""
        if not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
            return False
        out.peak_used_blocks = max(out.peak_used_blocks, self.kv_cache.num_used_blocks)
        return True

    def update_from_output(
        self, scheduled: SchedulerOutput, sampled: list[list[SampledToken] | RequestFailure]
    ) -> tuple[list[EngineCoreOutput], StepStats]:
        """Advance each request by what ran, append the tokens it emitted (one, or with
        drafts the accepted ones and one more), finish what is done. A request the runner
        could not sample (`RequestFailure`), or whose update raises, finishes alone with
        FINISHED_ERROR. Returns the outputs and what the step did."""
        outputs = []
        now = time.time()
        step = StepStats(scheduled.total_num_tokens)
        for request, num_new, samples in zip(
            scheduled.requests, scheduled.num_new_tokens, sampled, strict=True
        ):
            try:
                output = self._update_request(request, num_new, samples, scheduled, step, now)
            except Exception:
                logger.exception("request %s failed while taking its tokens", request.request_id)
                output = self._fail(request)
            if output is not None:
                outputs.append(output)
        return outputs, step

    def _update_request(
        self,
        request: Request,
        num_new: int,
        samples: list[SampledToken] | RequestFailure,
        scheduled: SchedulerOutput,
        step: StepStats,
        now: float,
    ) -> EngineCoreOutput | None:
        """One request's part of `update_from_output` (None: nothing to report yet)."""
        if isinstance(samples, RequestFailure):
            return self._fail(request)
        drafts = scheduled.spec_token_ids.get(request.request_id)
        if drafts:
            num_rejected = len(drafts) + 1 - len(samples)
            step.spec_decode.observe_draft(len(drafts), len(drafts) - num_rejected)
            num_new -= num_rejected
        request.num_computed_tokens += num_new
        if drafts:  # rejected drafts' slots go back: the cache holds accepted tokens only
            self.kv_cache.trim(request, request.num_computed_tokens)
        if not samples:  # a prefill chunk that did not reach the end of the prompt
            return None
        status = None
        new_token_ids = []
        for sample in samples:
            if not request.append_token(sample.token_id):  # refused by the grammar
                status = RequestStatus.FINISHED_STOPPED
                break
            new_token_ids.append(sample.token_id)
            status = self._check_stop(request, sample.token_id)
            if status is not None:  # drop tokens past a stop or max_tokens
                break
        new_logprobs = [s.logprobs for s in samples[: len(new_token_ids)]]
        step.num_generation_tokens += len(new_token_ids)
        if request.last_token_time is not None:
            step.inter_token_latencies.append(now - request.last_token_time)
        request.last_token_time = now
        prompt_logprobs = None
        if request.num_output_tokens == len(new_token_ids):  # its first tokens
            step.num_prompt_tokens += request.num_prompt_tokens
            if request.sampling_params.prompt_logprobs is not None:
                prompt_logprobs = request.prompt_logprobs
        if status is not None:
            self.finish(request, status)
        output = self._output(
            request, new_token_ids, new_logprobs if new_logprobs and new_logprobs[0] else None
        )
        output.prompt_logprobs = prompt_logprobs
        return output

    def _fail(self, request: Request) -> EngineCoreOutput:
        """End one request with FINISHED_ERROR (its blocks go back); the step goes on."""
        self.finish(request, RequestStatus.FINISHED_ERROR)
        return self._output(request, [], None)

    @staticmethod
    def _output(request: Request, new_token_ids: list[int], new_logprobs) -> EngineCoreOutput:
        status = request.status
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=status.finish_reason if status.is_finished else None,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens or 0,
            first_scheduled_time=request.first_scheduled_time,
            num_preemptions=request.num_preemptions,
        )

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.grammar is not None and request.grammar.is_finished:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens > params.min_tokens:  # the sampler masks stops until then
            if token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in request.stop_token_ids:
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
        self._arrival_steps.pop(request.request_id, None)

    def _preempt(
        self, request: Request, out: SchedulerOutput, reason: str, for_request: Request
    ) -> None:
        out.num_preempted += 1
        out.preemptions.append((request.request_id, reason, for_request.request_id))
        key = self._priority_key(request)
        if out.num_preempted == 1 or key < self._first_preempted_key:
            self._first_preempted_key = key
        self.kv_cache.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _priority_key(self, request: Request) -> tuple[int, float]:
        """Scheduling order under the priority policy: lower priority value first (aged: one
        level per `priority_aging_steps` steps since arrival), then arrival."""
        priority = request.sampling_params.priority
        if self.priority_aging_steps:
            arrived = self._arrival_steps.get(request.request_id, self.num_steps)
            return priority * self.priority_aging_steps + arrived, request.arrival_time
        return priority, request.arrival_time
