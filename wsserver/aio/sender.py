"""Sending frames to one client, and the drain watchdog.

``send()`` writes a frame at once and then waits while the transport holds
more than ``write_limit`` bytes (the listening socket also has a small
``SO_SNDBUF``), so a slow reader parks the request's sender; its channel
fills; its engine pauses. :meth:`Sender.send` bounds that wait by the
client's *progress*, never by its speed: a client that reads nothing for
``server.send_timeout_s`` is aborted rather than allowed to hang the server,
and one that reads nothing for ``stream.stall_timeout_s`` while another
request waits for the model has its blocked requests ended (``on_stall``).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from collections.abc import Callable

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..logs import ConnectionLog
from ..protocol import ServerFrame, serialize

__all__ = ["Sender"]


class Sender:
    """Sends frames to one client, watching its progress while it reads slowly."""

    def __init__(
        self,
        websocket: ServerConnection,
        *,
        send_timeout: float,
        stall_timeout: float | None,
        on_stall: Callable[[], None],
        log: ConnectionLog,
        active_id: Callable[[], str | None],
    ) -> None:
        self._ws = websocket
        self._send_timeout = send_timeout
        self._stall_timeout = stall_timeout
        self._on_stall = on_stall
        self._log = log
        self._active_id = active_id
        sock = websocket.transport.get_extra_info("socket") if websocket.transport else None
        self._socket_fd: int | None = sock.fileno() if sock is not None else None
        # How often a blocked send looks at the client's progress.
        self._watch_s = min(0.25, send_timeout / 4, (stall_timeout or 1.0) / 4)

    def detach(self) -> None:
        """Drop the callbacks into the connection: they are bound methods of
        it, a reference cycle that would keep a closed connection's memory
        until the cyclic GC runs."""
        self._on_stall = _nothing
        self._active_id = _no_request

    async def send(self, frame: ServerFrame) -> None:
        """Send one frame. While the client reads slowly, watch its progress.

        ``send()`` writes the frame at once and then waits while the write
        buffer is above ``write_limit``. If that takes longer than one watch
        interval, :meth:`_drain_watching` takes over the wait.
        """
        data = serialize(frame)
        try:
            async with asyncio.timeout(self._watch_s):
                await self._ws.send(data, text=True)
            return
        except TimeoutError:
            # The frame is written; only the wait for the drain was cut short.
            pass
        await self._drain_watching()

    async def _drain_watching(self) -> None:
        """Wait for the write buffer to drain, judging the client by its progress.

        Progress means the bytes outstanding to the client (write buffer plus
        the kernel's unacknowledged queue) went down: the client is reading,
        however slowly, and a slow reader is never cut off for its speed. With
        no progress for ``stream.stall_timeout_s``, ``on_stall`` runs (it ends
        requests blocked on a full channel if another request waits for the
        model); with none for ``server.send_timeout_s`` the connection is
        aborted (keepalive pings cannot tell: they queue behind the same buffer).
        """
        ws = self._ws
        transport = ws.transport
        loop = asyncio.get_running_loop()
        last_size = self._outstanding_bytes()
        last_progress = loop.time() - self._watch_s
        while True:
            try:
                async with asyncio.timeout(self._watch_s):
                    await ws.drain()
                return
            except TimeoutError:
                pass
            if transport.is_closing():
                raise ConnectionClosed(None, None)
            now = loop.time()
            size = self._outstanding_bytes()
            if size < last_size:
                last_progress = now
            last_size = size
            idle = now - last_progress
            if self._stall_timeout is not None and idle >= self._stall_timeout:
                self._on_stall()
            if idle >= self._send_timeout:
                request_id = self._active_id()
                self._log.warning(
                    "send made no progress for %.1fs; aborting the connection",
                    idle,
                    extra={} if request_id is None else {"request": request_id},
                )
                transport.abort()
                raise ConnectionClosed(None, None)

    def _outstanding_bytes(self) -> int:
        """Bytes sent to this client that it has not yet received.

        The transport's write buffer plus, on Linux, the socket's unacknowledged
        send queue (SIOCOUTQ): the kernel's buffer shrinks as soon as the
        client's TCP stack acknowledges data, long before the transport's
        buffer moves, so a slow reader shows its progress at a fine grain.
        """
        size = self._ws.transport.get_write_buffer_size()
        if self._socket_fd is not None:
            try:
                size += struct.unpack(
                    "i", fcntl.ioctl(self._socket_fd, termios.TIOCOUTQ, b"\0\0\0\0")
                )[0]
            except OSError:
                self._socket_fd = None
        return size


def _nothing() -> None:
    return None


def _no_request() -> str | None:
    return None
