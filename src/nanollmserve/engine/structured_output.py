"""Structured output in the engine: each constrained request's grammar state, and the step's
one batched token bitmask applied to the logits before sampling.

- `GrammarState` wraps an XGrammar matcher made from the request's compiled grammar (see
  `grammar_compiler.py`). The scheduler's update step advances it with each accepted token
  (`accept_token`), so between steps it stands after the request's last token. When the
  grammar has ended (`is_finished`), the request finishes with `stop`. Speculative decoding
  cuts a request's drafts to the prefix its grammar allows (`num_valid`).
- `GrammarBitmask.apply(logits, requests, drafts)` is the model runner's hook: for the rows
  whose request has a grammar it fills one `[rows, ceil(vocab / 32)]` int32 bitmask in a
  single batched call (XGrammar's C++ matchers, no Python loop over the vocabulary) and sets
  the logits of disallowed tokens to -inf by `token_bitmask.py` (CPU: numpy; GPU: XGrammar). Rows
  without a grammar are untouched, so constrained and unconstrained requests share a step.
  A request verifying k drafts has k + 1 rows: row j is masked with the grammar state after
  its first j drafts (one batched fill per j, the matchers advanced through the drafts in
  between, then rolled back); a row after a draft that ended the grammar stays unmasked (the
  request stops at that draft, so the row's token is never used).
- A grammar with a `ThinkingSpan` (a reasoning model's answer, vLLM's behaviour) waits
  while the model thinks: unmasked rows, no tokens to the matcher, until `</think>`. Before
  the first token the mask is the grammar's plus `<think>` (the output may open its
  thinking or start its answer). Drafts are kept only up to the phase change, so every
  masked row is in one phase.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from nanollmserve.engine.token_bitmask import apply_token_bitmask

if TYPE_CHECKING:
    from nanollmserve.engine.request import Request
    from nanollmserve.structured_outputs import ThinkingSpan

_BEFORE, _THINKING, _ANSWER = "before", "thinking", "answer"


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled_grammar: Any, thinking: ThinkingSpan | None = None) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled_grammar)
        self.num_accepted = 0
        self.num_rejected = 0
        self.thinking = thinking
        if thinking is None:
            self.phase = _ANSWER
        else:
            self.phase = _THINKING if thinking.open_at_start else _BEFORE

    @property
    def constrains_next(self) -> bool:
        """The next token is masked (not inside the thinking)."""
        return self.phase != _THINKING

    @property
    def may_open_thinking(self) -> bool:
        """The next token may be `<think>` besides what the grammar allows."""
        return self.phase == _BEFORE

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the mask
        makes that impossible unless every token was masked), which ends the request."""
        if self.phase == _THINKING:
            if token_id == self.thinking.end_token_id:
                self.phase = _ANSWER
            return True
        if self.phase == _BEFORE:
            if token_id == self.thinking.start_token_id:
                self.phase = _THINKING
                return True
            self.phase = _ANSWER
        accepted = self.matcher.accept_token(token_id)
        if accepted:
            self.num_accepted += 1
        else:
            self.num_rejected += 1
        return accepted

    def num_valid(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` the grammar allows from here (speculative drafts: a
        draft the grammar refuses could never be sampled, nor could any draft after it). The
        state is unchanged afterwards. While thinking, the drafts before `</think>` are
        valid; before the first token, none (the phase changes there)."""
        if self.phase == _BEFORE:
            return 0
        if self.phase == _THINKING:
            end = self.thinking.end_token_id
            return token_ids.index(end) if end in token_ids else len(token_ids)
        num = 0
        for token_id in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            num += 1
        if num:
            self.matcher.rollback(num)
        return num

    @property
    def is_finished(self) -> bool:
        """Nothing may follow: the grammar is complete and its stop token was accepted (or a
        token it does not allow was sampled, which the request does not keep)."""
        return self.num_rejected > 0 or self.matcher.is_terminated()


class GrammarBitmask:
    """The model runner's hook: one batched bitmask per step over the rows with a grammar.
    XGrammar's batch matcher and the bitmask buffer are made on first use, so a runner that
    never sees a grammar never imports XGrammar."""

    def __init__(self) -> None:
        self._xgrammar = None
        self._batch_matcher = None
        self._buffer: torch.Tensor | None = None

    def apply(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        drafts: list[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Mask, in place, the logits rows of requests that have a grammar so only the tokens
        their grammar allows next stay finite. `requests[i]` is row i's request; with
        speculative decoding, `drafts[i]` is the drafts before row i (a request with k drafts
        d has rows with d[:0], d[:1], ..., d[:k]: consecutive, in that order)."""
        rows = [
            i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.constrains_next
        ]
        if not rows:
            return logits
        num_rows, vocab_size = logits.shape
        bitmask = self._bitmask(num_rows, vocab_size)
        if drafts is None or not any(drafts[i] for i in rows):
            self._fill(bitmask, requests, rows)
        else:
            rows = self._fill_drafts(bitmask, requests, drafts, rows)
        for i in rows:
            grammar = requests[i].grammar
            if grammar.may_open_thinking:
                _allow(bitmask, i, grammar.thinking.start_token_id)
        if rows:
            apply_token_bitmask(logits, bitmask, rows)
        return logits

    def _fill(self, bitmask: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        """Fill `rows` of the bitmask from their requests' grammar states, in one call."""
        self._batch_matcher.batch_fill_next_token_bitmask(
            [requests[i].grammar.matcher for i in rows], bitmask, indices=rows
        )

    def _fill_drafts(
        self,
        bitmask: torch.Tensor,
        requests: list[Request],
        drafts: list[Sequence[int]],
        rows: list[int],
    ) -> list[int]:
        """Fill the rows of requests verifying drafts, depth by depth: the rows after j
        drafts are filled in one call, then each matcher accepts its next draft. The drafts
        were cut to what the grammar allows (`GrammarState.num_valid`); a row after the
        grammar ended is left out. Every matcher is rolled back to where it was. Returns
        the rows filled."""
        by_depth: dict[int, list[int]] = {}
        for i in rows:
            by_depth.setdefault(len(drafts[i]), []).append(i)
        advanced: dict[Request, int] = {}  # drafts each matcher accepted here
        filled: list[int] = []
        try:
            for depth in sorted(by_depth):
                live = []
                for i in by_depth[depth]:
                    request = requests[i]
                    matcher = request.grammar.matcher
                    one_more = depth and advanced.get(request, 0) == depth - 1
                    if one_more and matcher.accept_token(drafts[i][-1]):
                        advanced[request] = depth
                    if advanced.get(request, 0) == depth and not matcher.is_terminated():
                        live.append(i)
                if live:
                    self._fill(bitmask, requests, live)
                    filled.extend(live)
        finally:
            for request, num in advanced.items():
                request.grammar.matcher.rollback(num)
        filled.sort()
        return filled

    def _bitmask(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        if self._xgrammar is None:
            import xgrammar

            self._xgrammar = xgrammar
            self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads="auto")
        width = (vocab_size + 31) // 32
        buffer = self._buffer
        if buffer is None or buffer.shape[0] < num_rows or buffer.shape[1] != width:
            buffer = self._xgrammar.allocate_token_bitmask(max(num_rows, 8), vocab_size)
            self._buffer = buffer
        return buffer[:num_rows]


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set `token_id`'s bit in `row` of an XGrammar bitmask (32 tokens per int32 word)."""
    word, bit = divmod(token_id, 32)
    value = (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32: bit 31 is the sign
    bitmask[row, word] |= value
