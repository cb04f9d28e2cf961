"""Stored responses (POST /v1/responses with store true): what previous_response_id continues and GET returns.

They live in this process's memory only, so a restart forgets them, and a router sends a request that names one
back to the replica that made it (see responses_protocol.REPLICA_TAG_HEADER). Bounded three ways, least recently
used first out: an age (an hour from creation), a count and a byte total. A response's size counts its whole
conversation (earlier items are shared with the response before it, not copied, so the true total is smaller).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.server.responses_protocol import InputItem

MAX_AGE_S = 3600.0
MAX_RESPONSES = 1000
MAX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    body: dict  # the response object as sent
    items: tuple[InputItem, ...]  # the conversation so far, this response's output last, as input items
    size: int  # bytes charged against the store's bound: the body and the whole conversation
    expires_at: float  # time.monotonic()


class ResponseStore:
    def __init__(self, max_age_s: float = MAX_AGE_S, max_responses: int = MAX_RESPONSES,
                 max_bytes: int = MAX_BYTES) -> None:
        self.max_age_s, self.max_responses, self.max_bytes = max_age_s, max_responses, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict, items: tuple[InputItem, ...], size: int) -> bool:
        """Keeps a response (False when it alone is over the byte bound: then it is not kept)."""
        if size > self.max_bytes:
            return False
        self.pop(response_id)
        self._entries[response_id] = StoredResponse(body, items, size, time.monotonic() + self.max_age_s)
        self._bytes += size
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            self.pop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None and entry.expires_at <= time.monotonic():
            self.pop(response_id)
            return None
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
        return entry
