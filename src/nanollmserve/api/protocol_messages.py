"""Protocol models of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`),
in Anthropic's shapes, and their conversion into the chat request the server already runs.

A request is `system` (a string or text blocks), `messages` (a string or content blocks:
`text`; an assistant's `tool_use`, earlier `thinking` and `redacted_thinking` (dropped); a user's
`tool_result`), `max_tokens` (required), `stop_sequences`, `temperature` / `top_p` /
`top_k`, `metadata.user_id`, `tools`
(`{name, description, input_schema}`) and `tool_choice` (`auto`, `any`, `tool`, `none`),
plus chat's `seed`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos` and
`priority` (vLLM's, under `--scheduling-policy priority`).
`to_chat_request` turns it into a ChatCompletionRequest: `system` becomes a system message,
`tool_use` blocks an assistant's `tool_calls`, its `thinking` blocks (joined in order) its
`reasoning_content` (the chat template renders it where it renders earlier thinking, e.g.
Qwen3's after the last user query), `tool_result` blocks `tool` messages, `any` becomes
"required" and `tool` a named function; the chat path (template, tools, grammar, limits,
sampling) does the rest. Unknown top-level fields are a 400, as Anthropic answers;
block types this server cannot read are a 400 naming them (`image` and `document` blocks,
anywhere in a message or a tool result, with "<type> input is not supported"; server tools).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, model_validator

from nanollmserve.api.protocol import MAX_INT32
from nanollmserve.api.protocol_base import OpenAIBaseModel, RequestModel
from nanollmserve.api.protocol_chat import ChatCompletionRequest

# -- request ---------------------------------------------------------------------------------
UNREADABLE_BLOCKS = ("image", "document")
"""Block types of Anthropic's that need a model which reads them (vision, PDFs)."""


def refuse_unreadable_blocks(data):
    """A 400 that says why for an `image` or `document` block in a message's raw `content`
    list or a `tool_result` block's in it: the served models read text only. (Left to the
    content union, the error named a string mismatch.)"""
    content = data.get("content") if isinstance(data, dict) else None
    for block in content if isinstance(content, list) else []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            refuse_unreadable_blocks(block)
        if kind in UNREADABLE_BLOCKS:
            raise ValueError(
                f"{kind} input is not supported: this server runs text-only models (no "
                f"vision or document reading yet); send the content as text blocks"
            )
    return data


class TextBlock(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(OpenAIBaseModel):
    """An assistant's call, sent back in the next turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(OpenAIBaseModel):
    """A user's answer to a `tool_use` (its `id`)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None
    """Accepted; the template sees the result text either way."""

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(OpenAIBaseModel):
    """An assistant's earlier thinking, sent back in a later turn: the chat message's
    `reasoning_content` (left out in a user's turn)."""

    type: Literal["thinking"]
    thinking: str = ""
    signature: str | None = None
    """Accepted and ignored (Anthropic's check that the thinking is its own)."""


class RedactedThinkingBlock(OpenAIBaseModel):
    """Anthropic's encrypted thinking: accepted and left out (no model here can read it)."""

    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    _refuse_unreadable = model_validator(mode="before")(refuse_unreadable_blocks)

    def num_blocks(self) -> int:
        return 1 if isinstance(self.content, str) else len(self.content)

    def chat_messages(self) -> list[dict]:
        """This turn as chat messages: `tool_result` blocks become `tool` messages (first,
        as they answer the previous turn), the text a message of this role whose
        `tool_use` blocks are its `tool_calls` and, an assistant's, whose `thinking` blocks
        (joined in order, as llama.cpp joins them) are its `reasoning_content`."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        results = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        texts = [b.text for b in self.content if isinstance(b, TextBlock)]
        calls = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": json.dumps(b.input)},
            }
            for b in self.content
            if isinstance(b, ToolUseBlock)
        ]
        message: dict = {"role": self.role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        thinking = "".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))
        if thinking and self.role == "assistant":
            message["reasoning_content"] = thinking
        keep = texts or calls or not results
        return results + ([message] if keep else [])


class ToolParam(OpenAIBaseModel):
    """A client tool. Anthropic's server tools (a `type` such as "web_search_20250305")
    run at Anthropic; here they are a 400."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None

    def function(self) -> dict:
        return {"name": self.name, "description": self.description, "parameters": self.input_schema}


class ToolChoiceParam(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    """The tool `tool` forces."""
    disable_parallel_tool_use: bool | None = None
    """true: `any` makes exactly one call."""

    def chat_choice(self) -> str | dict:
        if self.type == "any":
            return "required"
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name or ""}}
        return self.type


