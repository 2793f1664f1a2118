"""What the server's `--reasoning-parser` makes of one chat request: `plan_reasoning` reads
the end of the rendered prompt (did the template open the thinking, or close it?) and
returns a `ReasoningPlan` (a fresh parser per choice) and the sampling parameters, whose
grammar (structured output, a forced tool call) then waits for the end of the thinking.

The grammar can wait only for tags that are single tokens of the vocabulary (Qwen3's and
DeepSeek-R1's are); with any other tokenizer structured output and reasoning together are
a 400.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanollmserve.api.errors import bad_request
from nanollmserve.api.reasoning_parsers.think_tags import (
    ReasoningParser,
    closes_in_prompt,
    opens_in_prompt,
)
from nanollmserve.frontend.async_engine import AsyncEngine
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.structured_outputs import ThinkingSpan

PROMPT_TAIL_TOKENS = 32
"""How many of the prompt's last tokens are read for an open or closed `<think>`."""


@dataclass
class ReasoningPlan:
    parser_class: type[ReasoningParser]
    prompt_tail: str

    def parser(self) -> ReasoningParser:
        return self.parser_class(self.prompt_tail)


async def plan_reasoning(
    engine: AsyncEngine,
    parser_class: type[ReasoningParser] | None,
    prompt_token_ids: list[int],
    params: SamplingParams,
    param: str = "response_format",
) -> tuple[ReasoningPlan | None, SamplingParams]:
    """The plan (None without a reasoning parser) and `params` with a grammar that waits
    for the thinking; `param` names the grammar's field in a 400."""
    if parser_class is None:
        return None, params
    tail = await engine.detokenize(prompt_token_ids[-PROMPT_TAIL_TOKENS:])
    plan = ReasoningPlan(parser_class, tail)
    grammar = params.structured_outputs
    if grammar is None:
        return plan, params
    if closes_in_prompt(tail):
        return plan, params  # the template closed the thinking: the grammar starts at once
    open_at_start = parser_class.always_starts_thinking or opens_in_prompt(tail)
    span = ThinkingSpan(
        start_token_id=_single_token(engine, parser_class.start_tag, param),
        end_token_id=_single_token(engine, parser_class.end_tag, param),
        open_at_start=open_at_start,
    )
    grammar = dataclasses.replace(grammar, after_thinking=span)
    return plan, dataclasses.replace(params, structured_outputs=grammar)


def _single_token(engine: AsyncEngine, tag: str, param: str) -> int:
    ids = engine.tokenizer.encode(tag, add_special_tokens=False)
    if len(ids) != 1:
        raise bad_request(
            f"{param} with --reasoning-parser needs {tag} to be one token of the model's "
            f"vocabulary (it is {len(ids)}), so the grammar can start after the thinking",
            param,
        )
    return ids[0]
