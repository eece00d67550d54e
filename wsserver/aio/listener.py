"""The listening socket, and what websockets is told about every handshake."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.typing import Subprotocol

from ..security import select_subprotocol

__all__ = ["WholeAnswerBuffer", "make_listening_socket", "select_ws_subprotocol"]


def make_listening_socket(host: str, port: int, *, sndbuf: int) -> socket.socket:
    """A listening TCP socket whose accepted sockets inherit a small send buffer.

    Linux autotunes send buffers to megabytes, which would swallow a slow
    client's backlog before ``send()`` ever waits: the backpressure signal
    would arrive seconds and megabytes late.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    # IPPROTO_TCP, not 0: accepted sockets inherit the protocol number, and
    # asyncio enables TCP_NODELAY only on sockets that say they are TCP.
    # Without it Nagle's algorithm holds a first delta behind the unacknowledged
    # ``started`` frame until the client's delayed ACK, up to ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if sndbuf > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        sock.bind(address)
        sock.listen(512)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class WholeAnswerBuffer:
    """An accepted socket's send buffer, widened to two segments while it
    sends an answer that is whole in memory.

    The small ``server.sndbuf`` is for streams: a slow reader fills it, and
    the wait reaches the request's pump. For a large answer sent at once it
    is a trap on loopback, where a segment is 32 KiB or more: a buffer that
    cannot hold two segments sends one at a time, and the receiver's TCP
    acknowledges a lone segment only after its delayed-ACK timer (~40 ms on
    Linux) — measured, a 6 MB ``/v1/embeddings`` answer took 3.0 s from its
    head to its last byte, at 16 KiB (32 KiB effective), and 2-4 ms with 64
    KiB (2026-12-04; llama-server, autotuned: 2 ms). The answer's bytes are
    in memory already, so the kernel holding up to two segments of them
    instead of asyncio's buffer adds nothing; the next answer on the
    connection (a stream, perhaps) gets the configured size back first.
    With ``sndbuf = 0`` (the kernel's autotuning) nothing is touched: setting
    a size would turn the autotuning off.
    """

    def __init__(self, sndbuf: int, sock: Any = None) -> None:
        self._sndbuf = sndbuf
        #: asyncio's TransportSocket (its socket's options); None until connected.
        self.sock = sock
        #: Whether the buffer is widened now (tests).
        self.widened = False

    def widen(self, size: int) -> None:
        """``size`` bytes go out whole next: at least two segments' room if
        they are more than the configured buffer holds."""
        if self.sock is None or self._sndbuf <= 0 or self.widened or size <= self._sndbuf:
            return
        try:
            segments = 2 * self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
            if segments > self._sndbuf:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, segments)
                self.widened = True
        except OSError:  # not TCP, or closed: the configured size stays
            pass

    def restore(self) -> None:
        """The configured size again (before the next answer starts)."""
        if not self.widened or self.sock is None:
            return
        self.widened = False
        with contextlib.suppress(OSError):  # closed: nothing to restore
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._sndbuf)


def select_ws_subprotocol(
    connection: ServerConnection, offered: Sequence[Subprotocol]
) -> Subprotocol | None:
    """websockets' ``select_subprotocol`` hook: the subprotocol we speak, if offered."""
    selected = select_subprotocol(offered)
    return None if selected is None else Subprotocol(selected)
