"""One WebSocket connection, whatever dialect it speaks.

Two dialects are spoken over a WebSocket: the WebSocket protocol
(docs/protocol.md; :mod:`wsserver.aio.connection`) and the Responses API's
WebSocket mode (docs/responses-api.md; :mod:`wsserver.aio.responses_socket`).
They differ in how a message is parsed and how a request's frames are
rendered; the socket is this module's, written once:

* the **receive loop** (:meth:`SocketConnection.run`) always runs, so a cancel
  is read even while a stream is backed up; it applies the frame rate
  (:class:`~wsserver.security.FrameLimiter`: over it, a refusal in the
  dialect's shape; a flood, close 1008) and the idle timeout, and hands each
  message to the dialect;
* **one sender** (:class:`~wsserver.aio.sender.Sender`) writes every message,
  waiting while the client reads slowly, and one
  :class:`~wsserver.aio.drain.DrainWatch` judges the client by its progress
  (a stall → the dialect's stall rule; no progress → abort);
* **one table** of the connection's live requests (:attr:`generations`),
  shared by its request drivers — the protocol's one, or one per lane of the
  Responses mode — all built by :meth:`SocketContext.new_driver`;
* **one way to close**: the client's close frame stops production at once;
  a lost connection parks what can be resumed and stops the rest; a server
  shutdown ends the running requests as cancelled and closes with 1001,
  bounded in time; and **one count** of what the connection holds
  (:meth:`buffered_bytes`, :meth:`held_bytes`), the same for both dialects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..core.session import Session
from ..errors import ProtocolError, WireLost
from ..logs import ConnectionLog
from ..security import FrameLimiter
from .drain import DrainWatch, write_buffered
from .driver import Dialect, RequestDriver
from .peer import PeerAwareConnection
from .pipeline import Generation
from .resume import Resumes
from .sender import Sender
from .services import Services

__all__ = ["SocketConnection", "SocketContext", "SocketDialect", "SocketDialectFactory"]

log = logging.getLogger("wsserver.connection")


class SocketDialect(Protocol):
    """What one WebSocket dialect says its own way; the rest is the connection's."""

    #: Said of the connection when it opens (the log line), "" for none.
    label: str

    def drivers(self) -> Sequence[RequestDriver]:
        """Its request drivers: the protocol's one, or one per lane."""

    async def greet(self) -> None:
        """What the client gets first (the protocol's ``hello``), if anything."""

    async def receive(self, message: str | bytes) -> None:
        """One message from the client, within the frame rate."""

    async def refuse(self, exc: ProtocolError, message: str | bytes | None = None) -> None:
        """``message`` refused before it was read (over the frame rate):
        counted, logged and answered in the dialect's shape."""

    def busy(self) -> bool:
        """Whether it runs something besides the requests in the connection's
        table (pulls, a lane's waiting requests): the connection is not idle."""

    def upload_bytes(self) -> int:
        """Bytes of image uploads it holds for the client's next request (0: none)."""

    def stall(self) -> None:
        """The client read nothing for ``stream.stall_timeout_s``: its stall rule."""

    async def close(self) -> None:
        """The connection is gone: end what is its own (pulls, lanes, kept responses);
        the connection then closes its drivers."""


@dataclass(frozen=True, slots=True, eq=False)
class SocketContext:
    """What a dialect is given of its connection — not the connection itself,
    so that a closed connection and its dialect are freed without the cyclic
    GC (the sender's drain watch lets go of the connection when it closes)."""

    services: Services
    log: ConnectionLog
    #: The connection's one sender.
    sender: Sender
    #: Live requests of every driver of the connection (their engines not gone yet).
    generations: dict[str, Generation]
    #: The client's address, for the caps on detached requests.
    client: str | None

    def new_driver(
        self, dialect: Dialect, session: Session, *, resumes: Resumes | None = None
    ) -> RequestDriver:
        """A request driver of this connection, writing to ``dialect``: its
        requests join the connection's table, and the scheduler counts them as
        this connection's (connections take turns)."""
        return RequestDriver(
            self.services,
            dialect=dialect,
            log=self.log,
            session=session,
            resumes=resumes,
            generations=self.generations,
            client=self.client,
        )


#: Builds a connection's dialect (``server.py`` has one per path).
SocketDialectFactory = Callable[[SocketContext], SocketDialect]


