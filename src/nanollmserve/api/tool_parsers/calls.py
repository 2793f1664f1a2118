"""Tool calls as the API returns them, and the incremental reader of JSON call objects.

A model writes a call as a JSON object `{"name": "get_weather", "arguments": {...}}`
(`"parameters"` is read as `"arguments"` too), alone or in a list. `JsonCallReader` is fed
that text piece by piece and reports, per call, a header (its index and name) as soon as the
name is complete, then the raw text of the arguments object as it arrives, and the parsed
call when the object closes. Streaming (`delta.tool_calls` argument fragments) and the
whole-text extraction run the same reader, so both see the same calls and arguments.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

_ARGUMENT_KEYS = ("arguments", "parameters")


def tool_call_id() -> str:
    """`call_` + 24 hex digits, the id of one call (OpenAI's `call_...`)."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    """One complete call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=tool_call_id)


@dataclass
class ToolCallDelta:
    """What is new for call `index`: its id and name in its first delta, then argument
    text (`arguments` may be "" in the first one)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


class ToolCallError(ValueError):
    """The model wrote something that is not a call object (invalid JSON, no name)."""


@dataclass
class _Call:
    raw: list[str] = field(default_factory=list)
    """The object's text so far."""
    name: str | None = None
    id: str | None = None
    """Set when the call's header delta is sent."""
    arguments: list[str] = field(default_factory=list)
    """The raw text of the arguments object so far."""
    num_sent: int = 0
    """How many pieces of `arguments` deltas have carried."""


class JsonCallReader:
    """Reads `{"name": ..., "arguments": {...}}` objects from text fed in pieces; anything
    around them outside an object (`[`, `,`, whitespace) is skipped. `feed` returns the
    deltas of the new text; `calls` holds the calls whose object has closed."""

    def __init__(self, first_index: int = 0) -> None:
        self.calls: list[ToolCall] = []
        self._next_index = first_index
        self._call: _Call | None = None
        self._depth = 0
        """Nesting inside the current call object (0: between objects)."""
        self._in_string = False
        self._escape = False
        self._string: list[str] = []
        self._key: str | None = None
        """The call object's key whose value is being read."""
        self._expect_key = False
        self._capture_name = False
        self._arguments_depth: int | None = None
        """Depth of the arguments object being streamed (its braces included)."""

    @property
    def in_call(self) -> bool:
        return self._call is not None

    def feed(self, text: str) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        for ch in text:
            if self._call is None:
                if ch == "{":
                    self._open_call()
                continue
            self._call.raw.append(ch)
            if self._arguments_depth is not None:
                self._argument_char(ch, deltas)
            if self._in_string:
                self._string_char(ch)
                continue
            if ch == '"':
                self._in_string = True
                self._string = []
            elif ch in "{[":
                self._depth += 1
                if ch == "{" and self._depth == 2 and self._key in _ARGUMENT_KEYS:
                    self._arguments_depth = 2
                    self._argument_char(ch, deltas)
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    deltas.extend(self._close_call())
            elif ch == ":" and self._depth == 1:
                self._expect_key = False
                self._capture_name = self._key == "name"
            elif ch == "," and self._depth == 1:
                self._expect_key = True
                self._key = None
        return deltas

    def _open_call(self) -> None:
        self._call = _Call(raw=["{"])
        self._depth = 1
        self._expect_key = True
        self._key = None

    def _string_char(self, ch: str) -> None:
        if self._escape:
            self._escape = False
            self._string.append(ch)
        elif ch == "\\":
            self._escape = True
            self._string.append(ch)
        elif ch == '"':
            self._in_string = False
            if self._depth == 1:
                value = json.loads('"' + "".join(self._string) + '"')
                if self._expect_key:
                    self._key = value
                elif self._capture_name:
                    self._call.name = value
                    self._capture_name = False
        else:
            self._string.append(ch)

    def _argument_char(self, ch: str, deltas: list[ToolCallDelta]) -> None:
        """`ch` belongs to the streamed arguments object (called before depth changes, so
        the closing brace is still inside)."""
        call = self._call
        call.arguments.append(ch)
        if not self._in_string and ch == "}" and self._depth == self._arguments_depth:
            self._arguments_depth = None
        if call.name is None:
            return  # sent once the name is known
        index = self._next_index
        if call.id is None:
            call.id = tool_call_id()
            deltas.append(ToolCallDelta(index, id=call.id, name=call.name))
        text = "".join(call.arguments[call.num_sent :])
        call.num_sent = len(call.arguments)
        if deltas and deltas[-1].index == index and deltas[-1].name is None:
            deltas[-1].arguments += text
        else:
            deltas.append(ToolCallDelta(index, arguments=text))

    def _close_call(self) -> list[ToolCallDelta]:
        """The call object closed: parse it; say what the stream has not said yet."""
        call, self._call = self._call, None
        self._arguments_depth = None
        raw = "".join(call.raw)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"a tool call is not valid JSON: {exc}") from None
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str) or not name:
            raise ToolCallError("a tool call has no function name")
        arguments = next((value[k] for k in _ARGUMENT_KEYS if k in value), {})
        if isinstance(arguments, str):
            text = arguments  # some models write the arguments as a JSON string
        elif call.arguments:
            text = "".join(call.arguments)  # as written, so the deltas add up to it
        else:
            text = json.dumps(arguments, ensure_ascii=False)
        index = self._next_index
        self._next_index += 1
        deltas = []
        if call.id is None:
            call.id = tool_call_id()
            deltas.append(ToolCallDelta(index, id=call.id, name=name))
        sent = "".join(call.arguments[: call.num_sent])
        if text.startswith(sent):
            if text[len(sent) :]:
                deltas.append(ToolCallDelta(index, arguments=text[len(sent) :]))
        else:
            raise ToolCallError("a tool call's arguments are not a JSON object")
        self.calls.append(ToolCall(name=name, arguments=text, id=call.id))
        return deltas
