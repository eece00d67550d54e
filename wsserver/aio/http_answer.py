"""Writing one HTTP answer: a streamed SSE body, or a whole one.

Every HTTP dialect answers the same two ways, and this is written once (the
exchange, :mod:`wsserver.aio.exchange`, decides what; this writes it):

* **streamed** — the head (``text/event-stream``, or the dialect's type:
  Ollama's ``application/x-ndjson``; no buffering by proxies)
  goes out when the request starts or waits, then body bytes, each write
  waiting while the transport is above its high-water mark (the pump stops,
  the channel fills, the engine pauses), a ``: keep-alive`` comment (or the
  dialect's own keep-alive event) every :data:`KEEPALIVE_S` while nothing
  else is sent (a dialect without one sends nothing), and a last write that ends
  the body;
* **whole** — one response with its status, ``Content-Length`` and body
  (an error's status while the head is unsent).

:attr:`HttpAnswer.finished` resolves once the answer is complete (or will
never be: the client is gone).
"""

from __future__ import annotations

import asyncio
from typing import Final

from ..dialects.exchange import KEEPALIVE
from ..errors import refusal_headers
from .http_route import Headers, Responder

__all__ = ["KEEPALIVE_S", "HttpAnswer"]

#: While a streamed request waits (for the model, or its prompt), its
#: keep-alive (:data:`~wsserver.dialects.exchange.KEEPALIVE`, or the dialect's own)
#: this often keeps proxies and clients from timing it out.
KEEPALIVE_S: Final = 10.0


class HttpAnswer:
    """The answer to one HTTP request, written through the connection's :class:`Responder`."""

    def __init__(
        self,
        out: Responder,
        headers: Headers,
        *,
        keepalive: bytes = KEEPALIVE,
        media_type: str = "text/event-stream; charset=utf-8",
    ) -> None:
        self._out = out
        self._headers = headers
        #: The streamed answer's content type (SSE, or Ollama's NDJSON).
        self._media_type = media_type
        #: What keeps a waiting stream alive: a comment, or a dialect's own
        #: event that its clients skip (the Messages API's ``ping``).
        self._keepalive_bytes = keepalive
        self._loop = asyncio.get_running_loop()
        self.finished: asyncio.Future[None] = self._loop.create_future()
        self.head_sent = False
        self._keepalive: asyncio.TimerHandle | None = None
        self._wrote = False

    @property
    def lost(self) -> bool:
        return self._out.lost

    def head(self) -> None:
        """The streamed answer's head (once)."""
        if self.head_sent or self._out.lost:
            return
        self.head_sent = True
        headers = [
            ("Content-Type", self._media_type),
            ("Cache-Control", "no-cache"),
            # nginx buffers a proxied body unless told otherwise.
            ("X-Accel-Buffering", "no"),
            *self._headers,
        ]
        self._out.start(200, headers)
        self._keepalive = self._loop.call_later(KEEPALIVE_S, self._keep_alive)

    def _keep_alive(self) -> None:
        self._keepalive = None
        if self.finished.done() or self._out.lost:
            return
        if not self._wrote and not self._out.paused and self._keepalive_bytes:
            self._out.send(self._keepalive_bytes)
        self._wrote = False
        self._keepalive = self._loop.call_later(KEEPALIVE_S, self._keep_alive)

    def stop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    async def write(self, data: bytes, *, progress: bool = True) -> None:
        """Body bytes of the streamed answer; waits above the high-water mark.
        ``progress``: real content (a keep-alive comment is not)."""
        if progress:
            self._wrote = True
        self._out.send(data)
        await self._out.drain()

    def write_last(self, data: bytes) -> None:
        """The streamed answer's last bytes, and its end."""
        if self.finished.done():
            return
        self.finish()
        if not self._out.lost:
            self._out.send(data)
            self._out.end()

    def respond(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        """A whole answer."""
        if self.finished.done():
            return
        self.finish()
        if self._out.lost:
            return
        self.head_sent = True
        headers = [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            *self._headers,
            *refusal_headers(status),
        ]
        self._out.start(status, headers)
        self._out.send(body)
        self._out.end()

    def finish(self) -> None:
        """The answer is complete, or will never be."""
        self.stop_keepalive()
        if not self.finished.done():
            self.finished.set_result(None)
