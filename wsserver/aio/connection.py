"""The WebSocket protocol's dialect: its frames in, its frames out.

This is what the WebSocket protocol (docs/protocol.md) says its own way on a
:class:`~wsserver.aio.socket_connection.SocketConnection`, which owns the
socket (receive loop, frame rate, sender, drain, closing):

* ``hello`` first;
* a binary message is a piece of an image upload, kept
  (:class:`~wsserver.core.uploads.Uploads`, bounded) for the next
  ``generate`` or ``restart``, which takes them all;
* each text message is parsed (:func:`~wsserver.core.protocol.parse_client_frame`) and
  handed to the connection's one :class:`~wsserver.aio.driver.RequestDriver`
  (one request at a time, ``cancel``, ``restart``, ``resume``), or to its
  ``pull`` and ``embed`` requests (:mod:`wsserver.aio.pull_requests`,
  :mod:`wsserver.aio.embed_requests`) and its requests for several choices
  (``n`` > 1: :mod:`wsserver.aio.choice_requests`), which run beside;
* what the driver gives back is written as it is: the frame serialized;
* a refusal is an ``error`` frame, through the driver (counted, logged).

When the connection is lost, the driver parks a running resumable request in
the server's :class:`~wsserver.aio.resume.Resumes` instead of stopping it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from ..core.protocol import (
    Cancel,
    EmbedFrame,
    Generate,
    Hello,
    Pull,
    Restart,
    ServerFrame,
    parse_client_frame,
    serialize,
)
from ..core.session import Session
from ..core.uploads import Uploads, parse_upload
from ..errors import ProtocolError
from .choice_requests import ConnectionChoices
from .driver import RequestDriver
from .embed_requests import ConnectionEmbeds
from .peer import resume_tail_bytes
from .pull_requests import ConnectionPulls
from .resume import Resumes
from .sender import Sender
from .socket_connection import SocketContext

__all__ = ["ProtocolDialect"]


class ProtocolDialect:
    """The WebSocket protocol on one connection (a
    :class:`~wsserver.aio.socket_connection.SocketDialect`)."""

    label = ""

    def __init__(self, socket: SocketContext, *, resumes: Resumes | None = None) -> None:
        self._services = services = socket.services
        self._log = socket.log
        self._send = socket.sender.send
        config = services.config
        self.driver = socket.new_driver(
            self,
            Session(
                restart_bytes=config.limits.restart_memory_bytes,
                resume_tail_bytes=resume_tail_bytes(config),
            ),
            resumes=resumes,
        )
        self._drivers = (self.driver,)
        #: Images sent in binary frames, until the next request takes them.
        self.uploads = Uploads(config.limits.max_upload_bytes)
        #: Its ``pull`` requests, beside its generations (docs/models.md).
        # Given the sender and the session, not this dialect's methods: no
        # reference cycle back to it (it is freed when the connection closes,
        # without waiting for the cyclic GC).
        session = self.driver.session
        self.pulls = ConnectionPulls(
            services,
            write=_frame_writer(socket.sender),
            log=self._log,
            id_taken=lambda request_id: session.state_of(request_id) is not None,
        )
        #: Its ``embed`` requests, beside too (docs/embeddings.md); the three
        #: kinds share the connection's ids.
        pulls = self.pulls
        self.embeds = ConnectionEmbeds(
            services,
            write=_frame_writer(socket.sender),
            log=self._log,
            id_taken=lambda request_id: (
                session.state_of(request_id) is not None or pulls.knows(request_id)
            ),
        )
        #: Its requests for several choices (``n`` > 1), a driver per choice.
        embeds = self.embeds
        self.choices = ConnectionChoices(
            socket,
            write=_frame_writer(socket.sender),
            log=self._log,
            id_taken=lambda request_id: (
                session.state_of(request_id) is not None
                or pulls.knows(request_id)
                or embeds.knows(request_id)
            ),
        )

    def drivers(self) -> tuple[RequestDriver, ...]:
        if len(self.choices) == 0:
            return self._drivers
        return (*self._drivers, *self.choices.drivers())

    async def greet(self) -> None:
        services = self._services
        hello = Hello(
            model=services.backend.model_name,
            server=services.server_name,
            limits=services.wire_limits,
            honours=tuple(sorted(services.backend.honours)),
            models=tuple(services.models.infos()),
            pull=self.pulls.allowed,
        )
        await self._send(serialize(hello))

    async def receive(self, message: str | bytes) -> None:
        try:
            if isinstance(message, bytes):
                self.uploads.add(parse_upload(message))
                return
            frame = parse_client_frame(message, self._services.wire_limits, self.uploads)
        except ProtocolError as exc:
            self._log.debug(
                "refused frame: %s %s",
                exc.code,
                exc.message,
                extra={} if exc.request_id is None else {"request": exc.request_id},
            )
            await self.driver.refuse(exc)
            return
        # A pull is not a generation: it runs beside them, by its own rules
        # (aio/pull_requests.py); the two share the connection's ids.
        if isinstance(frame, Pull):
            await self.pulls.receive(frame)
            return
        if isinstance(frame, EmbedFrame):
            await self.embeds.receive(frame)
            return
        if isinstance(frame, Cancel) and self.pulls.owns(frame.id):
            await self.pulls.cancel(frame.id)
            return
        if isinstance(frame, Cancel) and self.embeds.owns(frame.id):
            await self.embeds.cancel(frame.id)
            return
        if isinstance(frame, Cancel) and self.choices.owns(frame.id):
            self.choices.cancel(frame.id)
            return
        new_id = frame.new_id if isinstance(frame, Restart) else frame.id
        if isinstance(frame, Generate | Restart) and (
            self.pulls.knows(new_id) or self.embeds.knows(new_id) or self.choices.knows(new_id)
        ):
            await self.driver.refuse(
                ProtocolError("duplicate_id", f"id {new_id!r} was already used", new_id)
            )
            return
        try:
            if isinstance(frame, Generate) and frame.n > 1:
                await self.choices.receive(frame)
                return
            if isinstance(frame, Restart) and (
                frame.overrides.get("n", 1) > 1 or self.choices.knows(frame.id)
            ):
                raise ProtocolError(
                    "bad_request", "'restart' is not available with 'n' > 1", new_id
                )
        except ProtocolError as exc:
            await self.driver.refuse(exc)
            return
        await self.driver.receive(frame)

    async def refuse(self, exc: ProtocolError, message: str | bytes | None = None) -> None:
        if isinstance(message, bytes):
            # A piece of an upload lost to the frame rate: the image would be
            # cut, so the upload is dropped, and a request naming it refused.
            with contextlib.suppress(ProtocolError):
                chunk = parse_upload(message)
                self.uploads.fail(chunk.id, f"a piece of it was refused ({exc.code})")
        await self.driver.refuse(exc)

    def upload_bytes(self) -> int:
        return self.uploads.bytes

    def busy(self) -> bool:
        return len(self.pulls) > 0 or len(self.embeds) > 0 or len(self.choices) > 0

    def stall(self) -> None:
        self.driver.stall()

    async def close(self) -> None:
        self.uploads.clear()
        await self.pulls.close()
        await self.embeds.close()
        await self.choices.close()

    # ------------------------------------------------------------ the driver's dialect

    async def write(self, frame: ServerFrame) -> None:
        """A frame of the protocol goes out as it is (serialized JSON)."""
        await self._send(serialize(frame))


def _frame_writer(sender: Sender) -> Callable[[ServerFrame], Awaitable[None]]:
    """Writes a frame through ``sender`` (and refers to nothing else)."""
    send = sender.send

    async def write(frame: ServerFrame) -> None:
        await send(serialize(frame))

    return write
