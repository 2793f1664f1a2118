"""The pooling runner (`--runner pooling`): every request is a prefill whose final normed
hidden states become one embedding, with no logits and no sampling.

The scheduler treats a pooling request as any other: its prompt is batched with the others'
under the token budget and chunked when longer than what is left of it, and it may be
preempted. `Pooler.execute` runs the step's forward pass for the hidden states and pools
each request's rows as they come (MEAN keeps a running sum, CLS the first token's state,
LAST needs only the final chunk); in the step where a request's prompt ends, its embedding
is complete and `Pooler.update` finishes it, so its KV blocks return to the pool at once and
it never decodes. A request that restarts from token 0 (after a preemption) starts its sum
again. The partial sums live in a weak map keyed by the request, so an aborted request
leaves nothing behind. Prefix caching is off under this runner (`EngineCore`): a cached
block would skip the hidden states MEAN and CLS need.
"""

from __future__ import annotations

import weakref

import torch

from nanollmserve.engine.messages import EngineCoreOutput
from nanollmserve.engine.model_runner import ModelRunner
from nanollmserve.engine.request import Request, RequestStatus
from nanollmserve.engine.scheduler import Scheduler, SchedulerOutput
from nanollmserve.engine.stats import StepStats
from nanollmserve.pooler_config import PoolerConfig


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._partial: weakref.WeakKeyDictionary[Request, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )
        """MEAN: the sum of the rows run so far; CLS: the first token's row (float32)."""

    @torch.inference_mode()
    def execute(self, runner: ModelRunner, scheduled: SchedulerOutput) -> list[list[float] | None]:
        """Run the step; the embedding of each request whose prompt ended in it, else None."""
        hidden = runner.run_hidden_states(scheduled)
        done_rows: list[int] = []
        vectors: list[torch.Tensor] = []
        offset = 0
        for row, (request, num_new) in enumerate(
            zip(scheduled.requests, scheduled.num_new_tokens, strict=True)
        ):
            chunk = hidden[offset : offset + num_new].float()
            offset += num_new
            vector = self._pool(request, chunk)
            if vector is not None:
                done_rows.append(row)
                vectors.append(vector)
        pooled: list[list[float] | None] = [None] * len(scheduled.requests)
        if vectors:
            stacked = torch.stack(vectors)
            if self.config.normalize:
                stacked = torch.nn.functional.normalize(stacked, p=2, dim=-1)
            for row, values in zip(done_rows, stacked.cpu().tolist(), strict=True):
                pooled[row] = values
        return pooled

    def _pool(self, request: Request, chunk: torch.Tensor) -> torch.Tensor | None:
        """Take one chunk of a request's rows; its pooled vector once the prompt is done."""
        start = request.num_computed_tokens
        is_last = start + chunk.shape[0] == request.num_tokens
        kind = self.config.pooling_type
        if kind == "LAST":
            return chunk[-1] if is_last else None
        if kind == "CLS":
            if start == 0:
                self._partial[request] = chunk[0]
        else:  # MEAN
            total = chunk.sum(0)
            self._partial[request] = total if start == 0 else self._partial[request] + total
        if not is_last:
            return None
        vector = self._partial.pop(request)
        return vector / request.num_tokens if kind == "MEAN" else vector

    @staticmethod
    def update(
        scheduler: Scheduler, scheduled: SchedulerOutput, pooled: list[list[float] | None]
    ) -> tuple[list[EngineCoreOutput], StepStats]:
        """Advance each request by what ran; finish those whose embedding is complete (their
        blocks go back now). Returns their outputs and what the step did."""
        outputs = []
        step = StepStats(scheduled.total_num_tokens)
        for request, num_new, embedding in zip(
            scheduled.requests, scheduled.num_new_tokens, pooled, strict=True
        ):
            request.num_computed_tokens += num_new
            if embedding is None:
                continue
            step.num_prompt_tokens += request.num_prompt_tokens
            scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.status.finish_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    first_scheduled_time=request.first_scheduled_time,
                    num_preemptions=request.num_preemptions,
                    pooled=embedding,
                )
            )
        return outputs, step
