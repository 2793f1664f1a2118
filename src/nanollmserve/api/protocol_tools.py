"""Protocol models of function tools on `/v1/chat/completions`, in OpenAI's shapes: the
`tools` a request offers, its `tool_choice`, the `tool_calls` of an assistant message (in
a response, a streamed delta, or a message the client sends back), and the conversion of
assistant tool calls into what a chat template reads.

`/v1/responses` writes the same things flat (`{"type": "function", "name": ...}`); its
models live in `protocol_responses.py` and convert into these.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, model_serializer

from nanollmserve.api.protocol_base import OpenAIBaseModel


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    """A JSON schema of the arguments object (none: no arguments)."""
    strict: bool | None = None
    """Accepted; forced calls (`required`, a named function) always follow the schema."""

    def template_dict(self) -> dict:
        """The function as chat templates read it (`tools=` of apply_chat_template)."""
        fn = {"name": self.name, "parameters": self.parameters_schema()}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}

    def parameters_schema(self) -> dict:
        return self.parameters or {"type": "object", "properties": {}}


class ChatCompletionToolParam(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str
    """The arguments as a JSON string."""


class ChatCompletionMessageToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict:
        """As chat templates read an assistant's call: arguments as an object (as vLLM and
        the Hugging Face templates expect), or the string when it is not JSON."""
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": arguments},
        }


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    """One call's new part in a stream chunk: id, type and name in its first delta, then
    argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}
