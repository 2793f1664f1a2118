"""Protocol models of `/v1/chat/completions`, in OpenAI's order.

Messages are text (a string or a list of text parts), plus an assistant's `tool_calls` and
`tool` results; function `tools` and `tool_choice` follow `tool_choice.py`, and
`response_format` / `structured_outputs` follow `response_format.py`. Fields that only
label or route a request at OpenAI (`user`, `metadata`, `store`, `service_tier`,
`prompt_cache_key`, `safety_identifier`) or that change nothing for this server's models
(`reasoning_effort`) are accepted and ignored; any other unknown field is a 400. vLLM's
extras `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` shape
the rendered prompt; with `--reasoning-parser` the message (delta) carries
`reasoning_content`.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, model_serializer, model_validator

from nanollmserve.api.llamacpp_protocol import Timings
from nanollmserve.api.protocol import (
    MAX_INT32,
    ChatMessage,
    OpenAIBaseModel,
    RequestModel,
    SamplingExtensions,
    StreamOptions,
    UsageInfo,
)
from nanollmserve.api.protocol_base import PromptLogprobsJSON, TokenIOModel
from nanollmserve.api.protocol_kv_transfer import KVTransferResultJSON
from nanollmserve.api.protocol_tools import (
    ChatCompletionMessageToolCall,
    ChatCompletionToolParam,
    DeltaToolCall,
    FunctionDefinition,
    NamedToolChoice,
    ToolChoice,
)
from nanollmserve.frontend.chat_template_kwargs import check_chat_template_kwargs
from nanollmserve.sampling_params import SamplingParams


class ResponseFormat(OpenAIBaseModel):
    """`json_object`: any JSON object; `json_schema`: `{"name", "schema", "strict"}`, the
    output validates against `schema` (always held to it, as with strict true)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


