"""`ToolParser`: what every tool-call parser does, and what one piece of output becomes.

A parser is fed the model's text as it is generated (`feed`), then told it ended
(`finish`); each returns the `ParsedDelta` of that piece: text that stays content and the
`delta.tool_calls` of the calls. `parse` runs the same on a whole text, which is what a
non-streaming response uses, so a streamed response holds the same calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nanollmserve.api.tool_parsers.calls import ToolCall, ToolCallDelta, ToolCallError


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser:
    """Subclasses implement `feed` and `finish`, and fill `calls` as calls complete."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        """The output ended: what was held back (a possible start of a tag). Raises
        ToolCallError when a call was left unfinished."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; raises ToolCallError as `feed` does."""
        first, last = self.feed(text), self.finish()
        content = (first.content + last.content).strip()
        return content or None, self.calls


__all__ = ["ParsedDelta", "ToolCall", "ToolCallDelta", "ToolCallError", "ToolParser"]
