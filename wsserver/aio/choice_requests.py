"""A WebSocket connection's requests for several choices (``generate`` with ``n`` > 1).

Theory of operation
-------------------
A ``generate`` with ``n`` > 1 (docs/protocol.md, "Several choices") runs
beside the connection's one-at-a-time driver, as its ``pull`` and ``embed``
requests do, on a driver per choice (:mod:`wsserver.aio.choices`: each
choice its own slot, channel, pacing, shaping). Their frames are merged into
the request's, under its id: ``queued`` and ``started`` once, every
``delta`` with its ``choice`` (``seq`` counting the request's deltas), a ``choice_done`` as each choice ends, then
exactly one ``done`` (the prompt counted once, the completions summed) — or
the first failure's ``error``/``done``, the other choices cancelled. A
``cancel`` of the id cancels every choice; the connection's end cancels
them too. Such a request is not resumable and cannot be restarted (both
are refused by name); one runs at a time per connection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from ..core.protocol import (
    ChoiceDone,
    Delta,
    Done,
    Error,
    Generate,
    Queued,
    ServerFrame,
    Started,
    Usage,
)
from ..core.session import Session
from ..errors import ProtocolError
from ..logs import ConnectionLog
from .choices import ChoiceMerge, choice_frames
from .driver import RequestDriver
from .side_requests import SideRequests
from .socket_connection import SocketContext

__all__ = ["MAX_CHOICE_REQUESTS", "ConnectionChoices"]

#: Requests for several choices a connection may run at once.
MAX_CHOICE_REQUESTS = 1


class ConnectionChoices(SideRequests[ChoiceMerge]):
    """The requests for several choices of one connection (see the module docstring)."""

    def __init__(
        self,
        socket: SocketContext,
        *,
        write: Callable[[ServerFrame], Awaitable[None]],
        log: ConnectionLog,
        id_taken: Callable[[str], bool],
    ) -> None:
        super().__init__(id_taken)
        self._socket = socket
        self._write = write
        self._log = log

    def drivers(self) -> list[RequestDriver]:
        """The running choices' drivers (the connection stalls, closes and counts them)."""
        return [driver for merge in self._running.values() for driver in merge.drivers]

    async def receive(self, frame: Generate) -> None:
        """Start ``frame``'s choices; raises :class:`ProtocolError` for one refused."""
        request_id = frame.id
        self.check_new(
            request_id,
            MAX_CHOICE_REQUESTS,
            f"at most {MAX_CHOICE_REQUESTS} request for several choices at a time per connection",
        )
        if frame.resumable:
            raise ProtocolError(
                "bad_request", "'resumable' is not available with 'n' > 1", request_id
            )
        services = self._socket.services
        generate, model = services.models.for_api(frame, frame.model)
        slots = model.backend.slots
        if 0 < slots < frame.n:
            raise ProtocolError(
                "bad_request",
                f"'n' is {frame.n}; this model runs at most {slots} choices at once "
                "(its 'parallel')",
                request_id,
            )
        self._used.add(request_id)
        generate = dataclasses.replace(generate, resumable=False, choice_of=request_id)
        merge = ChoiceMerge(
            frame.n,
            write=self._writer(request_id),
            finish=self._finisher(request_id),
        )
        frames = choice_frames(generate)
        merge.drivers = [
            self._socket.new_driver(merge.dialect(k), Session(restart_bytes=0))
            for k in range(frame.n)
        ]
        self._running[request_id] = merge
        for driver, choice in zip(merge.drivers, frames, strict=True):
            await driver.receive(choice, model=model)
            if merge.over:
                merge.cancel_all()  # a choice failed: the rest would run for nobody
                break

    def cancel(self, request_id: str) -> None:
        """The client's ``cancel``: every choice (the first ``done`` says ``cancelled``)."""
        merge = self._running.get(request_id)
        if merge is not None:
            self._log.request(request_id).info("cancel (every choice)")
            merge.cancel_all()

    async def close(self) -> None:
        """The connection is gone: every choice is cancelled (the drivers
        themselves are closed with the connection's: :meth:`drivers`)."""
        for merge in self._running.values():
            merge.cancel_all()

    # ------------------------------------------------------------ the merged frames

    def _writer(self, request_id: str) -> Callable[[ServerFrame], Awaitable[None]]:
        # The request's deltas count 0, 1, 2 … across its choices, as any request's.
        seq = 0

        async def write(frame: ServerFrame) -> None:
            nonlocal seq
            if isinstance(frame, Done | Error):
                self._running.pop(request_id, None)  # the request's one end
            if isinstance(frame, Delta):
                frame, seq = dataclasses.replace(frame, id=request_id, seq=seq), seq + 1
            elif isinstance(frame, Queued | Started | Done | Error):
                frame = dataclasses.replace(frame, id=request_id)
            await self._write(frame)

        return write

    def _finisher(self, request_id: str) -> Callable[[Done, int], Awaitable[None]]:
        async def finish(done: Done, index: int) -> None:
            usage = Usage(
                completion_tokens=done.usage.completion_tokens,
                reasoning_tokens=done.usage.reasoning_tokens,
            )
            await self._write(ChoiceDone(request_id, index, done.reason, usage, done.stop_sequence))

        return finish
