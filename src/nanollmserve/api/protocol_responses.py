"""Protocol models of `/v1/responses` (OpenAI's Responses API), text only.

A request has `instructions` (a system message), `input` (a string or message items) and
may continue a stored response (`previous_response_id`). The response object and the
streaming events follow OpenAI's shapes: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done, response.output_item.done,
response.completed.

Fields that only label or route a request at OpenAI (`user`, `metadata`, `service_tier`,
`prompt_cache_key`, `safety_identifier`) or change nothing without tools or reasoning
(`parallel_tool_calls`, `tool_choice`, `reasoning`) are accepted and ignored; `background`
and `include` answer 400 "not supported"; any other unknown field is a 400.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field

from nanollmserve.api.protocol import MAX_INT32, OpenAIBaseModel, RequestModel, sampling_params
from nanollmserve.sampling_params import SamplingParams


class InputTextPart(OpenAIBaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputTextPart]

    def to_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class TextFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"] = "text"


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(RequestModel):
    model: str | None = None
    """The served model name; may be left out (there is one model)."""
    input: str | list[InputMessage]
    """A list has at most `--max-messages` (1024) items."""
    background: bool | None = None
    include: list[str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    reasoning: dict | None = None
    """Accepted and ignored: the served models do not reason."""
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool = True
    stream: bool = False
    temperature: float | None = 1.0
    text: TextConfig | None = None
    tool_choice: str | dict | None = None
    tools: list[dict] | None = None
    top_p: float | None = 1.0
    truncation: Literal["disabled"] | None = None
    """Only "disabled": a conversation longer than the context is a 400, never cut."""
    user: str | None = None

    # -- nanollmserve extensions (vLLM names) -------------------------------------------------
    seed: int | None = Field(
        default=None, ge=0, lt=2**63, description="Seed of this request's sampling."
    )
    top_k: int | None = Field(
        default=None, ge=-1, le=MAX_INT32, description="Sample from the k most likely (0/-1: all)."
    )

    def unsupported(self) -> tuple[str, str] | None:
        if self.text is not None and self.text.format.type != "text":
            return "text.format", (
                f"text.format type {self.text.format.type!r} is not supported yet "
                "(structured output); use 'text'"
            )
        if self.tools:
            return "tools", "tools are not supported yet"
        if self.background:
            return "background", "background responses are not supported"
        if self.include:
            return "include", "include is not supported (no extra output data)"
        return None

    def input_messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [m.to_dict() for m in self.input]

    def to_sampling_params(self) -> SamplingParams:
        return sampling_params(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=self.max_output_tokens,
        )


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


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


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "in_progress", "incomplete", "failed"]
    error: dict | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = False
    previous_response_id: str | None = None
    store: bool = True
    temperature: float | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto", "required"] = "auto"
    tools: list[dict] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
