"""The drain watchdog: how long a transport may wait for its client to read.

Every transport writes a frame (or an SSE chunk) at once and then waits while
its write buffer is above ``server.write_limit`` — the listening socket also
has a small ``SO_SNDBUF`` — so a slow reader parks its request's pump; the
request's channel fills; its engine pauses. :class:`DrainWatch` bounds that
wait by the client's *progress*, never by its speed, the same way for the
WebSocket protocol and for HTTP:

* progress means the bytes outstanding to the client (write buffer plus the
  kernel's unacknowledged send queue) went down: the client is reading,
  however slowly, and a slow reader is never cut off for its speed;
* with no progress for ``stream.stall_timeout_s``, ``on_stall`` runs (the
  request driver ends requests blocked on a full channel if another request
  waits for the model);
* with none for ``server.send_timeout_s`` the connection is aborted
  (keepalive pings cannot tell: they queue behind the same buffer).
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from collections.abc import Awaitable, Callable

from ..logs import ConnectionLog

__all__ = ["DrainWatch", "write_buffered"]


def write_buffered(transport: asyncio.BaseTransport | None) -> int:
    """Bytes in a transport's write buffer (0 once it is closing)."""
    if not isinstance(transport, asyncio.WriteTransport) or transport.is_closing():
        return 0
    return transport.get_write_buffer_size()


class DrainWatch:
    """Waits for one connection's write buffer to drain, watching its client."""

    def __init__(
        self,
        transport: asyncio.WriteTransport,
        *,
        send_timeout: float,
        stall_timeout: float | None,
        on_stall: Callable[[], None],
        log: ConnectionLog,
        request_id: Callable[[], str | None],
    ) -> None:
        self._transport = transport
        self._send_timeout = send_timeout
        self._stall_timeout = stall_timeout
        self._on_stall = on_stall
        self._log = log
        self._request_id = request_id
        sock = transport.get_extra_info("socket")
        self._socket_fd: int | None = sock.fileno() if sock is not None else None
        #: How often a blocked write looks at the client's progress.
        self.interval = min(0.25, send_timeout / 4, (stall_timeout or 1.0) / 4)

    def detach(self) -> None:
        """Drop the callbacks into the connection: they are bound methods of
        it, a reference cycle that would keep a closed connection's memory
        until the cyclic GC runs."""
        self._on_stall = _nothing
        self._request_id = _no_request

    async def wait(self, drained: Callable[[], Awaitable[object]], *, waited: float = 0.0) -> bool:
        """Wait until ``drained()`` completes. False if the connection closed,
        was reset by the client (websockets hands its drain waiters the
        transport's ``OSError`` as it is) or was aborted for making no progress
        meanwhile. ``waited``: seconds the caller already waited for this drain."""
        transport = self._transport
        loop = asyncio.get_running_loop()
        last_size = self.outstanding_bytes()
        last_progress = loop.time() - waited
        while True:
            try:
                async with asyncio.timeout(self.interval):
                    await drained()
                return True
            except TimeoutError:
                pass
            except OSError:  # ConnectionResetError, BrokenPipeError: the client is gone
                return False
            if transport.is_closing():
                return False
            now = loop.time()
            size = self.outstanding_bytes()
            if size < last_size:
                last_progress = now
            last_size = size
            idle = now - last_progress
            if self._stall_timeout is not None and idle >= self._stall_timeout:
                self._on_stall()
            if idle >= self._send_timeout:
                request_id = self._request_id()
                self._log.warning(
                    "send made no progress for %.1fs; aborting the connection",
                    idle,
                    extra={} if request_id is None else {"request": request_id},
                )
                transport.abort()
                return False

    def outstanding_bytes(self) -> int:
        """Bytes sent to this client that it has not yet received.

        The transport's write buffer plus, on Linux, the socket's unacknowledged
        send queue (SIOCOUTQ): the kernel's buffer shrinks as soon as the
        client's TCP stack acknowledges data, long before the transport's
        buffer moves, so a slow reader shows its progress at a fine grain.
        """
        size = self._transport.get_write_buffer_size()
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
