"""The `hermes` tool-call parser: calls written as `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` (Hermes, Qwen2.5/Qwen3), or as a JSON list of such objects inside one
`<tool_call>` block (SmolLM2's format; `[]` means no call). Text outside the blocks is
content; whitespace between and after calls is dropped.

Streaming holds back text that may be the start of a tag (`<tool_` at the end of a piece)
until the next piece decides it.
"""

from __future__ import annotations

from nanollmserve.api.tool_parsers.base import ParsedDelta, ToolCallError, ToolParser
from nanollmserve.api.tool_parsers.calls import JsonCallReader

START = "<tool_call>"
END = "</tool_call>"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesToolParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._reader = JsonCallReader()
        self.calls = self._reader.calls
        self._buffer = ""
        self._in_block = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            tag = END if self._in_block else START
            at = self._buffer.find(tag)
            if at < 0:
                cut = len(self._buffer) - _partial_tag(self._buffer, tag)
                self._take(self._buffer[:cut], out)
                self._buffer = self._buffer[cut:]
                return out
            self._take(self._buffer[:at], out)
            self._buffer = self._buffer[at + len(tag) :]
            if self._in_block and self._reader.in_call:
                raise ToolCallError(f"a tool call ends with {END} inside its JSON")
            self._in_block = not self._in_block

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        self._take(self._buffer, out)
        self._buffer = ""
        if self._reader.in_call:
            raise ToolCallError("the output ended inside a tool call")
        return out

    def _take(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        if self._in_block:
            out.tool_calls.extend(self._reader.feed(text))
        elif not self.calls or text.strip():
            out.content += text
