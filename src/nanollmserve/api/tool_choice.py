"""What a request's `tools` and `tool_choice` make of it: `plan_tools` returns a
`ToolPlan`, the tools the chat template renders, the grammar of a forced call and the
parser of the output (chat completions and responses share it).

- no tools, or `none`: the tools are not rendered and the output is plain content;
- `auto` (the default with tools): the model decides; the server's `--tool-call-parser`
  reads calls out of its text, and text that is not a call stays content. Without
  `--enable-auto-tool-choice` it is a 400, as in vLLM;
- `required`: the grammar forces a JSON list of at least one `{"name", "arguments"}` object
  whose arguments follow that function's schema (one object without parallel_tool_calls);
- a named function: the grammar forces that function's arguments object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from nanollmserve.api.errors import bad_request
from nanollmserve.api.protocol_tools import FunctionDefinition
from nanollmserve.api.tool_parsers import (
    TOOL_PARSERS,
    NamedCallParser,
    ParsedDelta,
    RequiredCallsParser,
    ToolCall,
    ToolCallError,
    ToolParser,
)
from nanollmserve.sampling_params import SamplingParams
from nanollmserve.structured_outputs import StructuredOutputsParams


@dataclass
class ToolPlan:
    template_tools: list[dict] | None
    """The tools as the chat template reads them (None: render none)."""
    make_parser: Callable[[], ToolParser] | None
    """A fresh parser per choice (None: the output is all content)."""
    structured_outputs: StructuredOutputsParams | None
    """The grammar of a forced call."""

    @property
    def parses_calls(self) -> bool:
        return self.make_parser is not None

    def parse(self, text: str, engine_reason: str | None) -> ChoiceTools:
        """Content, calls and finish reason of a whole output. Text the parser cannot read
        as calls (a call cut off by max_tokens, invalid JSON) stays content."""
        if self.make_parser is None:
            return ChoiceTools(text, [], engine_reason)
        try:
            content, calls = self.make_parser().parse(text)
        except ToolCallError:
            return ChoiceTools(text, [], engine_reason)
        return ChoiceTools(content, calls, tool_finish_reason(calls, engine_reason))

    def stream(self) -> ToolStream:
        return ToolStream(self.make_parser())


NO_TOOLS = ToolPlan(None, None, None)


def plan_tools(
    functions: list[FunctionDefinition],
    choice: str,
    *,
    tool_call_parser: str | None,
    parallel_tool_calls: bool | None = None,
    param: str = "tool_choice",
) -> ToolPlan:
    """`choice` is "none", "auto", "required" or a function's name (the request's named
    choice); `tool_call_parser` the server's parser for "auto" (None: auto is off)."""
    named = choice not in ("none", "auto", "required")
    if not functions:
        if choice == "required" or named:
            raise bad_request(f"{param} {choice!r} needs tools", param)
        return NO_TOOLS
    tools = template_tools(functions)
    if choice == "none":
        return NO_TOOLS
    names = [f.name for f in functions]
    if choice == "auto":
        if tool_call_parser is None:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                param,
            )
        return ToolPlan(tools, TOOL_PARSERS[tool_call_parser], None)
    if choice == "required":
        schema = _calls_schema(functions, single=parallel_tool_calls is False)
        return ToolPlan(tools, RequiredCallsParser, StructuredOutputsParams(json=schema))
    function = next((f for f in functions if f.name == choice), None)
    if function is None:
        raise bad_request(f"{param}: no tool is named {choice!r} (tools: {names})", param)
    schema = function.parameters_schema()
    return ToolPlan(
        tools, lambda: NamedCallParser(function.name), StructuredOutputsParams(json=schema)
    )


def template_tools(functions: list[FunctionDefinition]) -> list[dict]:
    """The functions as the chat template reads them (a 400 if two share a name)."""
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique", "tools")
    return [f.template_dict() for f in functions]


def _calls_schema(functions: list[FunctionDefinition], single: bool) -> dict:
    """A JSON list of calls, each one of the functions with arguments that follow its schema
    (vLLM's schema for `required`, with OpenAI's key `arguments`)."""
    call = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [f.name]},
                "arguments": f.parameters_schema(),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = {
        "type": "array",
        "minItems": 1,
        "items": call[0] if len(call) == 1 else {"anyOf": call},
    }
    if single:
        schema["maxItems"] = 1
    return schema


def with_tool_grammar(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """`params` with the forced call's grammar, if the plan has one (a 400 when the request
    already asks for another output format)."""
    if plan.structured_outputs is None:
        return params
    if params.structured_outputs is not None:
        raise bad_request(
            'tool_choice "required" or a named function cannot be combined with another '
            "output format (response_format, structured_outputs)",
            "tool_choice",
        )
    return dataclasses.replace(params, structured_outputs=plan.structured_outputs)


@dataclass
class ChoiceTools:
    """One choice's output read for tool calls (`ToolPlan.parse` for a whole text,
    `ToolPlan.stream` piece by piece)."""

    content: str | None
    calls: list[ToolCall]
    finish_reason: str | None


def tool_finish_reason(calls: list, engine_reason: str | None) -> str | None:
    """ "tool_calls" when the output made calls and ended by itself; "length" stays."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


class ToolStream:
    """One streamed choice read for tool calls: `feed` each text delta, `finish` with the
    engine's finish reason. A call the output leaves unfinished was already streamed in
    part; it ends there (its finish reason says why, usually "length")."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.failed = False
        """The parser met text it cannot read as calls: the rest is content."""

    def feed(self, text: str) -> ParsedDelta:
        if self.failed:
            return ParsedDelta(content=text)
        try:
            return self.parser.feed(text)
        except ToolCallError:
            self.failed = True
            return ParsedDelta()

    def finish(self, engine_reason: str | None) -> tuple[ParsedDelta, str | None]:
        if self.failed:
            return ParsedDelta(), tool_finish_reason(self.parser.calls, engine_reason)
        try:
            last = self.parser.finish()
        except ToolCallError:
            last = ParsedDelta()
        return last, tool_finish_reason(self.parser.calls, engine_reason)
