"""One port, two servers: the first request line decides who gets the connection.

websockets serves the WebSocket protocol and the plain GET routes
(:mod:`wsserver.aio.http`) on our port, and its handshake parser refuses
anything but GET; the OpenAI API needs POST and a streamed body. So the
asyncio protocol that ``serve()`` builds for each accepted connection is this
:class:`Front`, which reads up to the end of the request line and hands the
connection over for good:

* a target under ``/v1`` or ``/api`` (Ollama's API) goes to the HTTP
  API's handler (:mod:`wsserver.aio.openai_http`) — but ``GET
  /v1/responses``, the Responses API's WebSocket mode, is an upgrade and
  goes to websockets;
* anything else — every WebSocket handshake, ``/``, ``/healthz``,
  ``/metrics`` — goes to websockets' own connection, exactly as if the
  front were not there: it is built as ``serve()`` would have built it,
  receives the transport with ``connection_made`` and then the bytes read so
  far, and the transport is pointed at it (``set_protocol``), so nothing of
  ours sits between the socket and websockets from then on.

A connection the OpenAI handler keeps alive is routed the same way request
by request: it answers the plain routes itself and gives a WebSocket upgrade
back to websockets through :meth:`Front.to_websockets` (the front is done
with the connection, but keeps what websockets' connection is built from).

A method other than ``GET`` and ``HEAD`` outside the API is answered here,
405 with ``Allow: GET, HEAD``: websockets would drop a request with a body
(``Content-Length``, ``Transfer-Encoding``) without a word.

The cost for a WebSocket connection is one look at its first bytes; the
figures before and after are in docs/benchmarks.md. A client that sends no
complete request line within :data:`OPEN_TIMEOUT_S` is dropped, as
websockets' own ``open_timeout`` would have done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

from websockets.asyncio.server import Server as WsServer
from websockets.server import ServerProtocol

__all__ = ["MAX_REQUEST_LINE", "OPEN_TIMEOUT_S", "Front", "front_factory", "is_api_target"]

#: A request line longer than this goes to websockets, which refuses it properly.
MAX_REQUEST_LINE: Final = 8192
#: The targets of the HTTP API: OpenAI's (and the Responses and Messages
#: APIs under it), Ollama's.
API_PREFIXES: Final = (b"/v1", b"/api")
#: ``GET`` on this target is the Responses API's WebSocket mode, an upgrade:
#: it goes to websockets (``POST`` and ``/v1/responses/{id}`` are HTTP).
RESPONSES_SOCKET: Final = b"/v1/responses"
#: websockets' default ``open_timeout``: how long a silent new connection may stay.
OPEN_TIMEOUT_S: Final = 10.0

#: Builds websockets' connection for a handed-over client: ``create_connection``'s
#: signature, (sans-I/O protocol, server, keyword arguments).
WsFactory = Callable[..., asyncio.Protocol]


#: The one HTTP API path outside ``/v1`` and ``/api``: where llama-server's
#: and Jina's rerank clients look.
RERANK: Final = b"/rerank"


def is_api_target(request_line: bytes) -> bool:
    """Whether ``METHOD TARGET VERSION`` asks for the HTTP API: ``/v1``,
    ``/v1/…`` (but not ``GET /v1/responses``: a WebSocket upgrade), Ollama's
    ``/api``, ``/api/…``, and ``/rerank``."""
    parts = request_line.split(b" ")
    if len(parts) < 2:
        return False
    target = parts[1].split(b"?", 1)[0]
    if parts[0] == b"GET" and target == RESPONSES_SOCKET:
        return False  # the Responses API's WebSocket mode: websockets does the upgrade
    if target == RERANK:
        return True
    return any(target == prefix or target.startswith(prefix + b"/") for prefix in API_PREFIXES)


class Front(asyncio.Protocol):
    """The first protocol of every connection, until the request line is read."""

    def __init__(
        self,
        protocol: ServerProtocol,
        server: WsServer,
        *,
        ws_factory: WsFactory,
        http_factory: Callable[[Callable[[bytes], None]], asyncio.Protocol],
        **ws_kwargs: Any,
    ) -> None:
        #: websockets' ``select_subprotocol`` closure checks that the object
        #: its factory returned carries the sans-I/O protocol it built.
        self.protocol = protocol
        self._server = server
        self._ws_factory = ws_factory
        self._ws_kwargs = ws_kwargs
        self._http_factory = http_factory
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(OPEN_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self._transport is None or self._transport.is_closing():
            return  # answered already (405)
        self._buffer += data
        end = self._buffer.find(b"\n")
        if end < 0 and len(self._buffer) <= MAX_REQUEST_LINE:
            return
        line = bytes(self._buffer[: max(end, 0)]).rstrip(b"\r")
        if end >= 0 and is_api_target(line):
            self._hand_over(self._http_factory(self.to_websockets))
        elif end >= 0 and line.split(b" ", 1)[0] not in (b"GET", b"HEAD") and b" " in line:
            self._not_allowed()
        else:
            self._hand_over(self._ws_factory(self.protocol, self._server, **self._ws_kwargs))

    def eof_received(self) -> bool | None:
        return None  # closed before a request line: nothing to serve

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _not_allowed(self) -> None:
        self._cancel_timer()
        transport = self._transport
        assert transport is not None
        self._buffer = bytearray()
        transport.pause_reading()  # the body is not read: the connection closes
        transport.write(_NOT_ALLOWED)
        transport.close()
        # close() waits for the answer to be taken; a client that never reads is dropped.
        self._timer = asyncio.get_running_loop().call_later(OPEN_TIMEOUT_S, transport.abort)

    def to_websockets(self, data: bytes) -> None:
        """Give the connection to websockets with ``data``, the bytes read so
        far: a WebSocket upgrade on a connection the OpenAI handler kept
        alive, served as if it were the connection's first request."""
        self._buffer = bytearray(data)
        self._hand_over(self._ws_factory(self.protocol, self._server, **self._ws_kwargs))

    def _hand_over(self, protocol: asyncio.Protocol) -> None:
        self._cancel_timer()
        transport = self._transport
        assert transport is not None
        data, self._buffer = bytes(self._buffer), bytearray()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if not transport.is_closing():
            protocol.data_received(data)


_NOT_ALLOWED: Final = (
    b"HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\nContent-Length: 19\r\n"
    b"Connection: close\r\n\r\nmethod not allowed\n"
)


def front_factory(
    *, ws_factory: WsFactory, http_factory: Callable[[Callable[[bytes], None]], asyncio.Protocol]
) -> Callable[..., Front]:
    """What to pass as ``serve(create_connection=...)``: a :class:`Front` per client."""

    def create(protocol: ServerProtocol, server: WsServer, **ws_kwargs: Any) -> Front:
        return Front(
            protocol, server, ws_factory=ws_factory, http_factory=http_factory, **ws_kwargs
        )

    return create
