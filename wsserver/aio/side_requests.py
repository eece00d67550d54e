"""The book a connection keeps of requests that run beside its driver.

``embed`` requests (:mod:`.embed_requests`) and requests for several
choices (:mod:`.choice_requests`) run beside the connection's one-at-a-time
driver: each kind keeps its running requests by id (a ``cancel`` of one is
its own), every id it ever used (a later request may not reuse one), and
refuses an id another kind used or a request over its count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from ..errors import ProtocolError

__all__ = ["SideRequests"]

T = TypeVar("T")


class SideRequests(Generic[T]):
    """Running requests by id (each a ``T``), and the ids ever used."""

    def __init__(self, id_taken: Callable[[str], bool]) -> None:
        #: Whether another kind of request used an id.
        self._id_taken = id_taken
        self._running: dict[str, T] = {}
        self._used: set[str] = set()

    def __len__(self) -> int:
        return len(self._running)

    def owns(self, request_id: str) -> bool:
        """Whether ``request_id`` runs here (a ``cancel`` of it is ours)."""
        return request_id in self._running

    def knows(self, request_id: str) -> bool:
        """Whether a request of this kind used ``request_id`` (another may not)."""
        return request_id in self._used

    def check_new(self, request_id: str, most: int, busy: str) -> None:
        """Refuse ``request_id`` if it was used, or ``most`` already run
        (``busy``: the refusal's message)."""
        if request_id in self._used or self._id_taken(request_id):
            raise ProtocolError("duplicate_id", f"id {request_id!r} was already used", request_id)
        if len(self._running) >= most:
            raise ProtocolError("busy", busy, request_id)
