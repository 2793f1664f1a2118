"""The `<think>...</think>` family of reasoning parsers (Qwen3, DeepSeek-R1).

A parser is fed the model's text as it is generated (`feed`), then told it ended
(`finish`); each returns the `ReasoningDelta` of that piece. `parse` runs the same on a
whole text, so a streamed response splits exactly as a non-streamed one, whatever the
chunking: text that may be the start of a tag (`</thi` at the end of a piece) is held back
until the next piece decides it.

Where the thinking starts depends on the prompt (`opens_in_prompt`): a chat template that
ends with an open `<think>` (DeepSeek-R1's, Qwen3-Thinking-2507's) has the model think from
its first token; one that ends with a closed block (Qwen3 with `enable_thinking: false`)
has it answer, whatever the parser; one that wrote none has it answer unless the output
itself starts with `<think>` (qwen3) or always think (deepseek_r1).

- `qwen3`: the output thinks only inside a `<think>` block, opened by the output (leading
  whitespace allowed) or by the prompt; anything else is the answer.
- `deepseek_r1`: the output starts thinking (R1 often leaves out the `<think>` its template
  opens) unless the prompt closed it; everything up to `</think>` is reasoning, all of it
  when none comes.

Text cut off inside the thinking (max_tokens) stays reasoning, with no content.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

START = "<think>"
END = "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class _State(Enum):
    BEFORE = "before"  # no text yet: a leading <think> opens the thinking
    THINKING = "thinking"
    ANSWER = "answer"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def opens_in_prompt(prompt_text: str) -> bool:
    """The prompt leaves a `<think>` block open: the output starts inside it."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


def closes_in_prompt(prompt_text: str) -> bool:
    """The prompt ends with a closed thinking block (Qwen3's `enable_thinking: false`
    writes an empty one): the output is the answer."""
    return prompt_text.rstrip().endswith(END)


class ReasoningParser:
    """`<think>` / `</think>` splitting; subclasses say where the output starts."""

    start_tag = START
    end_tag = END
    always_starts_thinking = False

    def __init__(self, prompt_text: str = "") -> None:
        """`prompt_text`: the end of the rendered prompt (where the template may have
        opened the thinking already)."""
        closed = closes_in_prompt(prompt_text)
        thinking = not closed and (self.always_starts_thinking or opens_in_prompt(prompt_text))
        self._state = _State.THINKING if thinking else _State.BEFORE
        if closed:
            self._state = _State.ANSWER
        self._thought = thinking
        self._at_start = True
        """Nothing of the thinking read yet: a leading `<think>` there is skipped."""
        self._buffer = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        out = ReasoningDelta()
        while self._buffer:
            if self._state is _State.ANSWER:
                out.content += self._buffer
                self._buffer = ""
            elif self._at_start:
                stripped = self._buffer.lstrip()
                if stripped.startswith(START):
                    self._buffer = stripped[len(START) :]
                    self._state = _State.THINKING
                    self._thought = True
                    self._at_start = False
                elif not stripped or START.startswith(stripped):
                    return out  # only whitespace or the start of <think> so far
                else:
                    self._at_start = False
                    if self._state is _State.BEFORE:
                        self._state = _State.ANSWER
            else:
                at = self._buffer.find(END)
                if at < 0:
                    cut = len(self._buffer) - _partial_tag(self._buffer, END)
                    out.reasoning += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    return out
                out.reasoning += self._buffer[:at]
                self._buffer = self._buffer[at + len(END) :]
                self._state = _State.ANSWER
        return out

    def finish(self) -> ReasoningDelta:
        """The output ended: what was held back goes where its state says."""
        rest, self._buffer = self._buffer, ""
        if self._state is _State.THINKING:
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=rest)

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning is None when the output did
        not think."""
        first, last = self.feed(text), self.finish()
        reasoning = first.reasoning + last.reasoning
        return (reasoning if self._thought else None), first.content + last.content


class Qwen3ReasoningParser(ReasoningParser):
    pass


class DeepSeekR1ReasoningParser(ReasoningParser):
    always_starts_thinking = True
