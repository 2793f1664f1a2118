"""SpecDecodeStats: how many tokens were proposed and how many the target kept.

The numbers of vLLM's `spec_decode_*` metrics: drafts (a request's proposals checked in one
step), draft tokens, accepted tokens, and accepted tokens by position (position 0 is the
first draft of a step, accepted in `num_accepted_tokens_per_pos[0]` of the drafts). One step's
numbers travel in its `StepStats`; `EngineCounters` keeps the totals.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """One request's k drafts checked in one step, the first `num_accepted_tokens` kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        self._grow(num_draft_tokens)
        for position in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[position] += 1

    def add(self, other: SpecDecodeStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self._grow(len(other.num_accepted_tokens_per_pos))
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[position] += count

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos),
        )

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per draft step: 1 (the target's own) + the accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Of the drafts, the fraction whose token at each position was accepted."""
        if not self.num_drafts:
            return [0.0] * len(self.num_accepted_tokens_per_pos)
        return [count / self.num_drafts for count in self.num_accepted_tokens_per_pos]

    def _grow(self, length: int) -> None:
        missing = length - len(self.num_accepted_tokens_per_pos)
        if missing > 0:
            self.num_accepted_tokens_per_pos.extend([0] * missing)