class _ChatCompletionFields(RequestModel):
    """The OpenAI fields of ChatCompletionRequest, in OpenAI's order. The last base's config
    wins, so ChatCompletionRequest forbids unknown fields like this class."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    """The served model name; may be left out (there is one model)."""
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_INT32)
    """At most `--max-logprobs` (20)."""
    max_tokens: int | None = Field(
        default=None, ge=1, le=MAX_INT32, deprecated="use max_completion_tokens"
    )
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    metadata: dict[str, str] | None = None
    """Accepted and ignored (labels for OpenAI's stored completions)."""
    n: int = Field(default=1, ge=1, le=MAX_INT32)
    """At most `--max-n` (128) and `--max-num-seqs`."""
    parallel_tool_calls: bool | None = None
    """false: `tool_choice` "required" forces exactly one call."""
    presence_penalty: float | None = 0.0
    prompt_cache_key: str | None = None
    """Accepted and ignored: prefix caching needs no key."""
    reasoning_effort: str | None = None
    """Accepted and ignored (a reasoning model's thinking is switched by its template, e.g.
    `chat_template_kwargs: {"enable_thinking": false}`)."""
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None
    """Accepted and ignored."""
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    service_tier: str | None = None
    """Accepted and ignored: there is one tier."""
    stop: str | list[str] | None = None
    """At most `--max-stop-strings` (16) of at most `--max-stop-string-length` (256)."""
    store: bool | None = None
    """Accepted and ignored: chat completions are not stored (see /v1/responses)."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    tools: list[ChatCompletionToolParam] | None = None
    tool_choice: ToolChoice | None = None
    """Default "auto" with tools ("none" without)."""
    user: str | None = None
    """Accepted and ignored."""


class ChatCompletionRequest(SamplingExtensions, _ChatCompletionFields):
    # vLLM's chat template extras
    add_generation_prompt: bool = True
    """Open the assistant's turn after the messages (false: the template's own ending)."""
    continue_final_message: bool = False
    """The last message (an assistant's) stays open and the model continues it."""
    chat_template_kwargs: dict | None = None
    """More template variables (`{"enable_thinking": false}` for Qwen3), over
    `--default-chat-template-kwargs`; limits in `frontend/chat_template_kwargs.py`."""
    # llama.cpp's extra
    n_probs: int | None = Field(default=None, strict=True, ge=0, le=MAX_INT32)
    """llama.cpp's name for `top_logprobs`: N > 0 turns `logprobs` on with N alternatives
    (0, llama.cpp's default: none); at most `--max-logprobs` (20). Given with
    `top_logprobs`, the two must be equal, and `logprobs: false` with N > 0 is refused."""

    @model_validator(mode="after")
    def _n_probs_alias(self) -> ChatCompletionRequest:
        """`n_probs` N > 0 is `logprobs: true, top_logprobs: N`, unless the request says
        otherwise (`n_probs_conflict`: a 400)."""
        if self.n_probs and self.n_probs_conflict() is None:
            self.logprobs = True
            self.top_logprobs = self.n_probs
        return self

    def n_probs_conflict(self) -> str | None:
        """Why `n_probs` disagrees with `top_logprobs` or `logprobs` (None: it does not)."""
        if self.n_probs is None:
            return None
        if self.top_logprobs is not None and self.top_logprobs != self.n_probs:
            return (
                f"n_probs is llama.cpp's name for top_logprobs and the two disagree (n_probs "
                f"{self.n_probs}, top_logprobs {self.top_logprobs}): send one of them"
            )
        if self.n_probs and "logprobs" in self.model_fields_set and not self.logprobs:
            return f"n_probs {self.n_probs} asks for logprobs, and logprobs is false"
        return None

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) of a feature this server does not have yet, if one is asked for."""
        conflict = self.n_probs_conflict()
        if conflict is not None:
            return "n_probs", conflict
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs set to true"
        if self.add_generation_prompt and self.continue_final_message:
            return (
                "continue_final_message",
                "continue_final_message and add_generation_prompt cannot both be true",
            )
        return None

    def chat_template_options(self) -> dict:
        """The rendering options of `AsyncEngine.chat_token_ids` (ParamError: bad kwargs)."""
        kwargs = self.chat_template_kwargs
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "template_kwargs": None if kwargs is None else check_chat_template_kwargs(kwargs),
        }

    def message_dicts(self) -> list[dict]:
        return [m.to_dict() for m in self.messages]

    def tool_choice_name(self) -> str:
        """ "none", "auto", "required" or the named function."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice

    def functions(self) -> list[FunctionDefinition]:
        return [tool.function for tool in self.tools or []]

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
    reasoning_content: str | None = None
    """The thinking of a reasoning model (`--reasoning-parser`); None without one."""
    tool_calls: list[ChatCompletionMessageToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(TokenIOModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    stop_reason: int | str | None = None
    """vLLM's: the stop string or stop token id that ended the choice (None: EOS, length)."""
    token_ids: list[int] | None = None
    """With `return_token_ids` (vLLM's extra)."""


class ChatCompletionResponse(TokenIOModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    """With `return_token_ids`: the rendered prompt's token ids."""
    prompt_logprobs: PromptLogprobsJSON | None = None
    """With `prompt_logprobs` (vLLM's shape)."""
    kv_transfer_params: KVTransferResultJSON | None = None
    """With `kv_transfer_params` {"do_remote_decode": true}: what the store now holds."""
    timings: Timings | None = None
    """llama.cpp's timings (unless `--no-timings`)."""


class DeltaMessage(OpenAIBaseModel):
    """Only what is new: the role in a choice's first chunk, then text; unset parts are left
    out of the JSON (the last chunk's delta is often `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(TokenIOModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "error"] | None = None
    """"error": the engine failed this request alone (a non-streaming request gets a 500)."""
    stop_reason: int | str | None = None
    """With the finish reason: the stop string or stop token id that ended the choice."""
    token_ids: list[int] | None = None
    """With `return_token_ids`: the chunk's new token ids."""


class ChatCompletionChunk(TokenIOModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """With `return_token_ids`: in the first chunk."""
    prompt_logprobs: PromptLogprobsJSON | None = None
    """With `prompt_logprobs`: in the first chunk with content."""
    timings: Timings | None = None
    """llama.cpp's timings (unless `--no-timings`): on the stream's last chunk only."""
