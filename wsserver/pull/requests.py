"""A connection's ``pull`` requests, as a state machine (sans-I/O).

Theory of operation
-------------------
A ``pull`` lives beside the connection's generations: a download may last
an hour, and the user goes on chatting meanwhile. Its life is the
generate's, shortened:

.. transitions::

    state    event      next     effects
    -------  ---------  -------  ------------------------------------------
    -        Pull       RUNNING  accepted (else ``error``: no pull_done)
    RUNNING  progress   RUNNING  pull_progress
    RUNNING  complete   DONE     pull_done complete (the model it serves)
    RUNNING  failure    DONE     pull_done error (the pull's wire code)
    RUNNING  Cancel     DONE     pull_done cancelled, at once
    DONE     any report DONE     nothing: the pull has ended

So every accepted pull ends with exactly one ``pull_done``, and nothing
about it follows that frame: a report that comes after (the download's
progress or its end, after a ``cancel`` already answered) finds no running
pull and is dropped. A refused ``pull`` — a reference that does not parse,
pulls not allowed here, an id already used, too many pulls at once — gets
an ``error`` frame and nothing else, as a refused ``generate`` does.

Ids share the connection's namespace with its generations: the caller says
whether an id is taken there (``id_taken``), and asks :meth:`PullRequests.knows`
before accepting a generation's id.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from ..core.models import ModelInfo
from ..core.protocol import Pull, PullDone, Pulling
from ..errors import ProtocolError, WireCode
from .progress import Progress
from .reference import Reference

__all__ = ["MAX_RUNNING", "PullRequests"]

#: Pulls one connection may run at once.
MAX_RUNNING: Final = 4


class PullRequests:
    """The pulls of one connection (see the module docstring)."""

    def __init__(self, *, max_running: int = MAX_RUNNING, id_memory: int = 1000) -> None:
        self._max_running = max_running
        self._id_memory = id_memory
        self._running: dict[str, Reference] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()

    @property
    def running(self) -> dict[str, Reference]:
        """The pulls not ended yet, by id."""
        return dict(self._running)

    def is_running(self, request_id: str) -> bool:
        return request_id in self._running

    def knows(self, request_id: str) -> bool:
        """Whether a pull used this id (running, or among the last ``id_memory``)."""
        return request_id in self._seen

    def accept(self, frame: Pull, *, allowed: str | None, id_taken: bool) -> None:
        """Take ``frame`` on, or raise the :class:`ProtocolError` its ``error``
        frame carries. ``allowed``: ``None`` if this connection may pull, else why not."""
        if id_taken or frame.id in self._seen:
            raise ProtocolError("duplicate_id", f"id {frame.id!r} was already used", frame.id)
        if allowed is not None:
            raise ProtocolError("pull_not_allowed", allowed, frame.id)
        if len(self._running) >= self._max_running:
            raise ProtocolError(
                "busy", f"{len(self._running)} pulls are already running here", frame.id
            )
        self._seen[frame.id] = None
        while len(self._seen) > self._id_memory:
            self._seen.popitem(last=False)
        self._running[frame.id] = frame.model

    def progress(self, request_id: str, progress: Progress) -> Pulling | None:
        """A running pull's ``pull_progress`` (``None``: it has ended)."""
        if request_id not in self._running:
            return None
        return Pulling(id=request_id, progress=progress)

    def complete(self, request_id: str, model: ModelInfo, downloaded: int) -> PullDone | None:
        if self._running.pop(request_id, None) is None:
            return None
        return PullDone(id=request_id, reason="complete", model=model, downloaded=downloaded)

    def fail(self, request_id: str, code: WireCode, message: str) -> PullDone | None:
        if self._running.pop(request_id, None) is None:
            return None
        return PullDone(id=request_id, reason="error", error_code=code, error_message=message)

    def cancel(self, request_id: str) -> PullDone | None:
        """The client's ``cancel`` (or its connection is gone): ``None`` if
        ``request_id`` is no running pull."""
        if self._running.pop(request_id, None) is None:
            return None
        return PullDone(id=request_id, reason="cancelled")
