"""The WebSocket dialect: one connection's receive loop and its frames.

This is the thin asyncio layer of the WebSocket protocol (docs/protocol.md).
Per connection:

* the **receive loop** (:meth:`Connection.run`) always runs, so a ``cancel`` is
  read even while a stream is backed up; it enforces the frame rate, parses
  frames (:func:`~wsserver.protocol.parse_client_frame`) and hands them to the
  connection's :class:`~wsserver.aio.driver.RequestDriver`, which owns each
  request's way through the server;
* what the driver gives back is written by :meth:`Connection.write` — the
  frame serialized as it is — through one :class:`~wsserver.aio.sender.Sender`,
  whose drain watchdog aborts a client that reads nothing.

When the connection is lost, the driver parks a running resumable request in
the server's :class:`~wsserver.aio.resume.Resumes` instead of stopping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..errors import ProtocolError, WireLost
from ..logs import ConnectionLog
from ..protocol import Cancel, Generate, Hello, Pull, Restart, ServerFrame, parse_client_frame
from ..security import FrameLimiter
from ..session import Session
from .drain import DrainWatch, write_buffered
from .driver import RequestDriver
from .peer import PeerAwareConnection, resume_tail_bytes
from .pipeline import Generation
from .pull_requests import ConnectionPulls
from .resume import Resumes
from .sender import Sender
from .services import Services

__all__ = ["Connection"]

log = logging.getLogger("wsserver.connection")


class Connection:
    """Serves one client. Create per handshake and ``await run()``."""

    def __init__(
        self,
        services: Services,
        websocket: ServerConnection,
        conn_id: str,
        *,
        resumes: Resumes | None = None,
    ) -> None:
        self.ws = websocket
        self.conn_id = conn_id
        self.log = ConnectionLog(log, conn_id)
        config = services.config
        self._services = services
        self._send_timeout = config.server.send_timeout_s
        self._idle_timeout = config.server.idle_timeout_s or None
        self._loop = asyncio.get_running_loop()
        self.driver = RequestDriver(
            services,
            dialect=self,
            log=self.log,
            session=Session(
                restart_bytes=config.limits.restart_memory_bytes,
                resume_tail_bytes=resume_tail_bytes(config),
            ),
            resumes=resumes,
            client=websocket.remote_address[0] if websocket.remote_address else None,
        )
        self._watch = DrainWatch(
            websocket.transport,
            send_timeout=self._send_timeout,
            stall_timeout=config.stream.stall_timeout_s or None,
            on_stall=self.driver.stall,
            log=self.log,
            request_id=lambda: self.driver.session.active_id,
        )
        self._sender = Sender(websocket, self._watch)
        #: Its ``pull`` requests, beside its generations (docs/models.md).
        # Given the sender and the session, not this connection's methods: no
        # reference cycle back to the connection (it is freed when it closes,
        # without waiting for the cyclic GC).
        session = self.driver.session
        self.pulls = ConnectionPulls(
            services,
            write=self._sender.send,
            log=self.log,
            id_taken=lambda request_id: session.state_of(request_id) is not None,
        )
        if isinstance(websocket, PeerAwareConnection):
            websocket.on_peer_close = self._peer_closed
        limits = config.limits
        self._frame_limiter = FrameLimiter(
            rate=limits.frames_per_s,
            burst=limits.frames_burst,
            close_after=limits.flood_close_after,
            now=self._loop.time(),
        )

    @property
    def session(self) -> Session:
        return self.driver.session

    @property
    def generations(self) -> dict[str, Generation]:
        """This connection's live requests (their engines not gone yet)."""
        return self.driver.generations

    # ------------------------------------------------------------ receive loop

    async def run(self) -> None:
        services = self._services
        try:
            await self._sender.send(
                Hello(
                    model=services.backend.model_name,
                    server=services.server_name,
                    limits=services.wire_limits,
                    honours=tuple(sorted(services.backend.honours)),
                    models=tuple(services.models.infos()),
                    pull=self.pulls.allowed,
                )
            )
            idle = self._idle_timeout
            while True:
                try:
                    # Cancelling recv() is safe in websockets: no frame is lost.
                    async with asyncio.timeout(idle):
                        message = await self.ws.recv()
                except TimeoutError:
                    if self.generations or len(self.pulls):
                        continue  # a request is running: the connection is not idle
                    self.log.info("idle for %.0fs; closing", idle)
                    await self._close(1000, "idle timeout")
                    return
                await self._receive(message)
        except (ConnectionClosed, WireLost):
            pass
        finally:
            await self.pulls.close()
            await self.driver.close()
            # The watchdog holds bound methods of the driver: break that
            # cycle, so that a closed connection's memory returns at once,
            # without waiting for the cyclic GC.
            self._watch.detach()

    async def _receive(self, message: str | bytes) -> None:
        verdict = self._frame_limiter.check(self._loop.time())
        if verdict != "ok":
            if verdict == "flood":
                self.log.warning("kept sending over the frame rate limit; closing")
                await self._close_discarding(1008, "frame rate limit exceeded")
                raise WireLost("closed for flooding")
            await self.driver.refuse(ProtocolError("rate_limited", "too many frames; slow down"))
            return
        try:
            frame = parse_client_frame(message, self._services.wire_limits)
        except ProtocolError as exc:
            self.log.debug(
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
        if isinstance(frame, Cancel) and self.pulls.owns(frame.id):
            await self.pulls.cancel(frame.id)
            return
        new_id = frame.new_id if isinstance(frame, Restart) else frame.id
        if isinstance(frame, Generate | Restart) and self.pulls.knows(new_id):
            await self.driver.refuse(
                ProtocolError("duplicate_id", f"id {new_id!r} was already used", new_id)
            )
            return
        await self.driver.receive(frame)

    # ------------------------------------------------------------ the dialect

    async def write(self, frame: ServerFrame) -> None:
        """A frame of the protocol goes out as it is (serialized JSON)."""
        await self._sender.send(frame)

    def _peer_closed(self) -> None:
        """The client sent its close frame: stop producing for it right away."""
        self.log.info("client is closing; stopping its generation")
        self.driver.peer_closing()

    # ------------------------------------------------------------ closing

    async def _close(self, code: int, reason: str) -> None:
        """Close with a handshake, or abort if the client does not take part."""
        try:
            async with asyncio.timeout(self._send_timeout):
                await self.ws.close(code, reason)
        except TimeoutError:
            self.ws.transport.abort()

    async def _close_discarding(self, code: int, reason: str) -> None:
        """Close while discarding what the client still sends: its close frame may
        sit behind a backlog of messages that nobody would read any more (reading
        pauses at ``max_queue``). Call only from the receive loop."""
        closing = asyncio.create_task(self._close(code, reason))
        with contextlib.suppress(ConnectionClosed):
            while True:
                await self.ws.recv()
        await closing

    # ------------------------------------------------------------ inspection

    def buffered_bytes(self) -> int:
        """Bytes this connection holds for its client: channels + write buffer."""
        return self.driver.buffered_bytes() + write_buffered(self.ws.transport)

    def held_bytes(self) -> dict[str, int]:
        """Everything this connection holds in memory, by part (docs/operations.md)."""
        ws = self.ws
        receive = ws.receive_buffered_bytes() if isinstance(ws, PeerAwareConnection) else 0
        return {
            "send": self.buffered_bytes(),
            "receive": receive,
            "restart": self.session.restart_bytes,
            "resume": self.session.resume_bytes,
        }

    async def shutdown(self, timeout: float | None = None) -> None:
        """Server shutdown: end running requests as cancelled, then close 1001.

        Within ``timeout`` seconds, or the connection is aborted: a client
        that does not read must not hold up the server's exit.
        """
        try:
            async with asyncio.timeout(timeout):
                await self.driver.cancel_active()
                await self._close(1001, "server shutting down")
        except TimeoutError:
            self.log.info("did not take part in closing; aborting")
            self.ws.transport.abort()
