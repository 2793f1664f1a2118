"""Parsers of forced calls (`tool_choice` "required" or a named function), whose whole
output the grammar shapes:

- `RequiredCallsParser`: a JSON list of `{"name": ..., "arguments": {...}}` objects, at
  least one (the grammar built in `api/tool_choice.py`).
- `NamedCallParser`: the arguments object of the one named function; every piece of text
  is an argument fragment.
"""

from __future__ import annotations

from nanollmserve.api.tool_parsers.base import ParsedDelta, ToolCallError, ToolParser
from nanollmserve.api.tool_parsers.calls import JsonCallReader, ToolCall, ToolCallDelta


class RequiredCallsParser(ToolParser):
    def __init__(self) -> None:
        super().__init__()
        self._reader = JsonCallReader()
        self.calls = self._reader.calls

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(tool_calls=self._reader.feed(text))

    def finish(self) -> ParsedDelta:
        if self._reader.in_call:
            raise ToolCallError("the output ended inside a tool call")
        if not self.calls:
            raise ToolCallError("tool_choice required, but the output holds no call")
        return ParsedDelta()


class NamedCallParser(ToolParser):
    def __init__(self, name: str) -> None:
        super().__init__()
        self._call = ToolCall(name=name, arguments="")

    def feed(self, text: str) -> ParsedDelta:
        deltas = []
        if not self.calls:
            self.calls.append(self._call)
            deltas.append(ToolCallDelta(0, id=self._call.id, name=self._call.name))
        if text:
            self._call.arguments += text
            deltas.append(ToolCallDelta(0, arguments=text))
        return ParsedDelta(tool_calls=deltas)

    def finish(self) -> ParsedDelta:
        return self.feed("")
