"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API on the chat
path. The request becomes a ChatCompletionRequest (`protocol_messages.py`) and runs through
`serving_chat.create_chat_completion` (template, tools, grammar, reasoning, limits, sampling:
one generation path); its answer is rewritten into Anthropic's shapes:

- a ChatCompletion becomes a Message: `thinking` (the reasoning), `text` and `tool_use`
  blocks; finish reasons map to `stop_reason` ("stop" -> end_turn, or stop_sequence with the
  matched string; "length" -> max_tokens; "tool_calls" -> tool_use);
- a chunk stream becomes Anthropic's events (`MessageEvents`): message_start,
  content_block_start / content_block_delta (text_delta, thinking_delta, input_json_delta)
  / content_block_stop per block, message_delta (stop_reason, usage), message_stop.

Errors keep their status; `anthropic_errors.py` gives them Anthropic's body, and here their
`param` takes the Messages name of the field (stop -> stop_sequences, ...).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from nanollmserve.anthropic_errors import anthropic_error_body
from nanollmserve.api import serving_chat
from nanollmserve.api.errors import APIError, bad_request, error_from_exception
from nanollmserve.api.protocol_chat import ChatCompletionRequest
from nanollmserve.api.protocol_messages import (
    CountTokensRequest,
    CountTokensResponse,
    Message,
    MessagesBase,
    MessagesRequest,
    Usage,
)
from nanollmserve.api.serving import ServerContext, random_id
from nanollmserve.api.sse import sse_event, sse_response
from nanollmserve.api.tool_choice import plan_tools
from nanollmserve.errors import ParamError

# Chat request field -> Messages request field, for the `param` of a 400.
_PARAM_NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "structured_outputs": "tools",
}

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
_UNAVAILABLE = {"overloaded", "engine_unavailable"}


async def create_message(
    body: MessagesRequest, request: Request, ctx: ServerContext
) -> JSONResponse | StreamingResponse:
    model = ctx.check_model(body.model)
    with _messages_param_names():
        _check_limits(body, ctx)
        user = body.metadata.user_id if body.metadata else None
        ctx.limits.check_fields(user=user)
        chat = _chat_request(body)
        # message_start reports the prompt's tokens before any chunk does (the chat stream
        # has its usage only at the end), so a stream counts them once more up front.
        input_tokens = await _count(chat, ctx) if body.stream else 0
        answer = await serving_chat.create_chat_completion(chat, request, ctx)
    message_id = random_id("msg_")
    stops = body.stop_sequences or []
    if isinstance(answer, StreamingResponse):
        events = MessageEvents(message_id, model, input_tokens, stops)
        return sse_response(events.convert(answer.body_iterator), answer.streams)
    completion = json.loads(answer.body)
    return JSONResponse(_message(completion, message_id, model, stops).model_dump())


async def count_tokens(body: CountTokensRequest, ctx: ServerContext) -> CountTokensResponse:
    ctx.check_model(body.model)
    with _messages_param_names():
        _check_limits(body, ctx)
        return CountTokensResponse(input_tokens=await _count(_chat_request(body), ctx))


def _check_limits(body: MessagesBase, ctx: ServerContext) -> None:
    """Each content block (and the system prompt) counts as a message of `--max-messages`."""
    ctx.limits.check_messages(body.num_blocks())
    ctx.limits.check_fields(tools=body.tools)


def _chat_request(body: MessagesBase) -> ChatCompletionRequest:
    try:
        return body.to_chat_request()
    except ValidationError as exc:  # a value chat's ranges refuse (min_tokens: -1, ...)
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        param = _PARAM_NAMES.get(str(first["loc"][0]), str(first["loc"][0]))
        raise bad_request(f"{where}: {first['msg']}", param) from None


async def _count(chat: ChatCompletionRequest, ctx: ServerContext) -> int:
    """The prompt's tokens as the chat path renders it (with the tools its plan renders)."""
    plan = plan_tools(
        chat.functions(),
        chat.tool_choice_name(),
        tool_call_parser=ctx.settings.tool_call_parser,
        parallel_tool_calls=chat.parallel_tool_calls,
    )
    ids = await ctx.engine.chat_token_ids(
        chat.message_dicts(), plan.template_tools, **chat.chat_template_options()
    )
    return len(ids)


