"""The write side of one HTTP/1.1 connection: h11's events out, under flow control.

:class:`HttpOut` is the connection's :class:`~wsserver.aio.http_route.Responder`:
every answer — a route's whole body, an exchange's stream, a refusal — goes
out through it as h11 events (h11 frames them: ``Content-Length`` or chunked,
keep-alive or close).

**Flow control.** The transport's write buffer has a high-water mark of
``server.write_limit`` (and the listening socket's small ``SO_SNDBUF``);
above it asyncio pauses the connection's writing and :meth:`HttpOut.drain`
waits: a completion's pump waits there, so a slow reader pauses its own
request. As over a WebSocket the wait is judged by the client's progress
(:class:`~wsserver.aio.drain.DrainWatch`): no progress for
``stream.stall_timeout_s`` while another request waits for the model ends the
request as ``stalled``; none for ``server.send_timeout_s`` aborts the
connection.

**Closing.** A close that leaves output unsent is aborted after
``server.send_timeout_s``: a client that never reads would otherwise hold the
socket, and its place in the connection limits, for good.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Final

import h11

from ..dialects.api_errors import ApiError
from ..errors import refusal_headers
from ..logs import ConnectionLog
from .drain import DrainWatch
from .http_route import Headers
from .listener import WholeAnswerBuffer

__all__ = ["HttpOut"]

#: Statuses outside the HTTP standard that a dialect answers with.
_PHRASES: Final = {529: b"Overloaded"}


class HttpOut:
    """The write side of one HTTP/1.1 connection (see the module docstring)."""

    def __init__(
        self,
        h11_connection: h11.Connection,
        *,
        log: ConnectionLog,
        send_timeout: float,
        sndbuf: int = 0,
    ) -> None:
        self._h11 = h11_connection
        self._log = log
        self._send_timeout = send_timeout
        #: The socket's send buffer, widened for a large whole answer (tests).
        self.send_buffer = WholeAnswerBuffer(sndbuf)
        self._transport: asyncio.Transport | None = None
        self._watch: DrainWatch | None = None
        self._lost = False
        #: The request being answered (a ``HEAD`` gets the head of its answer only).
        self.request: h11.Request | None = None
        #: Set while the write buffer is above its high-water mark (tests, as PeerAwareConnection).
        self.writing_paused = asyncio.Event()
        #: Set while a write need not wait: below the mark, or the client is gone.
        self._writable = asyncio.Event()
        self._writable.set()
        #: The largest the write buffer has been after a write (tests, diagnostics).
        self.peak_write_buffer = 0
        #: Aborts a closing transport whose output the client does not take.
        self._close_deadline: asyncio.TimerHandle | None = None

    def attach(self, transport: asyncio.Transport, watch: DrainWatch) -> None:
        """The connection is made: write to ``transport``, judge waits with ``watch``."""
        self._transport = transport
        self._watch = watch
        self.send_buffer.sock = transport.get_extra_info("socket")

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def paused(self) -> bool:
        return self.writing_paused.is_set()

    @property
    def writable(self) -> bool:
        """Whether a write need not wait (below the mark, or the client is gone)."""
        return self._writable.is_set()

    def set_paused(self, paused: bool) -> None:
        """asyncio's flow control: above the high-water mark, or below again."""
        if paused:
            self._writable.clear()
            self.writing_paused.set()
        else:
            self._writable.set()
            self.writing_paused.clear()

    def lose(self) -> None:
        """The client is gone (or the connection handed over): nothing more is
        written, and no write waits."""
        self._lost = True
        self._writable.set()

    def release(self) -> None:
        """The connection is no longer ours (lost, or handed over): its timers
        stop, its send buffer is the configured size (a WebSocket's streams)."""
        self.send_buffer.restore()
        if self._close_deadline is not None:
            self._close_deadline.cancel()
            self._close_deadline = None
        if self._watch is not None:
            self._watch.detach()

    # ------------------------------------------------------------ the Responder

    def start(self, status: int, headers: Headers) -> None:
        # An answer whole in memory declares its length (a stream does not):
        # room for two segments while it goes out; the next answer's head
        # brings the configured size back (WholeAnswerBuffer).
        self.send_buffer.restore()
        request = self.request
        if request is None or request.method != b"HEAD":
            self.send_buffer.widen(_declared_length(headers))
        reason = _PHRASES.get(status) or HTTPStatus(status).phrase.encode("ascii")
        self._write(h11.Response(status_code=status, headers=_encode(headers), reason=reason))

    def send(self, data: bytes) -> None:
        if data:
            self._write(h11.Data(data=data))

    def end(self) -> None:
        self._write(h11.EndOfMessage())

    async def drain(self) -> None:
        """Wait while the write buffer is above the high-water mark, judging
        the client by its progress (see the module docstring)."""
        if self._writable.is_set() or self._watch is None:
            return
        await self._watch.wait(self._writable.wait)

    def simple(self, status: int, body: bytes, headers: Headers | None = None) -> None:
        """A whole response (only while one may start); JSON unless
        ``headers`` name their own ``Content-Type``."""
        if self._lost or self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        all_headers = [("Content-Length", str(len(body))), *(headers or [])]
        if body and not any(name.lower() == "content-type" for name, _ in all_headers):
            all_headers.insert(0, ("Content-Type", "application/json"))
        self.start(status, all_headers)
        request = self.request
        if request is None or request.method != b"HEAD":
            self.send(body)  # a HEAD gets the headers of the answer only
        self.end()

    def send_continue(self) -> None:
        """``100 Continue``: the client waits for it before sending its body."""
        self._write(h11.InformationalResponse(status_code=100, headers=[]))

    def refuse_at_once(self, refusal: ApiError) -> None:
        """Answer before any request was read (over a connection limit), then close."""
        assert self._transport is not None
        body = refusal.body()
        status = HTTPStatus(refusal.status)
        head = [
            f"HTTP/1.1 {status.value} {status.phrase}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in refusal_headers(status)),
        ]
        self._transport.write(("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body)
        self.close()

    def _write(self, event: h11.Event) -> None:
        if self._lost or self._transport is None:
            return
        try:
            data = self._h11.send(event)
        except h11.LocalProtocolError:
            self._log.exception("HTTP framing error; closing")
            self.close()
            return
        if data:
            self._transport.write(data)
            size = self._transport.get_write_buffer_size()
            if size > self.peak_write_buffer:
                self.peak_write_buffer = size

    # ------------------------------------------------------------ closing

    def close(self) -> None:
        """Close the transport once its output is taken, or abort it after
        ``server.send_timeout_s``."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.close()
        if transport.get_write_buffer_size() and self._close_deadline is None:
            # close() waits for the client to take what is still buffered; a
            # client that never reads would hold the socket (and its place in
            # the connection limits) for good.
            loop = asyncio.get_running_loop()
            self._close_deadline = loop.call_later(self._send_timeout, transport.abort)

    def abort(self) -> None:
        """Drop the connection now."""
        if self._transport is not None:
            self._transport.abort()


def _declared_length(headers: Headers) -> int:
    """The ``Content-Length`` a head declares (0: none, a stream's)."""
    for name, value in headers:
        if name.lower() == "content-length" and value.isdigit():
            return int(value)
    return 0


def _encode(headers: Headers) -> list[tuple[bytes, bytes]]:
    return [(name.encode("ascii"), value.encode("latin-1")) for name, value in headers]
