"""Writing messages to one WebSocket client, whatever its dialect.

``send()`` writes a message at once and then waits while the transport holds
more than ``write_limit`` bytes (the listening socket also has a small
``SO_SNDBUF``), so a slow reader parks the request's pump; its channel fills;
its engine pauses. A wait longer than one watch interval is handed to the
connection's :class:`~wsserver.aio.drain.DrainWatch`, which judges the client
by its progress — the same watchdog as over HTTP.

The dialect renders (a protocol frame serialized, a Responses event as JSON);
the sender only moves the bytes, as one text message each.

**A large message** (an ``embed_done`` with its vectors) is written with the
socket's send buffer widened to two TCP segments, as a whole HTTP answer is
(:class:`~wsserver.aio.listener.WholeAnswerBuffer`: below two segments each
send waits for the client's delayed ACK — on loopback ~2 MB/s). The next
message restores ``server.sndbuf`` before it is written, so no message after
a large one enters a widened buffer: beyond that one message (which, if a
stream's, is within the output ceiling) the kernel holds at most twice
``sndbuf`` — the bound a resumable stream's replay tail is sized on
(:func:`~wsserver.aio.peer.resume_tail_bytes`).
"""

from __future__ import annotations

import asyncio

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..errors import WireLost
from .drain import DrainWatch
from .listener import WholeAnswerBuffer

__all__ = ["Sender"]


class Sender:
    """Sends text messages to one client, watching its progress while it reads slowly."""

    def __init__(self, websocket: ServerConnection, watch: DrainWatch, *, sndbuf: int = 0) -> None:
        self._ws = websocket
        self.watch = watch
        #: The socket's send buffer, widened for one large message (tests).
        self.send_buffer = WholeAnswerBuffer(sndbuf, websocket.transport.get_extra_info("socket"))

    async def send(self, data: bytes) -> None:
        """Send one message (UTF-8 JSON, sent as text); raises
        :class:`~wsserver.errors.WireLost` if the client is gone, or was aborted
        for reading nothing for ``server.send_timeout_s``. This is the seam:
        websockets' ``ConnectionClosed`` stops here, and the driver above knows
        no transport."""
        interval = self.watch.interval
        self.send_buffer.restore()
        self.send_buffer.widen(len(data))
        try:
            async with asyncio.timeout(interval):
                await self._ws.send(data, text=True)
            return
        except TimeoutError:
            # The message is written; only the wait for the drain was cut short.
            pass
        except ConnectionClosed:
            raise WireLost("the connection is closed") from None
        if not await self.watch.wait(self._ws.drain, waited=interval):
            raise WireLost("the connection is gone")
