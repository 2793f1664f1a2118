"""The in-memory store of `/v1/responses` results: bounded by count and by bytes, least
recently used out first.

Each entry keeps what a later request can read back, and nothing else: the response object
as the JSON that `GET /v1/responses/{id}` answers, and the conversation that led to it
(without the instructions, which OpenAI does not carry over) as the JSON of its chat
messages, which `previous_response_id` continues. Kept as bytes, an entry costs its length:
the parsed objects of a request (100k small `tools` dicts of a 4 MB body pinned ~28 MB) are
freed with it. `max_bytes` bounds the sum of those lengths; a single entry larger than the
bound is not stored at all (the request it answers still succeeds).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from nanollmserve.api.protocol_responses import ResponseObject

DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class StoredResponse:
    response_json: bytes
    """The response object, as GET answers it."""
    messages_json: bytes
    """The conversation including this response's answer, as chat messages."""

    @property
    def num_bytes(self) -> int:
        return len(self.response_json) + len(self.messages_json)

    def messages(self) -> list[dict]:
        return json.loads(self.messages_json)


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES):
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        """The bytes the entries hold now (never above `max_bytes`)."""
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, messages: list[dict]) -> bool:
        """Store `response`, evicting the least recently used entries to make room. False
        (and nothing stored) when it alone is larger than `max_bytes`."""
        entry = StoredResponse(
            response.model_dump_json().encode(),
            json.dumps(messages, ensure_ascii=False, separators=(",", ":")).encode(),
        )
        self.delete(response.id)
        if entry.num_bytes > self.max_bytes or self.capacity < 1:
            return False
        while self._entries and (
            len(self._entries) >= self.capacity or self.num_bytes + entry.num_bytes > self.max_bytes
        ):
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        self._entries[response.id] = entry
        self.num_bytes += entry.num_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True
