"""Protocol models of `/v1/responses` (OpenAI's Responses API).

A request has `instructions` (a system message), `input` (a string or items: messages,
`function_call`s and `function_call_output`s of earlier turns) and may continue a stored
response (`previous_response_id`); function `tools` and `tool_choice` work as on chat
(`tool_choice.py`), written flat (`{"type": "function", "name": ...}`). The response
object, its output items (`message`, `function_call`) and the streaming events
(`responses_stream.py`) follow OpenAI's shapes. docs/api/server.md has the parity table:
every request field, supported, accepted and ignored, or a 400 naming it.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from nanollmserve.api.protocol import (
    CACHE_SALT_DESCRIPTION,
    MAX_INT32,
    OpenAIBaseModel,
    RequestModel,
    priority_field,
    sampling_params,
)
from nanollmserve.api.protocol_tools import (
    ChatCompletionMessageToolCall,
    FunctionCall,
    FunctionDefinition,
)
from nanollmserve.sampling_params import SamplingParams

LOGPROBS_INCLUDE = "message.output_text.logprobs"
IGNORED_INCLUDES = ("reasoning.encrypted_content",)
"""Accepted and ignored: the served models do not reason."""


# -- input items -------------------------------------------------------------------------------
class InputTextPart(OpenAIBaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputTextPart]

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class FunctionCallItem(OpenAIBaseModel):
    """A call the model made (an output item, sent back as input in the next turn)."""

    type: Literal["function_call"] = "function_call"
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(OpenAIBaseModel):
    """The result of a call, for the next turn."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, list):
            return "".join(part.text for part in self.output)
        return self.output


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    """A reasoning model's thinking (`--reasoning-parser`): an output item; sent back as
    input it is skipped (the chat templates drop earlier turns' thinking)."""

    type: Literal["reasoning"]
    """Required (no default), so an input item of no known type is not taken for one."""
    id: str | None = None
    summary: list[dict] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


def items_to_messages(items: list[InputItem]) -> list[dict]:
    """Input items as chat messages: calls join the assistant message just before them (or
    make one), outputs become `tool` messages."""
    messages: list[dict] = []
    for item in items:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, ReasoningItem):
            continue
        elif isinstance(item, FunctionCallItem):
            function = FunctionCall(name=item.name, arguments=item.arguments)
            call = ChatCompletionMessageToolCall(id=item.call_id, function=function)
            if not (messages and messages[-1]["role"] == "assistant"):
                messages.append({"role": "assistant", "content": ""})
            messages[-1].setdefault("tool_calls", []).append(call.template_dict())
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


# -- tools and formats -------------------------------------------------------------------------
class FunctionTool(OpenAIBaseModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def definition(self) -> FunctionDefinition:
        return FunctionDefinition(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def to_dict(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None
    """Accepted and ignored (the length follows max_output_tokens and the model)."""


class StreamOptions(OpenAIBaseModel):
    include_obfuscation: bool | None = None
    """Accepted and ignored: events carry no obfuscation padding."""


class ResponsesRequest(RequestModel):
    background: bool | None = None
    conversation: str | dict | None = None
    include: list[str] | None = None
    input: str | list[InputItem]
    """A list has at most `--max-messages` (1024) items."""
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_tool_calls: int | None = Field(default=None, ge=0, le=MAX_INT32)
    """Accepted and ignored: it bounds built-in tools, and there are none."""
    metadata: dict[str, str] | None = None
    """At most 16 pairs, keys of at most 64 characters, values of at most 512 (OpenAI's
    limits, the `--max-metadata-*` defaults; checked by the route)."""
    model: str | None = None
    """The served model name; may be left out (there is one model)."""
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt: dict | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    reasoning: dict | None = None
    """Accepted and ignored (with `--reasoning-parser` a reasoning model's thinking is a
    `reasoning` output item)."""
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = 1.0
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    tools: list[dict] | None = None
    """Function tools; another type (web_search, file_search, ...) is a 400 naming it."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_INT32)
    """With `include: ["message.output_text.logprobs"]`: alternatives per token (at most
    `--max-logprobs`, 20)."""
    top_p: float | None = 1.0
    truncation: Literal["auto", "disabled"] | None = None
    """"auto": the oldest turns are dropped until the conversation fits the context;
    "disabled" (default): a conversation that does not fit is a 400."""
    user: str | None = None

    # -- nanollmserve extensions (vLLM names) -------------------------------------------------
    seed: int | None = Field(
        default=None, ge=0, lt=2**63, description="Seed of this request's sampling."
    )
    top_k: int | None = Field(
        default=None, ge=-1, le=MAX_INT32, description="Sample from the k most likely (0/-1: all)."
    )
    cache_salt: str | None = Field(default=None, description=CACHE_SALT_DESCRIPTION)
    priority: int | None = priority_field()

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of a field asked for that this server does not do."""
        if self.background:
            return "background", "background responses are not supported"
        if self.conversation is not None:
            return "conversation", (
                "conversations are not supported; continue a response with previous_response_id"
            )
        if self.prompt is not None:
            return "prompt", "prompt templates are not supported; send input and instructions"
        for value in self.include or []:
            if value != LOGPROBS_INCLUDE and value not in IGNORED_INCLUDES:
                return "include", (
                    f"include {value!r} is not supported (supported: {LOGPROBS_INCLUDE!r})"
                )
        for i, tool in enumerate(self.tools or []):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                return f"tools[{i}].type", (
                    f"tool type {kind!r} is not supported; only function tools are"
                )
        return None

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def functions(self) -> list[FunctionDefinition]:
        return [FunctionTool.model_validate(tool).definition() for tool in self.tools or []]

    def tool_choice_name(self) -> str:
        """ "none", "auto", "required" or the named function."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, FunctionToolChoice):
            return self.tool_choice.name
        return self.tool_choice

    def input_messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input)

    def to_sampling_params(self) -> SamplingParams:
        return sampling_params(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            cache_salt=self.cache_salt,
            priority=self.priority,
            max_tokens=self.max_output_tokens,
            logprobs=(self.top_logprobs or 0) if self.wants_logprobs() else None,
        )


# -- the response ------------------------------------------------------------------------------
class TopLogprob(OpenAIBaseModel):
    token: str
    bytes: list[int]
    logprob: float


class TokenLogprob(OpenAIBaseModel):
    token: str
    bytes: list[int]
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "in_progress", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    text: dict = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict = "auto"
    tools: list[dict] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)

    @property
    def output_text(self) -> str:
        return "".join(
            part.text
            for item in self.output
            if isinstance(item, OutputMessage)
            for part in item.content
        )


class ResponseDeleted(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
