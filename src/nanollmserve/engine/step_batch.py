"""One step's batch, worked out once: `StepBatch`.

The model runner builds it from the scheduler's output (`StepBatch.of_scheduled`) at the
start of every step, and both ways of running a step read it: the native step
(`engine/native_decode.py`, which hands its tensors to `native/ops.py`'s `decode_step`, the
one place its values are checked before C runs) and the PyTorch forward (the model runner's
attention context, input ids, positions and logits indices). Nothing after it slices the
requests' tokens, pads the block tables or picks the sampled rows again.

A step is one `StepSpan` per sequence (a request's scheduled tokens): consecutive tokens at
positions p..p+T-1, token i attending to its sequence's positions <= p+i, the logits of its
last `num_logits` tokens wanted (a decode or a prefill chunk reaching the prompt's end: 1; a
verify step of k drafts: k + 1; a prefill chunk short of the prompt's end: 0). Flattened, in
the spans' order (decodes first, as the scheduler orders them):

- `token_ids`, `positions`, `seq_of_token` (int64 [T]): each token, its position, its span;
- `block_tables` (int64 [seqs, width]): each sequence's blocks, padded with -1 (no block),
  so a table too short for its sequence's positions is caught where it is read, never
  taken for block 0;
- `logit_rows` (int64 [R]): the flat indices of the tokens whose logits are wanted, each
  sampled span's consecutively; `sample_rows`: the spans that sample.

Whether the native step may run the batch is a property of the batch (`native_eligible`):
what holds for the model (one rank, the options, the kernels) is settled at load, where
`ModelRunner.native_decode` is None otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from nanollmserve.engine.prompt_logprobs import PromptLogprobRows
from nanollmserve.engine.scheduler import SchedulerOutput

NATIVE_PREFILL_MAX_TOKENS = 256
"""The longest prefill chunk of a request that runs on the native step. Measured on the
bundled model (2-core Xeon with AMX, whose tiles both paths' matmuls use from 64 rows), steps
of 512 prefill tokens, native / forward time since a span attends as tiles
(`scripts/native_prefill_crossover.py`, three runs): 8 x 64 tokens 0.81-0.86, 4 x 128
0.81-0.90, 2 x 256 0.89-0.92, 1 x 512 0.96-1.02 (even: left to the forward's SDPA)."""
NATIVE_MAX_TOKENS = 512
"""The most tokens of a step that runs as one native call: the default
`max_num_batched_tokens`, the largest step measured above."""


class StepSpan(NamedTuple):
    """One sequence's tokens in a step."""

    token_ids: list[int]
    """Consecutive tokens of the sequence, the first at `position`."""
    position: int
    block_ids: list[int]
    """The sequence's block table (reaching its last position)."""
    num_logits: int
    """How many of the last tokens give logits (0: none, the K/V only)."""
    prefill: bool = False
    """A chunk of the prompt (not a decode or a verify span: its tokens are not the
    request's last token and its drafts)."""


@dataclass(eq=False)
class StepBatch:
    """One step's tokens, positions, block tables and logit rows (module docstring). Built
    by `of` / `of_scheduled` and not changed after."""

    spans: tuple[StepSpan, ...]
    token_ids: torch.Tensor
    positions: torch.Tensor
    seq_of_token: torch.Tensor
    block_tables: torch.Tensor
    logit_rows: torch.Tensor
    ends: list[int]
    """Each span's end in the flat batch (its first token at `ends[i] - len(tokens)`)."""
    sample_rows: list[int]
    """The spans that sample (their logits rows are consecutive in `logit_rows`)."""
    context_lens: list[int]
    """Each span's keys once the step has written its K/V: its last position + 1."""
    num_decodes: int = 0
    """The first `num_decodes` spans are one decode token each (the forward's attention
    reads them apart from the prefill spans)."""
    num_drafts: int = 0
    """Draft tokens in the step (speculative verify spans)."""
    prompt_rows: PromptLogprobRows | None = None
    """The positions whose logits score prompt tokens (prompt logprobs), None for none."""

    @classmethod
    def of(
        cls,
        spans: Sequence[StepSpan],
        *,
        num_decodes: int = 0,
        num_drafts: int = 0,
        prompt_rows: PromptLogprobRows | None = None,
    ) -> StepBatch:
        """The spans flattened. ValueError for a batch that cannot be described: no span, a
        span without tokens, or more logits than tokens (the values, token ids, positions and
        block ids, are checked where they are used: `native/ops.py`'s `decode_step`)."""
        if not spans:
            raise ValueError("a step needs at least one sequence")
        tokens: list[int] = []
        positions: list[int] = []
        seq_of_token: list[int] = []
        logit_rows: list[int] = []
        ends: list[int] = []
        sample_rows: list[int] = []
        context_lens: list[int] = []
        for seq, span in enumerate(spans):
            count = len(span.token_ids)
            if not count:
                raise ValueError("a step needs at least one token per sequence")
            if not 0 <= span.num_logits <= count:
                raise ValueError(f"num_logits {span.num_logits} is outside [0, {count}]")
            tokens += span.token_ids
            positions += range(span.position, span.position + count)
            seq_of_token += [seq] * count
            logit_rows += range(len(tokens) - span.num_logits, len(tokens))
            ends.append(len(tokens))
            context_lens.append(span.position + count)
            if span.num_logits:
                sample_rows.append(seq)
        width = max(len(span.block_ids) for span in spans)
        tables = [span.block_ids + [-1] * (width - len(span.block_ids)) for span in spans]
        # numpy reads Python lists of ints several times faster than torch.tensor does
        flat = torch.from_numpy(np.array([tokens, positions, seq_of_token], dtype=np.int64))
        return cls(
            spans=tuple(spans),
            token_ids=flat[0],
            positions=flat[1],
            seq_of_token=flat[2],
            block_tables=torch.from_numpy(np.array(tables, dtype=np.int64)),
            logit_rows=torch.from_numpy(np.array(logit_rows, dtype=np.int64)),
            ends=ends,
            sample_rows=sample_rows,
            context_lens=context_lens,
            num_decodes=num_decodes,
            num_drafts=num_drafts,
            prompt_rows=prompt_rows if prompt_rows else None,
        )

    @classmethod
    def of_scheduled(cls, scheduled: SchedulerOutput) -> StepBatch:
        """The scheduled step: each request's next `num_new` tokens from its first
        uncomputed one (with draft tokens: its last token, then the drafts), the logits of
        its last token (and of each draft) when the step reaches the end of what it has."""
        spans = []
        num_drafts = 0
        for request, num_new, block_ids in zip(
            scheduled.requests, scheduled.num_new_tokens, scheduled.block_ids, strict=True
        ):
            start = request.num_computed_tokens
            drafts = scheduled.spec_token_ids.get(request.request_id, [])
            num_drafts += len(drafts)
            token_ids = request.all_token_ids[start : start + num_new - len(drafts)] + drafts
            samples = start + num_new == request.num_tokens + len(drafts)
            num_logits = len(drafts) + 1 if samples else 0
            prefill = start + 1 < request.num_tokens
            spans.append(StepSpan(token_ids, start, block_ids, num_logits, prefill))
        return cls.of(
            spans,
            num_decodes=scheduled.num_decodes,
            num_drafts=num_drafts,
            prompt_rows=PromptLogprobRows.of(scheduled),
        )

    @property
    def num_tokens(self) -> int:
        return self.ends[-1]

    @property
    def native_eligible(self) -> bool:
        """Whether the native step may run this batch: no prompt logprobs (the forward
        scores them), at most NATIVE_MAX_TOKENS tokens, and every prefill chunk at most
        NATIVE_PREFILL_MAX_TOKENS (decode tokens and verify spans of any count)."""
        if self.prompt_rows is not None or self.num_tokens > NATIVE_MAX_TOKENS:
            return False
        return all(
            not span.prefill or len(span.token_ids) <= NATIVE_PREFILL_MAX_TOKENS
            for span in self.spans
        )

    @property
    def kind(self) -> str:
        """What the step counts as (`ModelRunner.native_steps`): prefill (a prefill chunk
        in it), verify (drafts in it), else decode; `batched-` with several sequences."""
        if any(span.prefill for span in self.spans):
            kind = "prefill"
        else:
            kind = "verify" if self.num_drafts else "decode"
        return kind if len(self.spans) == 1 else f"batched-{kind}"
