"""A connection's lanes: requests one after another within a lane, lanes side by side (sans-I/O).

The Responses API's WebSocket mode (docs/responses-api.md, "WebSocket mode")
runs the responses of one ``stream_id`` one after another, in order, and
those of different ``stream_id`` values side by side. A lane is there what
one connection of our protocol is: one request at a time. :class:`Lanes` is
that queue and nothing else — which request a lane runs next, and the two
caps (lanes at once, requests waiting in one lane). It knows no asyncio and
no request: the connection starts what it is told to start and reports each
end.

A lane exists from its first request until it has run its last one; a key
seen again afterwards opens a new lane.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, Literal, TypeVar

__all__ = ["LaneLimit", "Lanes"]

Request = TypeVar("Request")


class LaneLimit(Exception):
    """A request refused by a cap: ``"lanes"`` (too many lanes at once) or
    ``"pending"`` (too many requests waiting in its lane)."""

    def __init__(self, which: Literal["lanes", "pending"]) -> None:
        super().__init__(which)
        self.which: Literal["lanes", "pending"] = which


class Lanes(Generic[Request]):
    """The lanes of one connection: each the requests still to run after its running one."""

    __slots__ = ("_lanes", "_max_lanes", "_max_pending")

    def __init__(self, *, max_lanes: int, max_pending: int) -> None:
        self._max_lanes = max_lanes
        self._max_pending = max_pending
        self._lanes: dict[Hashable, deque[Request]] = {}

    def __len__(self) -> int:
        """Lanes running a request."""
        return len(self._lanes)

    def add(self, lane: Hashable, request: Request) -> Request | None:
        """A new request in ``lane``: the request to start now (the lane was
        idle: a new lane), or ``None`` (it waits its turn). Raises
        :class:`LaneLimit` if a cap refuses it (nothing changes then)."""
        waiting = self._lanes.get(lane)
        if waiting is None:
            if len(self._lanes) >= self._max_lanes:
                raise LaneLimit("lanes")
            self._lanes[lane] = deque()
            return request
        if len(waiting) >= self._max_pending:
            raise LaneLimit("pending")
        waiting.append(request)
        return None

    def done(self, lane: Hashable) -> Request | None:
        """``lane``'s running request has ended: the next one to start, or
        ``None`` (the lane has run its last request and is gone)."""
        waiting = self._lanes.get(lane)
        if waiting:
            return waiting.popleft()
        self._lanes.pop(lane, None)
        return None

    def drop(self, lane: Hashable) -> int:
        """Forget ``lane`` and what waits in it (its wire is lost); how many waited."""
        waiting = self._lanes.pop(lane, None)
        return 0 if waiting is None else len(waiting)
