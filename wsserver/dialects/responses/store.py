"""Responses kept for ``previous_response_id``: bounded by bytes, and by age (sans-I/O).

A :class:`ResponseStore` keeps, per response id, the conversation a next turn
continues (the earlier turns, this input, this output) and the ``response``
object (``GET /v1/responses/{id}``). It holds at most ``max_bytes`` — the
oldest entries are forgotten first, and an entry larger than the whole store
is not kept — and, with a ``ttl_s``, forgets an entry that old. Memory kept
"for later" counts: the size is the entry's JSON bytes, not its count.

One store per WebSocket-mode connection (gone with it), one server-wide for
HTTP (``store`` not false). A forgotten id is ``previous_response_not_found``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from .api import Message

__all__ = ["ResponseStore", "StoredResponse"]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    #: The conversation up to and including this response's output.
    conversation: tuple[Message, ...]
    #: The ``response`` object, as JSON.
    body: bytes
    #: Bytes this entry counts for.
    size: int
    #: When it is forgotten (the store's clock), or None.
    expires: float | None

    @classmethod
    def of(
        cls, response: dict[str, Any], conversation: tuple[Message, ...], *, expires: float | None
    ) -> StoredResponse:
        body = orjson.dumps(response)
        size = len(body) + len(orjson.dumps(conversation))
        return cls(str(response["id"]), conversation, body, size, expires)


class ResponseStore:
    """Stored responses by id, oldest first."""

    def __init__(self, *, max_bytes: int, ttl_s: float | None = None) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def expiry(self, now: float) -> float | None:
        """When an entry stored now is forgotten."""
        return None if self.ttl_s is None else now + self.ttl_s

    def put(self, entry: StoredResponse, now: float) -> bool:
        """Keep ``entry`` (forgetting the oldest to make room); whether it was kept."""
        self._expire(now)
        self.delete(entry.id)
        if entry.size > self.max_bytes:
            return False
        while self.bytes + entry.size > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.size
        self._entries[entry.id] = entry
        self.bytes += entry.size
        return True

    def get(self, response_id: str, now: float) -> StoredResponse | None:
        self._expire(now)
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _expire(self, now: float) -> None:
        # Entries are in insertion order and share one TTL: the oldest expire first.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires is None or oldest.expires > now:
                return
            self.delete(oldest.id)
