"""The listening socket, and what websockets is told about every handshake."""

from __future__ import annotations

import socket
from collections.abc import Sequence

from websockets.asyncio.server import ServerConnection
from websockets.typing import Subprotocol

from ..security import select_subprotocol

__all__ = ["make_listening_socket", "select_ws_subprotocol"]


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


def select_ws_subprotocol(
    connection: ServerConnection, offered: Sequence[Subprotocol]
) -> Subprotocol | None:
    """websockets' ``select_subprotocol`` hook: the subprotocol we speak, if offered."""
    selected = select_subprotocol(offered)
    return None if selected is None else Subprotocol(selected)
