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
    StreamOptions,
    TokenId,
    UsageInfo,
    sampling_params,
)
from nanollmserve.sampling_params import MAX_LOGPROBS, SamplingParams


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class ChatCompletionRequest(OpenAIBaseModel):
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

    # -- nanollmserve extensions (vLLM names) -------------------------------------------------
    top_k: int | None = Field(
        default=None, ge=-1, le=MAX_INT32, description="Sample from the k most likely (0/-1: all)."
    )
    min_p: float | None = Field(default=None, description="Drop tokens below min_p * top prob.")
    repetition_penalty: float | None = Field(
        default=None, description="Divide the logits of tokens already seen (1 = off)."
    )
    min_tokens: int | None = Field(
        default=None, ge=0, le=MAX_INT32, description="Generate at least this many tokens."
    )
    ignore_eos: bool | None = Field(default=None, description="Keep going past end-of-text.")
    stop_token_ids: list[TokenId] | None = Field(
        default=None, description="Token ids that end the output, like stop strings."
    )
    include_stop_str_in_output: bool | None = Field(
        default=None, description="Keep the matched stop string at the end of the text."
    )
    skip_special_tokens: bool | None = Field(
        default=None, description="Leave special tokens out of the text (default true)."
    )

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
        max_tokens = self.max_completion_tokens or self.max_tokens
        return sampling_params(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            skip_special_tokens=self.skip_special_tokens,
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
