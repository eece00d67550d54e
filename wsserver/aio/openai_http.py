"""The HTTP/1.1 transport on the WebSocket port: one connection of the HTTP API.

:class:`HttpConnection` is the asyncio protocol a connection gets when its
first request line asks for ``/v1`` or ``/api`` (:mod:`wsserver.aio.front`). HTTP/1.1
itself is h11's (sans-I/O, python-hyper): bytes in, events out; this class
only reads requests (bounded, timed), hands each to the router
(:mod:`wsserver.aio.http_router`: the gate's checks, then the route its path
is registered to — every HTTP dialect's, chat completions included) and keeps
the connection's life: its answer goes out through :class:`~wsserver.aio.http_out.HttpOut`
(flow control, the drain watch), the request it runs is told when the client
goes or the server shuts down.

Every request on a kept-alive connection is routed as the first request of a
connection is (:func:`~wsserver.aio.front.is_api_target`): the plain
routes outside the API are answered by the router, and a WebSocket upgrade
that is no API target (``/``, ``GET /v1/responses``) hands the connection
to websockets, as the front would have: aiohttp, for one, reuses a
connection a ``GET /v1/models`` kept alive for its next ``ws_connect``.

Each response carries ``X-Request-ID`` (the client's, if valid, else a
generated one): the request's ID in logs.

**Disconnect is cancel.** EOF or a lost connection cancels the running
request at once (the request ends as ``cancelled`` and its engine stops).
Bytes a client sends while its request runs (pipelining) are held up to
:data:`MAX_PIPELINED` and then the connection is closed.

**Bounds** (docs/operations.md, "Limits"). A connection counts against
``limits.max_connections`` and ``max_connections_per_ip`` from the moment it
is handed over, not from its first complete request; one over a limit gets
its 503/429 at once. A request's head and body must arrive within
``server.request_timeout_s`` of its first byte (408, then close), the body
is at most ``server.max_frame_bytes``, and the next pipelined request is read
only once the previous response has drained below ``server.write_limit`` —
so a client that does not read cannot make responses pile up. Every close
that leaves output unsent is aborted after ``server.send_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Final

import h11

from ..dialects.api_errors import ApiError, error_body
from ..logs import ConnectionLog
from .drain import DrainWatch, write_buffered
from .front import is_api_target
from .http_out import HttpOut
from .http_route import Running, clip
from .http_router import Router, path_of
from .openai_gate import Gate
from .pipeline import Generation
from .services import Services

__all__ = ["HttpApi", "HttpConnection"]

log = logging.getLogger("wsserver.openai")

#: Bytes a client may send ahead while its request runs.
MAX_PIPELINED: Final = 65536

#: Hands the connection to websockets with the bytes read so far (the request
#: first): what the front does with a first request that is no OpenAI target.
ToWebsockets = Callable[[bytes], None]


@dataclass(frozen=True, slots=True, eq=False)
class HttpApi:
    """What every HTTP connection uses; built once by the server."""

    services: Services
    gate: Gate
    #: Every route, and the way a request reaches one (wsserver.aio.http_router).
    router: Router
    #: The server's live HTTP connections, by connection ID.
    live: dict[str, HttpConnection] = field(default_factory=dict)
    #: Set whenever a connection is handed over to the API (tests wait on it; they clear it).
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    next_id: Callable[[], str] = lambda: "h?"


class _Timer:
    """One timer of the connection (idle, receiving), re-armed as it goes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self, delay: float, callback: Callable[[], None]) -> None:
        self.cancel()
        self._handle = self._loop.call_later(delay, self._fire, callback)

    def _fire(self, callback: Callable[[], None]) -> None:
        self._handle = None
        callback()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class HttpConnection(asyncio.Protocol):
    """One HTTP/1.1 connection that asked for the HTTP API."""

    def __init__(self, http_api: HttpApi, *, to_websockets: ToWebsockets | None = None) -> None:
        self._http_api = http_api
        self._to_websockets = to_websockets
        self._services = http_api.services
        self.conn_id = http_api.next_id()
        self.log = ConnectionLog(log, self.conn_id)
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=16384)
        config = self._services.config
        #: The write side: every answer goes out through it.
        self.out = HttpOut(
            self._h11,
            log=self.log,
            send_timeout=config.server.send_timeout_s,
            sndbuf=config.server.sndbuf,
        )
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self.peer = "?"
        self._body = bytearray()
        self._handler: asyncio.Task[None] | None = None
        #: The request running now, if any (told of a disconnect, the shutdown, a stall).
        self.running: Running | None = None
        #: Generations started here whose engine is not gone yet (/readyz, /metrics, shutdown).
        self.generations: dict[str, Generation] = {}
        self._admitted = False
        self._closing = False
        #: Between requests of a kept-alive connection: ``server.idle_timeout_s``.
        self._idle = _Timer(self._loop)
        #: Runs from a request's first byte until its body is complete.
        self._receiving = _Timer(self._loop)
        #: Set while a response waits to drain before the next request is read (tests).
        self.draining = asyncio.Event()
        #: Set when the connection is gone (tests).
        self.closed = asyncio.Event()

    # ------------------------------------------------------------ asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        config = self._services.config
        transport.set_write_buffer_limits(high=config.server.write_limit)
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else "?"
        watch = DrainWatch(
            transport,
            send_timeout=config.server.send_timeout_s,
            stall_timeout=config.stream.stall_timeout_s or None,
            on_stall=self._stall,
            log=self.log,
            request_id=lambda: None,
        )
        self.out.attach(transport, watch)
        self._http_api.live[self.conn_id] = self
        self._http_api.opened.set()
        self.log.info("open from %s (HTTP)", self.peer)
        # Counted from now, not from a complete request: a client that
        # trickles its head or body holds a connection all the same.
        refusal = self._http_api.gate.admit(self, self.peer, lambda: not self.out.lost)
        if refusal is not None:
            self.log.info("refused: %d %s", refusal.status, refusal.message)
            self.out.refuse_at_once(refusal)
            return
        self._admitted = True
        # The request line has arrived (the front read it): the rest must follow.
        self._arm_receiving()

    def data_received(self, data: bytes) -> None:
        if self.out.lost or not self._admitted:
            return
        self._h11.receive_data(data)
        self._next_events()

    def eof_received(self) -> bool:
        # A client that closes its side is gone: HTTP clients do not half-close.
        self._client_gone()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._client_gone()
        self._release()
        self.log.info("closed (HTTP)")

    def pause_writing(self) -> None:
        self.out.set_paused(True)

    def resume_writing(self) -> None:
        self.out.set_paused(False)

    def _release(self) -> None:
        """The connection is no longer this handler's (lost, or handed over)."""
        self._idle.cancel()
        self._receiving.cancel()
        self.out.release()
        if not self.generations:
            # Else when the last engine is gone: until then its slot is this
            # connection's (the server's orphan check, /readyz), as a
            # WebSocket connection stays listed until its requests are gone.
            self._http_api.live.pop(self.conn_id, None)
        self._http_api.gate.connection_limiter.release(self)
        self.closed.set()

    def _client_gone(self) -> None:
        if self.out.lost:
            return
        self.out.lose()
        if self.running is not None:
            self.running.client_gone()

    # ------------------------------------------------------------ reading requests

    def _next_events(self) -> None:
        while self._handler is None and not self.out.lost:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._refuse_bad_http(exc)
                return
            if event is h11.NEED_DATA:
                if self._h11.their_state is not h11.IDLE or self._h11.trailing_data[0]:
                    self._idle.cancel()
                    self._arm_receiving()  # a request has begun: it must complete in time
                return
            if event is h11.PAUSED:
                break
            if isinstance(event, h11.Request):
                self._idle.cancel()
                if self._to_websockets is not None and _upgrade_elsewhere(event):
                    self._hand_to_websockets(event)
                    return
                self._arm_receiving()
                if not self._start_request(event):
                    return
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > self._services.config.server.max_frame_bytes:
                    self._too_large()
                    return
            elif isinstance(event, h11.EndOfMessage):
                self._receiving.cancel()
                request, body = self.out.request, bytes(self._body)
                assert request is not None
                self._body = bytearray()
                self._handler = asyncio.create_task(self._handle(request, body))
            elif isinstance(event, h11.ConnectionClosed):
                self._client_gone()
                return
        if self._handler is not None and len(self._h11.trailing_data[0]) > MAX_PIPELINED:
            self.log.info("sent too much ahead of its answer; closing")
            self.out.close()

    def _hand_to_websockets(self, request: h11.Request) -> None:
        """A WebSocket upgrade on this kept-alive connection: websockets gets
        the connection, the request and whatever followed it, as the front
        gives it a first request — the handshake's checks and the connection
        limits are its. This handler's part ends here, as if it had closed."""
        assert self._to_websockets is not None
        data = _head_bytes(request) + self._h11.trailing_data[0]
        self.out.lose()
        self._release()
        self.log.info("WebSocket upgrade of %s: handed to websockets", clip(path_of(request)))
        self._to_websockets(data)

    def _start_request(self, request: h11.Request) -> bool:
        """A request's head (the largest body: a WebSocket frame's, ``server.max_frame_bytes``)."""
        self.out.request = request
        limit = self._services.config.server.max_frame_bytes
        for name, value in request.headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                self._too_large()
                return False
        if self._h11.they_are_waiting_for_100_continue:
            self.out.send_continue()
        return True

    def _too_large(self) -> None:
        limit = self._services.config.server.max_frame_bytes
        message = f"the request body exceeds {limit} bytes"
        error = ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message, "too_large")
        request = self.out.request
        path = path_of(request) if request is not None else None
        self.out.simple(*self._http_api.router.routes.error_answer(path, error))
        self.out.close()

    def _refuse_bad_http(self, exc: h11.RemoteProtocolError) -> None:
        status = exc.error_status_hint
        with contextlib.suppress(h11.LocalProtocolError):
            self.out.simple(status, error_body(status, f"bad HTTP request: {exc}", "bad_request"))
        self.out.close()

    # ------------------------------------------------------------ one request

    async def _handle(self, request: h11.Request, body: bytes) -> None:
        try:
            await self._http_api.router.handle(request, body, self)
        finally:
            self.running = None
        try:
            # The next request is read only once this response has drained:
            # a client that pipelines and never reads cannot pile responses
            # up (the watchdog aborts it after send_timeout_s of no progress).
            if not self.out.lost and not self.out.writable:
                self.draining.set()
                await self.out.drain()
        finally:
            self.draining.clear()
            self._handler = None
        self._next_cycle()

    def begin(self, running: Running) -> None:
        """The router's route runs this request now."""
        self.running = running

    def generation_gone(self, generation: Generation) -> None:
        if self.out.lost and not self.generations:
            self._http_api.live.pop(self.conn_id, None)

    def _stall(self) -> None:
        if self.running is not None:
            self.running.stall()

    def _next_cycle(self) -> None:
        if self.out.lost:
            return
        h = self._h11
        if self._closing:
            self.out.close()
        elif h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()
            self.out.request = None
            idle = self._services.config.server.idle_timeout_s
            if idle > 0:
                # Between requests a keep-alive connection may wait this long
                # (as an idle WebSocket may); then it is closed.
                self._idle.arm(idle, self._idle_close)
            self._next_events()
        elif h.our_state in (h11.MUST_CLOSE, h11.DONE, h11.CLOSED, h11.ERROR):
            self.out.close()

    def _idle_close(self) -> None:
        if self._handler is None:
            self.log.info("idle; closing")
            self.out.close()

    def _arm_receiving(self) -> None:
        if not self._receiving.armed:
            timeout = self._services.config.server.request_timeout_s
            self._receiving.arm(timeout, self._receive_timed_out)

    def _receive_timed_out(self) -> None:
        if self._handler is not None or self.out.lost:
            return
        timeout = self._services.config.server.request_timeout_s
        self.log.info("request not received within %.1fs; closing", timeout)
        if self._h11.our_state is h11.SEND_RESPONSE:
            message = f"the request was not received within {timeout:g} s"
            self.out.simple(HTTPStatus.REQUEST_TIMEOUT, error_body(408, message, "timeout"))
        self.out.close()

    # ------------------------------------------------------------ the server's calls

    def shutdown(self) -> None:
        """Server shutdown: cancel the running request (its client is told), close."""
        self._closing = True
        if self.running is not None:
            self.running.cancel()
        else:
            self.out.close()

    def abort(self) -> None:
        """Drop the connection now (the end of a shutdown's farewell)."""
        if not self.closed.is_set():
            self.out.abort()

    def buffered_bytes(self) -> int:
        """Bytes held for the client: channels + write buffer (/metrics, tests)."""
        held = sum(g.channel.buffered_bytes() for g in list(self.generations.values()))
        return held + write_buffered(self._transport)


def _upgrade_elsewhere(request: h11.Request) -> bool:
    """A WebSocket upgrade that the front would give to websockets as a
    connection's first request: any target but the OpenAI API's."""
    upgrade = any(
        name == b"upgrade" and value.strip().lower() == b"websocket"
        for name, value in request.headers
    )
    return upgrade and not is_api_target(request.method + b" " + request.target)


def _head_bytes(request: h11.Request) -> bytes:
    """The request's head as it came (h11 keeps the headers' own spelling)."""
    lines = [b"%s %s HTTP/%s" % (request.method, request.target, request.http_version)]
    lines += [name + b": " + value for name, value in request.headers.raw_items()]
    return b"\r\n".join(lines) + b"\r\n\r\n"
