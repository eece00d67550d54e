"""Writing frames to one WebSocket client.

``send()`` writes a frame at once and then waits while the transport holds
more than ``write_limit`` bytes (the listening socket also has a small
``SO_SNDBUF``), so a slow reader parks the request's pump; its channel fills;
its engine pauses. A wait longer than one watch interval is handed to the
connection's :class:`~wsserver.aio.drain.DrainWatch`, which judges the client
by its progress — the same watchdog as over HTTP.
"""

from __future__ import annotations

import asyncio

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..errors import WireLost
from ..protocol import ServerFrame, serialize
from .drain import DrainWatch

__all__ = ["Sender"]


class Sender:
    """Sends frames to one client, watching its progress while it reads slowly."""

    def __init__(self, websocket: ServerConnection, watch: DrainWatch) -> None:
        self._ws = websocket
        self.watch = watch

    async def send(self, frame: ServerFrame) -> None:
        """Send one frame; raises :class:`~wsserver.errors.WireLost` if the
        client is gone, or was aborted for reading nothing for
        ``server.send_timeout_s``. This is the seam: websockets'
        ``ConnectionClosed`` stops here, and the driver above knows no transport."""
        data = serialize(frame)
        interval = self.watch.interval
        try:
            async with asyncio.timeout(interval):
                await self._ws.send(data, text=True)
            return
        except TimeoutError:
            # The frame is written; only the wait for the drain was cut short.
            pass
        except ConnectionClosed:
            raise WireLost("the connection is closed") from None
        if not await self.watch.wait(self._ws.drain, waited=interval):
            raise WireLost("the connection is gone")
