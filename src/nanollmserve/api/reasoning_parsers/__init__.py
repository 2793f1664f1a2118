"""Reasoning parsers: a reasoning model's text -> its thinking and its answer.

`--reasoning-parser NAME` picks one by vLLM's names (`REASONING_PARSERS`); chat
completions put the thinking in `reasoning_content` and the answer in `content`, and
`/v1/responses` makes the thinking a `reasoning` output item.
"""

from __future__ import annotations

from nanollmserve.api.reasoning_parsers.think_tags import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
]
