"""Tool-call parsers: the model's text -> content and OpenAI tool calls.

`--tool-call-parser NAME` picks the parser of `tool_choice: "auto"` by vLLM's names
(`TOOL_PARSERS`); the forced calls of "required" and a named function have their own
(`forced.py`), whatever the model.
"""

from __future__ import annotations

from nanollmserve.api.tool_parsers.base import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallError,
    ToolParser,
)
from nanollmserve.api.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from nanollmserve.api.tool_parsers.hermes import HermesToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "NamedCallParser",
    "ParsedDelta",
    "RequiredCallsParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallError",
    "ToolParser",
]
