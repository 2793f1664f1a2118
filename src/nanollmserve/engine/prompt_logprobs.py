"""Prompt logprobs: the logprob of each prompt token given the tokens before it.

A request with `SamplingParams.prompt_logprobs` set has the logits of its prompt positions
computed along with the rows that sample: position q's logits score prompt token q + 1. The
model runner asks `PromptLogprobRows.of(scheduled)` which flat positions of the step those
are, adds them after its sampling positions, and hands the logits back to `take`, which fills
`Request.prompt_logprobs` (the prompt token first, then the top k, vLLM's format) and returns
the sampling rows. The scheduler gives such a request no prefix-cache hit, so every prompt
position is computed once; a resume after preemption finds them done and adds none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanollmserve.engine.messages import TokenLogprobs
from nanollmserve.engine.request import Request
from nanollmserve.engine.scheduler import SchedulerOutput
from nanollmserve.layers.sampler import LOGPROB_FLOOR

ROWS_PER_SLICE = 64
"""Prompt rows scored at once (`take`): bounds the vocabulary-wide temporaries of a step."""


@dataclass
class _Span:
    request: Request
    first_index: int
    """Flat index (in the step's tokens) of the first position scored."""
    target_ids: list[int]
    """The prompt tokens those positions score, in order."""


class PromptLogprobRows:
    """The positions of one step whose logits give prompt logprobs."""

    def __init__(self, spans: list[_Span]) -> None:
        self.spans = spans

    @classmethod
    def of(cls, scheduled: SchedulerOutput) -> PromptLogprobRows:
        spans = []
        end = 0
        for request, num_new in zip(scheduled.requests, scheduled.num_new_tokens, strict=True):
            start = request.num_computed_tokens
            end += num_new
            if not request.needs_prompt_logprobs:
                continue
            low = max(start, len(request.prompt_logprobs))  # positions still to score
            high = min(start + num_new, request.num_prompt_tokens - 1)
            if low < high:
                first_index = end - num_new + (low - start)
                targets = request.prompt_token_ids[low + 1 : high + 1]
                spans.append(_Span(request, first_index, targets))
        return cls(spans)

    def __bool__(self) -> bool:
        return bool(self.spans)

    def with_positions(self, logits_indices: torch.Tensor | None, device) -> torch.Tensor | None:
        """The sampling positions followed by these."""
        if not self.spans:
            return logits_indices
        extra = torch.tensor(
            [s.first_index + j for s in self.spans for j in range(len(s.target_ids))],
            device=device,
        )
        return extra if logits_indices is None else torch.cat([logits_indices, extra])

    def take(self, logits: torch.Tensor | None, num_sample_rows: int) -> torch.Tensor | None:
        """Fill each request's prompt logprobs from the rows after the first
        `num_sample_rows`; return the sampling rows (None when there are none)."""
        if not self.spans or logits is None:
            return logits
        prompt_rows = logits[num_sample_rows:]
        all_targets = torch.tensor(
            [t for s in self.spans for t in s.target_ids], device=prompt_rows.device
        )[:, None]
        max_k = max(s.request.sampling_params.prompt_logprobs for s in self.spans)
        ids_list, values_list, ranks_list = [], [], []
        # A slice of rows at a time: the float copy, the log-softmax and the comparison are
        # vocabulary-wide per row, so a whole step's rows at once would triple its logits.
        for start in range(0, len(prompt_rows), ROWS_PER_SLICE):
            logprobs = torch.log_softmax(
                prompt_rows[start : start + ROWS_PER_SLICE].float(), dim=-1
            )
            logprobs.nan_to_num_(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR)
            targets = all_targets[start : start + ROWS_PER_SLICE]
            target_logprobs = logprobs.gather(1, targets)
            ranks = (logprobs > target_logprobs).sum(dim=-1) + 1
            top = logprobs.topk(max_k, dim=-1) if max_k else None
            ids = torch.cat([targets, top.indices], 1) if top else targets
            values = torch.cat([target_logprobs, top.values], 1) if top else target_logprobs
            ids_list += ids.tolist()
            values_list += values.tolist()
            ranks_list += ranks.tolist()
        row = 0
        for span in self.spans:
            k = span.request.sampling_params.prompt_logprobs
            for _ in span.target_ids:
                span.request.prompt_logprobs.append(
                    TokenLogprobs(
                        token_ids=ids_list[row][: 1 + k],
                        logprobs=values_list[row][: 1 + k],
                        ranks=[ranks_list[row], *range(1, k + 1)],
                    )
                )
                row += 1
        return logits[:num_sample_rows] if num_sample_rows else None
