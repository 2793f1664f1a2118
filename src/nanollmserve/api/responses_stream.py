"""The SSE events of a streamed `/v1/responses` response, in the order OpenAI sends them
and `client.responses.stream(...)` of the SDK reads them:

    response.created, response.in_progress,
    a reasoning item first (`--reasoning-parser`): response.output_item.added,
        response.content_part.added, response.reasoning_text.delta...,
        response.reasoning_text.done, response.content_part.done, response.output_item.done
    per message item: response.output_item.added, response.content_part.added,
        response.output_text.delta..., response.output_text.done,
        response.content_part.done, response.output_item.done
    per function call: response.output_item.added,
        response.function_call_arguments.delta..., response.function_call_arguments.done,
        response.output_item.done
    then one of response.completed, response.incomplete (max_output_tokens),
    response.failed (an error after the stream started).

Every event has a `sequence_number`. `ResponseEvents` opens items as their text comes (a
message when content arrives, a call when its name is known), closes them in order, and
keeps the items it streamed, which become the final response's `output`.
"""

from __future__ import annotations

import json
import secrets

from nanollmserve.api.protocol_responses import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    TokenLogprob,
)
from nanollmserve.api.sse import sse_event
from nanollmserve.api.tool_parsers import ToolCallDelta


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def function_call_item_id() -> str:
    return "fc_" + secrets.token_hex(12)


def reasoning_item_id() -> str:
    return "rs_" + secrets.token_hex(12)


class ResponseEvents:
    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[OutputItem] = []
        self._message: OutputMessage | None = None
        self._call: FunctionCallItem | None = None
        self._reasoning: ReasoningItem | None = None

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number}
        for key, value in fields.items():
            payload[key] = value.model_dump() if hasattr(value, "model_dump") else value
        self.sequence_number += 1
        return sse_event(json.dumps(payload), kind)

    def start(self, response: ResponseObject) -> list[str]:
        return [
            self.event("response.created", response=response),
            self.event("response.in_progress", response=response),
        ]

    def text(self, delta: str, logprobs: list[TokenLogprob]) -> list[str]:
        """New content: opens a message item if none is open."""
        events = [] if self._message else self.open_message()
        if delta or logprobs:
            part = self._message.content[0]
            part.text += delta
            part.logprobs += logprobs
            events.append(
                self.event(
                    "response.output_text.delta",
                    **self._part_ref(),
                    delta=delta,
                    logprobs=[lp.model_dump() for lp in logprobs],
                )
            )
        return events

    def reasoning(self, delta: str) -> list[str]:
        """New thinking: opens the reasoning item if none is open."""
        events = [] if self._reasoning else self._open_reasoning()
        if delta:
            self._reasoning.content[0].text += delta
            events.append(
                self.event("response.reasoning_text.delta", **self._reasoning_ref(), delta=delta)
            )
        return events

    def _open_reasoning(self) -> list[str]:
        events = self._close_message("completed") + self._close_call()
        self._reasoning = ReasoningItem(
            type="reasoning",
            id=reasoning_item_id(),
            status="in_progress",
            content=[ReasoningText(text="")],
        )
        self.items.append(self._reasoning)
        added = self._reasoning.model_copy(update={"content": []})
        events.append(
            self.event("response.output_item.added", output_index=self._index(), item=added)
        )
        events.append(
            self.event(
                "response.content_part.added", **self._reasoning_ref(), part=ReasoningText(text="")
            )
        )
        return events

    def _reasoning_ref(self) -> dict:
        index = self.items.index(self._reasoning)
        return {"item_id": self._reasoning.id, "output_index": index, "content_index": 0}

    def _close_reasoning(self, status: str = "completed") -> list[str]:
        if self._reasoning is None:
            return []
        ref = self._reasoning_ref()
        item, self._reasoning = self._reasoning, None
        item.status = status
        part = item.content[0]
        return [
            self.event("response.reasoning_text.done", **ref, text=part.text),
            self.event("response.content_part.done", **ref, part=part),
            self.event("response.output_item.done", output_index=ref["output_index"], item=item),
        ]

    def open_message(self) -> list[str]:
        events = self._close_reasoning() + self._close_call()
        self._message = OutputMessage(
            id=message_id(), status="in_progress", content=[OutputText(text="")]
        )
        self.items.append(self._message)
        added = self._message.model_copy(update={"content": []})
        events.append(
            self.event("response.output_item.added", output_index=self._index(), item=added)
        )
        events.append(
            self.event("response.content_part.added", **self._part_ref(), part=OutputText(text=""))
        )
        return events

    def tool_call(self, delta: ToolCallDelta) -> list[str]:
        """A call's header (it opens a function_call item) or an argument fragment."""
        events = []
        if delta.name is not None:
            events += self._close_reasoning() + self._close_message("completed")
            events += self._close_call()
            self._call = FunctionCallItem(
                id=function_call_item_id(),
                call_id=delta.id,
                name=delta.name,
                arguments="",
                status="in_progress",
            )
            self.items.append(self._call)
            events.append(
                self.event(
                    "response.output_item.added", output_index=self._index(), item=self._call
                )
            )
        if delta.arguments and self._call is not None:
            self._call.arguments += delta.arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self._call.id,
                    output_index=self._index(),
                    delta=delta.arguments,
                )
            )
        return events

    def close(self, status: str) -> list[str]:
        """End the open items ("completed", or "incomplete" when the output was cut)."""
        return (
            self._close_reasoning(status) + self._close_message(status) + self._close_call(status)
        )

    def _close_message(self, status: str) -> list[str]:
        message, self._message = self._message, None
        if message is None:
            return []
        part = message.content[0]
        index = self.items.index(message)
        ref = {"item_id": message.id, "output_index": index, "content_index": 0}
        message.status = status
        logprobs = [lp.model_dump() for lp in part.logprobs]
        return [
            self.event("response.output_text.done", **ref, text=part.text, logprobs=logprobs),
            self.event("response.content_part.done", **ref, part=part),
            self.event("response.output_item.done", output_index=index, item=message),
        ]

    def _close_call(self, status: str = "completed") -> list[str]:
        call, self._call = self._call, None
        if call is None:
            return []
        index = self.items.index(call)
        call.status = status
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=call.id,
                output_index=index,
                name=call.name,
                arguments=call.arguments,
            ),
            self.event("response.output_item.done", output_index=index, item=call),
        ]

    def _index(self) -> int:
        return len(self.items) - 1

    def _part_ref(self) -> dict:
        return {"item_id": self._message.id, "output_index": self._index(), "content_index": 0}

    def end(self, response: ResponseObject) -> str:
        """The last event: completed, incomplete or failed, after its status."""
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response.status, "response.failed"
        )
        return self.event(kind, response=response)