@contextlib.contextmanager
def _messages_param_names():
    """Renames the `param` of a 400 raised inside from the chat name to the Messages one."""
    try:
        yield
    except (APIError, ParamError) as exc:
        err = error_from_exception(exc)
        param = _PARAM_NAMES.get(err.param, err.param)
        raise APIError(
            err.status_code, err.message, param=param, code=err.code, headers=err.headers
        ) from None


def _stop(
    finish_reason: str | None, stop_reason, stops: list[str]
) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish reason and the engine's stop reason."""
    if finish_reason == "stop":
        if isinstance(stop_reason, str) and stop_reason in stops:
            return "stop_sequence", stop_reason
        return "end_turn", None
    return _STOP_REASONS.get(finish_reason, finish_reason), None


def _tool_input(arguments: str) -> dict:
    """A call's arguments as the `input` object (a forced call's always are one)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(usage: dict) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(
        input_tokens=usage.get("prompt_tokens", 0),
        output_tokens=usage.get("completion_tokens", 0),
        cache_read_input_tokens=details.get("cached_tokens"),
    )


def _message(completion: dict, message_id: str, model: str, stops: list[str]) -> Message:
    [choice] = completion["choices"]
    message = choice["message"]
    blocks: list[dict] = []
    if message.get("reasoning_content"):
        blocks.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": _tool_input(function["arguments"]),
            }
        )
    stop_reason, stop_sequence = _stop(choice["finish_reason"], choice.get("stop_reason"), stops)
    return Message(
        id=message_id,
        model=model,
        content=blocks,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=_usage(completion["usage"]),
    )


class MessageEvents:
    """A chat chunk stream (one choice, with a final usage chunk) as Anthropic's events.
    One block is open at a time: a new kind of delta (thinking, text, a new call) closes
    the open one and starts the next."""

    def __init__(self, message_id: str, model: str, input_tokens: int, stops: list[str]):
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.stops = stops
        self.index = -1
        self.open: str | None = None
        """The type of the open block (None: none is)."""

    async def convert(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        start = Message(
            id=self.message_id,
            model=self.model,
            content=[],
            usage=Usage(input_tokens=self.input_tokens, output_tokens=0),
        )
        yield _event("message_start", {"type": "message_start", "message": start.model_dump()})
        finish, stop_reason, usage = None, None, None
        try:
            async for chunk in chunks:
                data = chunk.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:  # chat's error event (stream_error_payload)
                    error = payload["error"]
                    status = 503 if error.get("code") in _UNAVAILABLE else 500
                    yield _error_event(error.get("message", "error"), status)
                    return
                if payload.get("usage"):
                    usage = payload["usage"]
                for choice in payload.get("choices") or []:
                    for event in self._deltas(choice["delta"]):
                        yield event
                    if choice.get("finish_reason") == "error":
                        yield _error_event("the engine failed while generating this request", 500)
                        return
                    if choice.get("finish_reason"):
                        finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
        finally:
            await chunks.aclose()
        for event in self._close():
            yield event
        reason, sequence = _stop(finish, stop_reason, self.stops)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        totals = _usage(usage or {}).model_dump(exclude_none=True)
        yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": totals})
        yield _event("message_stop", {"type": "message_stop"})

    def _deltas(self, delta: dict):
        if delta.get("reasoning_content"):
            yield from self._into("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            text = {"type": "thinking_delta", "thinking": delta["reasoning_content"]}
            yield self._delta(text)
        if delta.get("content"):
            yield from self._into("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):  # a new call: its own block
                yield from self._close()
                block = {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": function.get("name"),
                    "input": {},
                }
                yield from self._into("tool_use", block)
            if function.get("arguments"):
                yield self._delta(
                    {"type": "input_json_delta", "partial_json": function["arguments"]}
                )

    def _into(self, kind: str, block: dict):
        """Start a block of `kind` unless one is open."""
        if self.open == kind:
            return
        yield from self._close()
        self.index += 1
        self.open = kind
        yield _event(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def _close(self):
        if self.open is not None:
            self.open = None
            yield _event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _delta(self, delta: dict) -> str:
        return _event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )


def _event(name: str, payload: dict) -> str:
    return sse_event(json.dumps(payload), event=name)


def _error_event(message: str, status: int) -> str:
    return _event("error", anthropic_error_body(status, message))