class MetadataParam(OpenAIBaseModel):
    user_id: str | None = None
    """Accepted and ignored (at most `--max-user-length` characters)."""


class MessagesBase(RequestModel):
    """What `/v1/messages` and `/v1/messages/count_tokens` share."""

    model: str | None = None
    """The served model name (Anthropic requires one; any served name or LoRA adapter)."""
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    """Default "auto" with tools (needs `--enable-auto-tool-choice`), "none" without."""
    thinking: dict | None = None
    """Accepted and ignored: whether a model thinks is its template's business; with
    `--reasoning-parser` its thinking comes back as a `thinking` block."""

    def num_blocks(self) -> int:
        """Content blocks in all (a string counts as one), held to `--max-messages`."""
        system = (
            0 if self.system is None else 1 if isinstance(self.system, str) else len(self.system)
        )
        return system + sum(m.num_blocks() for m in self.messages)

    def chat_messages(self) -> list[dict]:
        system = self.system
        if isinstance(system, list):
            system = "".join(block.text for block in system)
        head = [{"role": "system", "content": system}] if system else []
        return head + [chat for m in self.messages for chat in m.chat_messages()]

    def chat_tools(self) -> dict:
        """The chat request's `tools`, `tool_choice` and `parallel_tool_calls`."""
        fields: dict = {}
        if self.tools is not None:
            fields["tools"] = [{"type": "function", "function": t.function()} for t in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice.chat_choice()
            if self.tool_choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields

    def chat_fields(self) -> dict:
        """The chat request's model, messages and tool fields."""
        return {"model": self.model, "messages": self.chat_messages(), **self.chat_tools()}

    def to_chat_request(self) -> ChatCompletionRequest:
        fields = {k: v for k, v in self.chat_fields().items() if v is not None}
        return ChatCompletionRequest(**fields)


class CountTokensRequest(MessagesBase):
    pass


_CHAT_EXTENSIONS = {"seed", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "priority"}


class MessagesRequest(MessagesBase):
    max_tokens: int = Field(strict=True, ge=1, le=MAX_INT32)
    """Required, as at Anthropic; also at most what the context leaves after the prompt."""
    stop_sequences: list[str] | None = None
    """At most `--max-stop-strings` (16) of at most `--max-stop-string-length` (256)."""
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, strict=True, ge=-1, le=MAX_INT32)
    metadata: MetadataParam | None = None
    service_tier: str | None = None
    """Accepted and ignored: there is one tier."""
    # nanollmserve extensions, as on chat (same names, ranges checked there)
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    priority: int | None = None

    def to_chat_request(self) -> ChatCompletionRequest:
        """The same request as chat; fields left out stay unset there, so the server's
        generation defaults fill them as they do for chat."""
        fields = {
            **self.chat_fields(),
            "max_completion_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            **self.model_dump(include=_CHAT_EXTENSIONS, exclude_none=True),
        }
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


# -- responses -------------------------------------------------------------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Usage(OpenAIBaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None
    """Prompt tokens whose KV came from the prefix cache."""


class Message(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict]
    """`thinking` (with `--reasoning-parser`), `text` and `tool_use` blocks, in that order."""
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(OpenAIBaseModel):
    input_tokens: int
