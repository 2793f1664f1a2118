"""Protocol models of `/v1/chat/completions`, in OpenAI's order.

Messages are text only (a string or a list of text parts); tools and structured output
(`response_format` json_object / json_schema) answer 400 "not supported yet".
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, model_serializer

from nanollmserve.api.protocol import (
    MAX_INT32,
    MAX_N,
    ChatMessage,
    OpenAIBaseModel,
    SamplingExtensions,
    StreamOptions,
    UsageInfo,
)
from nanollmserve.sampling_params import MAX_LOGPROBS, SamplingParams


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _ChatCompletionFields(OpenAIBaseModel):
    """The OpenAI fields of ChatCompletionRequest, in OpenAI's order."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    """The served model name; may be left out (there is one model)."""
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_INT32, deprecated="use max_completion_tokens"
    )
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = 0.0
    response_format: ResponseFormat | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingExtensions, _ChatCompletionFields):
    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of a feature this server does not have yet, if one is asked for."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format", (
                f"response_format type {self.response_format.type!r} is not supported yet "
                "(structured output); use 'text'"
            )
        if self.tools:
            return "tools", "tools are not supported yet"
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        return None

    def message_dicts(self) -> list[dict]:
        return [m.to_dict() for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params_with(
            max_tokens=self.max_completion_tokens or self.max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


# -- responses ---------------------------------------------------------------------------------
class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogprobs(OpenAIBaseModel):
    content: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    """Only what is new: the role in a choice's first chunk, then text; unset parts are left
    out of the JSON (the last chunk's delta is often `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
