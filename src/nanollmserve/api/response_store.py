"""The in-memory store of `/v1/responses` results: bounded, least recently used out first.

Each entry keeps the response object and the conversation that led to it (without the
instructions, which OpenAI does not carry over), so `previous_response_id` can continue it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from nanollmserve.api.protocol_responses import ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    messages: list[dict]
    """The conversation including this response's answer, as chat messages."""


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, messages: list[dict]) -> None:
        self._entries[response.id] = StoredResponse(response, messages)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