class SocketConnection:
    """Serves one WebSocket client. Create per handshake and ``await run()``."""

    def __init__(
        self,
        services: Services,
        websocket: ServerConnection,
        conn_id: str,
        *,
        dialect: SocketDialectFactory,
    ) -> None:
        self.ws = websocket
        self.conn_id = conn_id
        self.log = ConnectionLog(log, conn_id)
        config = services.config
        self._send_timeout = config.server.send_timeout_s
        self._idle_timeout = config.server.idle_timeout_s or None
        self._loop = asyncio.get_running_loop()
        #: Live requests of every driver of this connection (their engines not gone yet).
        self.generations: dict[str, Generation] = {}
        self._watch = DrainWatch(
            websocket.transport,
            send_timeout=self._send_timeout,
            stall_timeout=config.stream.stall_timeout_s or None,
            on_stall=self._stall,
            log=self.log,
            request_id=self._active_id,
        )
        #: The one sender: every message to the client goes through it.
        self.sender = Sender(websocket, self._watch, sndbuf=config.server.sndbuf)
        limits = config.limits
        self._frame_limiter = FrameLimiter(
            rate=limits.frames_per_s,
            burst=limits.frames_burst,
            close_after=limits.flood_close_after,
            now=self._loop.time(),
        )
        peer = websocket.remote_address
        self.dialect = dialect(
            SocketContext(
                services=services,
                log=self.log,
                sender=self.sender,
                generations=self.generations,
                client=peer[0] if peer else None,
            )
        )
        if isinstance(websocket, PeerAwareConnection):
            websocket.on_peer_close = self._peer_closed

    # ------------------------------------------------------------ receive loop

    async def run(self) -> None:
        try:
            await self.dialect.greet()
            idle = self._idle_timeout
            while True:
                try:
                    # Cancelling recv() is safe in websockets: no frame is lost.
                    async with asyncio.timeout(idle):
                        message = await self.ws.recv()
                except TimeoutError:
                    if self.generations or self.dialect.busy():
                        continue  # a request is running: the connection is not idle
                    self.log.info("idle for %.0fs; closing", idle)
                    await self._close(1000, "idle timeout")
                    return
                verdict = self._frame_limiter.check(self._loop.time())
                if verdict == "ok":
                    await self.dialect.receive(message)
                elif verdict == "limited":
                    await self.dialect.refuse(
                        ProtocolError("rate_limited", "too many frames; slow down"), message
                    )
                else:
                    self.log.warning("kept sending over the frame rate limit; closing")
                    await self._close_discarding(1008, "frame rate limit exceeded")
                    return
        except (ConnectionClosed, WireLost):
            pass
        finally:
            await self._closed()

    async def _closed(self) -> None:
        """The connection is gone: the dialect's own parts, then its drivers —
        each parks what can be resumed and stops the rest — and the engines."""
        await self.dialect.close()
        drivers = self.dialect.drivers()
        # Nothing starts any more, on any driver, before one waits for the
        # engines of the table they share.
        for driver in drivers:
            driver.peer_closing()
        for driver in drivers:
            await driver.close()
        # The watchdog holds bound methods of this connection: break that
        # cycle, so that a closed connection's memory returns at once,
        # without waiting for the cyclic GC.
        self._watch.detach()

    def _peer_closed(self) -> None:
        """The client sent its close frame: stop producing for it right away."""
        self.log.info("client is closing; stopping its generation")
        for driver in self.dialect.drivers():
            driver.peer_closing()

    def _stall(self) -> None:
        self.dialect.stall()

    def _active_id(self) -> str | None:
        """A request the client considers running (the drain watch's log)."""
        for driver in self.dialect.drivers():
            if driver.session.active_id is not None:
                return driver.session.active_id
        return None

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

    async def shutdown(self, timeout: float | None = None) -> None:
        """Server shutdown: end running requests as cancelled, then close 1001.

        Within ``timeout`` seconds, or the connection is aborted: a client
        that does not read must not hold up the server's exit.
        """
        try:
            async with asyncio.timeout(timeout):
                for driver in self.dialect.drivers():
                    await driver.cancel_active()
                await self._close(1001, "server shutting down")
        except TimeoutError:
            self.log.info("did not take part in closing; aborting")
            self.ws.transport.abort()

    # ------------------------------------------------------------ inspection

    def buffered_bytes(self) -> int:
        """Bytes this connection holds for its client: channels + write buffer."""
        channels = sum(g.channel.buffered_bytes() for g in list(self.generations.values()))
        return channels + write_buffered(self.ws.transport)

    def held_bytes(self) -> dict[str, int]:
        """Everything this connection holds in memory, by part (docs/operations.md)."""
        ws = self.ws
        receive = ws.receive_buffered_bytes() if isinstance(ws, PeerAwareConnection) else 0
        sessions = [driver.session for driver in self.dialect.drivers()]
        return {
            "send": self.buffered_bytes(),
            "receive": receive,
            "restart": sum(session.restart_bytes for session in sessions),
            "resume": sum(session.resume_bytes for session in sessions),
            "upload": self.dialect.upload_bytes(),
        }
