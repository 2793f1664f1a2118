"""Structured output in the engine: each constrained request's grammar state, and the step's
one batched token bitmask applied to the logits before sampling.

- `GrammarState` wraps an XGrammar matcher made from the request's compiled grammar (see
  `grammar_compiler.py`). The scheduler's update step advances it with each accepted token
  (`accept_token`); `rollback` takes back tokens a speculative step did not keep. When the
  grammar has ended (`is_finished`), the request finishes with `stop`.
- `GrammarBitmask.apply(logits, requests)` is the model runner's hook: for the rows whose
  request has a grammar it fills one `[rows, ceil(vocab / 32)]` int32 bitmask in a single
  batched call (XGrammar's C++ matchers, no Python loop over the vocabulary) and sets the
  logits of disallowed tokens to -inf with XGrammar's kernel (CPU, CUDA or Triton). Rows
  without a grammar are untouched, so constrained and unconstrained requests share a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nanollmserve.engine.request import Request


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, compiled_grammar: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled_grammar)
        self.num_accepted = 0
        self.num_rejected = 0

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the mask
        makes that impossible unless every token was masked), which ends the request."""
        accepted = self.matcher.accept_token(token_id)
        if accepted:
            self.num_accepted += 1
        else:
            self.num_rejected += 1
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def is_finished(self) -> bool:
        """Nothing may follow: the grammar is complete and its stop token was accepted (or a
        token it does not allow was appended)."""
        return self.num_rejected > 0 or self.matcher.is_terminated()


class GrammarBitmask:
    """The model runner's hook: one batched bitmask per step over the rows with a grammar.
    XGrammar's batch matcher and the bitmask buffer are made on first use, so a runner that
    never sees a grammar never imports XGrammar."""

    def __init__(self) -> None:
        self._xgrammar = None
        self._batch_matcher = None
        self._buffer: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Mask, in place, the logits rows (one per request, in order) of requests that have
        a grammar so only the tokens their grammar allows next stay finite."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return logits
        num_rows, vocab_size = logits.shape
        bitmask = self._bitmask(num_rows, vocab_size)
        self._batch_matcher.batch_fill_next_token_bitmask(
            [requests[i].grammar.matcher for i in rows], bitmask, indices=rows
        )
        self._xgrammar.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=vocab_size, indices=rows
        )
        return logits

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
