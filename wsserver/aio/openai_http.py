"""The OpenAI HTTP API on the WebSocket port: one HTTP/1.1 connection.

:class:`HttpConnection` is the asyncio protocol a connection gets when its
first request line asks for ``/v1`` (:mod:`wsserver.aio.front`). HTTP/1.1
itself is h11's (sans-I/O, python-hyper): bytes in, events out; this class
only moves bytes, vets each request and routes it:

* ``OPTIONS /v1/…`` — a CORS preflight, answered for the allowed origins;
* ``GET /v1/models`` (and ``/v1/models/{id}``);
* ``POST /v1/chat/completions`` and ``POST /v1/completions`` — a
  :class:`~wsserver.aio.openai_stream.Completion`;
* other dialects' routes given in :attr:`HttpApi.routes` (the Responses
  API's ``/v1/responses``), through the seam of :mod:`wsserver.aio.http_route`.

Every request on a kept-alive connection is routed as the first request of a
connection is (:func:`~wsserver.aio.front.is_openai_target`): the plain
routes outside ``/v1`` are answered here (:attr:`HttpApi.plain`), and a
WebSocket upgrade that is no OpenAI target (``/``, ``GET /v1/responses``)
hands the connection to websockets, as the front would have: aiohttp, for
one, reuses a connection a ``GET /v1/models`` kept alive for its next
``ws_connect``.

Every request first passes :class:`~wsserver.aio.openai_gate.Gate` (the
WebSocket handshake's checks, CORS, a request rate). Each response carries
``X-Request-ID`` (the client's, if valid, else a generated one): the
request's ID in logs.

**Flow control.** The transport's write buffer has a high-water mark of
``server.write_limit`` (and the listening socket's small ``SO_SNDBUF``);
above it asyncio calls :meth:`HttpConnection.pause_writing` and
:meth:`HttpConnection.drain` waits: a completion's pump waits there, so a slow
reader pauses its own request. As over a WebSocket the wait is judged by the
client's progress: no progress for ``stream.stall_timeout_s`` while another
request waits for the model ends the request as ``stalled``; none for
``server.send_timeout_s`` aborts the connection.

**Disconnect is cancel.** EOF or a lost connection cancels the running
completion at once (the request ends as ``cancelled`` and its engine stops).
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
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Final

import h11

from ..api_errors import ApiError, error_body
from ..errors import ProtocolError, refusal_headers
from ..logs import ConnectionLog
from ..openai_api import models_body, parse_request
from .drain import DrainWatch, write_buffered
from .front import is_openai_target
from .http_route import ErrorBody, Exchange, Headers, Route, RouteRequest
from .openai_gate import Gate, RequestHeaders, request_id_of
from .openai_stream import Completion
from .pipeline import Generation
from .services import Services

__all__ = ["HttpApi", "HttpConnection"]

log = logging.getLogger("wsserver.openai")

#: Bytes a client may send ahead while its request runs.
MAX_PIPELINED: Final = 65536
#: The most of a client's input (a path, a model name) echoed in an answer or a log line.
MAX_ECHO: Final = 100
_COMPLETIONS: Final = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
#: Answered without the token and rate checks, as on a new connection (:mod:`.http`).
PROBES: Final = frozenset({"/healthz", "/readyz"})


#: A plain route's answer for a kept-alive connection (see :attr:`HttpApi.plain`).
PlainRoute = Callable[[str, Headers], tuple[int, Headers, bytes]]
#: Hands the connection to websockets with the bytes read so far (the request
#: first): what the front does with a first request that is no OpenAI target.
ToWebsockets = Callable[[bytes], None]


@dataclass(frozen=True, slots=True, eq=False)
class HttpApi:
    """What every HTTP connection uses; built once by the server."""

    services: Services
    gate: Gate
    #: The server's live HTTP connections, by connection ID.
    live: dict[str, HttpConnection] = field(default_factory=dict)
    #: Set whenever a connection is handed over to the API (tests wait on it; they clear it).
    opened: asyncio.Event = field(default_factory=asyncio.Event)
    next_id: Callable[[], str] = lambda: "h?"
    #: Other dialects' routes on this transport, by path prefix (``/v1/responses``):
    #: the prefix itself and everything under it (wsserver.aio.http_route).
    routes: dict[str, Route] = field(default_factory=dict)
    #: How the routes whose errors are not OpenAI's object write a refusal,
    #: by the same prefixes (Anthropic's Messages API).
    error_bodies: dict[str, ErrorBody] = field(default_factory=dict)
    #: The plain ``GET`` routes outside ``/v1`` (probes, ``/metrics``, the
    #: page), for a connection kept alive here that asks for one next:
    #: ``(path with query, headers) → (status, headers, body)``.
    plain: PlainRoute | None = None


class HttpConnection(asyncio.Protocol):
    """One HTTP/1.1 connection that asked for the OpenAI API."""

    def __init__(self, http_api: HttpApi, *, to_websockets: ToWebsockets | None = None) -> None:
        self._http_api = http_api
        self._to_websockets = to_websockets
        self._services = http_api.services
        self.conn_id = http_api.next_id()
        self.log = ConnectionLog(log, self.conn_id)
        self._h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=16384)
        self._transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._peer = "?"
        self._request: h11.Request | None = None
        self._body = bytearray()
        self._handler: asyncio.Task[None] | None = None
        self.completion: Exchange | None = None
        #: Generations started here whose engine is not gone yet (/readyz, /metrics, shutdown).
        self.generations: dict[str, Generation] = {}
        self._admitted = False
        self._closing = False
        self._lost = False
        #: Set while the write buffer is above its high-water mark (tests, as PeerAwareConnection).
        self.writing_paused = asyncio.Event()
        #: Set while a write need not wait: below the mark, or the client is gone.
        self._writable = asyncio.Event()
        self._writable.set()
        #: The largest the write buffer has been after a write (tests, diagnostics).
        self.peak_write_buffer = 0
        self._watch: DrainWatch | None = None
        self._idle: asyncio.TimerHandle | None = None
        #: Runs from a request's first byte until its body is complete.
        self._receiving: asyncio.TimerHandle | None = None
        #: Aborts a closing transport whose output the client does not take.
        self._close_deadline: asyncio.TimerHandle | None = None
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
        self._peer = str(peer[0]) if peer else "?"
        self._watch = DrainWatch(
            transport,
            send_timeout=config.server.send_timeout_s,
            stall_timeout=config.stream.stall_timeout_s or None,
            on_stall=self._stall,
            log=self.log,
            request_id=lambda: None,
        )
        self._http_api.live[self.conn_id] = self
        self._http_api.opened.set()
        self.log.info("open from %s (HTTP)", self._peer)
        # Counted from now, not from a complete request: a client that
        # trickles its head or body holds a connection all the same.
        refusal = self._http_api.gate.admit(self, self._peer, lambda: not self._lost)
        if refusal is not None:
            self._refuse_at_once(refusal)
            return
        self._admitted = True
        # The request line has arrived (the front read it): the rest must follow.
        self._arm_receiving()

    def data_received(self, data: bytes) -> None:
        if self._lost or not self._admitted:
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

    def _release(self) -> None:
        """The connection is no longer this handler's (lost, or handed over)."""
        self._disarm_idle()
        self._disarm_receiving()
        if self._close_deadline is not None:
            self._close_deadline.cancel()
            self._close_deadline = None
        if not self.generations:
            # Else when the last engine is gone: until then its slot is this
            # connection's (the server's orphan check, /readyz), as a
            # WebSocket connection stays listed until its requests are gone.
            self._http_api.live.pop(self.conn_id, None)
        self._http_api.gate.connection_limiter.release(self)
        if self._watch is not None:
            self._watch.detach()
        self.closed.set()

    def pause_writing(self) -> None:
        self._writable.clear()
        self.writing_paused.set()

    def resume_writing(self) -> None:
        self._writable.set()
        self.writing_paused.clear()

    def _client_gone(self) -> None:
        if self._lost:
            return
        self._lost = True
        self._writable.set()
        if self.completion is not None:
            self.completion.client_gone()

    # ------------------------------------------------------------ reading requests

    def _next_events(self) -> None:
        while self._handler is None and not self._lost:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._refuse_bad_http(exc)
                return
            if event is h11.NEED_DATA:
                if self._h11.their_state is not h11.IDLE or self._h11.trailing_data[0]:
                    self._disarm_idle()
                    self._arm_receiving()  # a request has begun: it must complete in time
                return
            if event is h11.PAUSED:
                break
            if isinstance(event, h11.Request):
                self._disarm_idle()
                if self._to_websockets is not None and _upgrade_elsewhere(event):
                    self._hand_to_websockets(event)
                    return
                self._arm_receiving()
                if not self._start_request(event):
                    return
            elif isinstance(event, h11.Data):
                self._body += event.data
                if len(self._body) > self._max_body:
                    self._too_large()
                    return
            elif isinstance(event, h11.EndOfMessage):
                self._disarm_receiving()
                request, body = self._request, bytes(self._body)
                assert request is not None
                self._body = bytearray()
                self._handler = asyncio.create_task(self._handle(request, body))
            elif isinstance(event, h11.ConnectionClosed):
                self._client_gone()
                return
        if self._handler is not None and len(self._h11.trailing_data[0]) > MAX_PIPELINED:
            self.log.info("sent too much ahead of its answer; closing")
            self._close()

    def _hand_to_websockets(self, request: h11.Request) -> None:
        """A WebSocket upgrade on this kept-alive connection: websockets gets
        the connection, the request and whatever followed it, as the front
        gives it a first request — the handshake's checks and the connection
        limits are its. This handler's part ends here, as if it had closed."""
        assert self._to_websockets is not None
        data = _head_bytes(request) + self._h11.trailing_data[0]
        self._lost = True
        self._release()
        self.log.info("WebSocket upgrade of %s: handed to websockets", _clip(_path_of(request)))
        self._to_websockets(data)

    @property
    def _max_body(self) -> int:
        """The largest request body: a WebSocket frame's limit (``server.max_frame_bytes``)."""
        return self._services.config.server.max_frame_bytes

    def _start_request(self, request: h11.Request) -> bool:
        self._request = request
        limit = self._max_body
        for name, value in request.headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                self._too_large()
                return False
        if self._h11.they_are_waiting_for_100_continue:
            self._write(h11.InformationalResponse(status_code=100, headers=[]))
        return True

    def _too_large(self) -> None:
        limit = self._max_body
        message = f"the request body exceeds {limit} bytes"
        error = ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message, "too_large")
        self._simple(*self._error_answer(self._request, error))
        self._close()

    def _error_answer(self, request: h11.Request | None, error: ApiError) -> tuple[int, bytes]:
        """A refusal's status and body, in the shape of the route asked for."""
        if request is not None:
            path = _path_of(request)
            for prefix, error_body_of in self._http_api.error_bodies.items():
                if path == prefix or path.startswith(prefix + "/"):
                    return error_body_of(error)
        return error.status, error.body()

    def _refuse_at_once(self, refusal: ApiError) -> None:
        """Over a connection limit: answer before reading the request, and close."""
        assert self._transport is not None
        self.log.info("refused: %d %s", refusal.status, refusal.message)
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
        self._close()

    def _refuse_bad_http(self, exc: h11.RemoteProtocolError) -> None:
        status = exc.error_status_hint
        with contextlib.suppress(h11.LocalProtocolError):
            self._simple(status, error_body(status, f"bad HTTP request: {exc}", "bad_request"))
        self._close()

    # ------------------------------------------------------------ one request

    async def _handle(self, request: h11.Request, body: bytes) -> None:
        headers = RequestHeaders(request.headers)
        request_id = request_id_of(headers)
        extra: Headers = [("X-Request-ID", request_id)]
        try:
            await self._route(request, body, headers, request_id, extra)
        except ApiError as exc:
            self.log.request(request_id).info(
                "refused: %d %s", exc.status, exc.message, extra={"code": exc.code}
            )
            if exc.code in _METRIC_CODES:  # refusals by the gate are counted as such
                self._services.metrics.errors.labels(exc.code).inc()
            status, answer = self._error_answer(request, exc)
            extra.extend(refusal_headers(status))
            self._simple(status, answer, extra)
        except Exception:
            self.log.exception("HTTP request failed")
            if not self._lost and self._h11.our_state is h11.SEND_RESPONSE:
                failed = ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", "internal")
                self._simple(*self._error_answer(request, failed), extra)
        finally:
            self.completion = None
        try:
            # The next request is read only once this response has drained:
            # a client that pipelines and never reads cannot pile responses
            # up (the watchdog aborts it after send_timeout_s of no progress).
            if not self._lost and not self._writable.is_set():
                self.draining.set()
                await self.drain()
        finally:
            self.draining.clear()
            self._handler = None
        self._next_cycle()

    async def _route(
        self,
        request: h11.Request,
        body: bytes,
        headers: RequestHeaders,
        request_id: str,
        extra: Headers,
    ) -> None:
        method = request.method.decode("ascii", "replace")
        path = _path_of(request)
        gate = self._http_api.gate
        gate.check_browser(headers, extra)
        if path in PROBES and method in ("GET", "HEAD") and self._http_api.plain is not None:
            # The probes need no token on a kept-alive connection either (aio/http.py).
            self._plain(request, method, extra)
            return
        if method == "OPTIONS":
            gate.preflight(headers, extra)
            self._simple(HTTPStatus.NO_CONTENT, b"", extra)
            return
        gate.check_client(headers, peer=self._peer, now=self._loop.time())
        if self._http_api.plain is not None and not is_openai_target(
            request.method + b" " + request.target
        ):
            # A keep-alive connection that asked /v1 before stays here: what
            # websockets answers on a new connection is answered here too.
            if method not in ("GET", "HEAD"):
                raise _not_allowed(method, "GET, HEAD")
            self._plain(request, method, extra)
            return
        route = self._route_of(path)
        if route is not None:
            if self._lost:
                return
            await route(
                RouteRequest(
                    method=method,
                    path=path,
                    body=body,
                    request_id=request_id,
                    out=self,
                    headers=extra,
                    log=self.log,
                    generations=self.generations,
                    on_gone=self._generation_gone,
                    begin=self._begin,
                )
            )
            return
        models = self._services.models
        kind = _COMPLETIONS.get(path)
        if kind is not None:
            if method != "POST":
                raise _not_allowed(method, "POST")
            if self._lost:
                return  # gone before its request could start: nothing to run for it
            api = parse_request(
                "chat" if kind == "chat" else "completion",
                body,
                request_id,
                self._services.wire_limits,
            )
            try:
                generate, _ = models.for_api(api.generate, api.model)
            except ProtocolError as exc:
                raise ApiError.from_protocol(exc) from None
            api = dataclasses.replace(api, generate=generate)
            completion = Completion(
                api,
                services=self._services,
                out=self,
                headers=extra,
                log=self.log,
                generations=self.generations,
                on_gone=self._generation_gone,
            )
            self.completion = completion
            await completion.run()
        elif path == "/v1/models" or (
            path.startswith("/v1/models/")
            and (path[11:] in models.models or path[11:] in models.aliases)
        ):
            if method not in ("GET", "HEAD"):
                raise _not_allowed(method, "GET")
            if path == "/v1/models":
                body = models_body(models.infos())
            else:
                body = models_body([models.resolve(path[11:]).info()], single=True)
            self._simple(HTTPStatus.OK, body, extra)
        elif path.startswith("/v1/models/"):
            name = _clip(path[11:])
            raise ApiError(
                HTTPStatus.NOT_FOUND, f"the model {name!r} does not exist", "model_not_found"
            )
        else:
            raise ApiError(
                HTTPStatus.NOT_FOUND, f"no route {_clip(method)} {_clip(path)}", "not_found"
            )

    def _plain(self, request: h11.Request, method: str, extra: Headers) -> None:
        """A plain route's answer (the probes, /metrics, the page) on this connection."""
        assert self._http_api.plain is not None
        target = request.target.decode("ascii", "replace")
        given = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers]
        status, answer_headers, answer = self._http_api.plain(target, given)
        self._simple(status, answer, [*answer_headers, *extra], content_type=None)

    def _route_of(self, path: str) -> Route | None:
        for prefix, route in self._http_api.routes.items():
            if path == prefix or path.startswith(prefix + "/"):
                return route
        return None

    def _begin(self, exchange: Exchange) -> None:
        self.completion = exchange

    def _generation_gone(self, generation: Generation) -> None:
        if self._lost and not self.generations:
            self._http_api.live.pop(self.conn_id, None)

    # ------------------------------------------------------------ the Responder

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def paused(self) -> bool:
        return self.writing_paused.is_set()

    def start(self, status: int, headers: Headers) -> None:
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

    def _stall(self) -> None:
        completion = self.completion
        if completion is not None:
            completion.driver.stall()

    # ------------------------------------------------------------ helpers

    def _simple(
        self,
        status: int,
        body: bytes,
        headers: Headers | None = None,
        *,
        content_type: str | None = "application/json",
    ) -> None:
        """A whole response (only while one may start); ``content_type`` None:
        the headers carry their own."""
        if self._lost or self._h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        all_headers = [("Content-Length", str(len(body))), *(headers or [])]
        if body and content_type is not None:
            all_headers.insert(0, ("Content-Type", content_type))
        self.start(status, all_headers)
        request = self._request
        if request is None or request.method != b"HEAD":
            self.send(body)  # a HEAD gets the headers of the answer only
        self.end()

    def _write(self, event: h11.Event) -> None:
        if self._lost or self._transport is None:
            return
        try:
            data = self._h11.send(event)
        except h11.LocalProtocolError:
            self.log.exception("HTTP framing error; closing")
            self._close()
            return
        if data:
            self._transport.write(data)
            size = self._transport.get_write_buffer_size()
            if size > self.peak_write_buffer:
                self.peak_write_buffer = size

    def _next_cycle(self) -> None:
        if self._lost:
            return
        h = self._h11
        if self._closing:
            self._close()
        elif h.our_state is h11.DONE and h.their_state is h11.DONE:
            h.start_next_cycle()
            self._request = None
            self._arm_idle()
            self._next_events()
        elif h.our_state in (h11.MUST_CLOSE, h11.DONE, h11.CLOSED, h11.ERROR):
            self._close()

    def _arm_idle(self) -> None:
        """Between requests a keep-alive connection may wait ``server.idle_timeout_s``
        (as an idle WebSocket may); then it is closed."""
        self._disarm_idle()
        idle = self._services.config.server.idle_timeout_s
        if idle > 0:
            self._idle = self._loop.call_later(idle, self._idle_close)

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_close(self) -> None:
        self._idle = None
        if self._handler is None:
            self.log.info("idle; closing")
            self._close()

    def _arm_receiving(self) -> None:
        if self._receiving is None:
            timeout = self._services.config.server.request_timeout_s
            self._receiving = self._loop.call_later(timeout, self._receive_timed_out)

    def _disarm_receiving(self) -> None:
        if self._receiving is not None:
            self._receiving.cancel()
            self._receiving = None

    def _receive_timed_out(self) -> None:
        self._receiving = None
        if self._handler is not None or self._lost:
            return
        timeout = self._services.config.server.request_timeout_s
        self.log.info("request not received within %.1fs; closing", timeout)
        if self._h11.our_state is h11.SEND_RESPONSE:
            message = f"the request was not received within {timeout:g} s"
            self._simple(HTTPStatus.REQUEST_TIMEOUT, error_body(408, message, "timeout"))
        self._close()

    def _close(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        transport.close()
        if transport.get_write_buffer_size() and self._close_deadline is None:
            # close() waits for the client to take what is still buffered; a
            # client that never reads would hold the socket (and its place in
            # the connection limits) for good.
            timeout = self._services.config.server.send_timeout_s
            self._close_deadline = self._loop.call_later(timeout, transport.abort)

    def shutdown(self) -> None:
        """Server shutdown: cancel the running request (its client is told), close."""
        self._closing = True
        if self.completion is not None:
            self.completion.cancel()
        else:
            self._close()

    def abort(self) -> None:
        """Drop the connection now (the end of a shutdown's farewell)."""
        if self._transport is not None and not self.closed.is_set():
            self._transport.abort()

    def buffered_bytes(self) -> int:
        """Bytes held for the client: channels + write buffer (/metrics, tests)."""
        held = sum(g.channel.buffered_bytes() for g in list(self.generations.values()))
        return held + write_buffered(self._transport)


_METRIC_CODES: Final = frozenset(
    {"bad_json", "bad_request", "too_large", "rate_limited", "overloaded", "internal"}
)


#: Statuses outside the HTTP standard that a dialect answers with.
_PHRASES: Final = {529: b"Overloaded"}


def _upgrade_elsewhere(request: h11.Request) -> bool:
    """A WebSocket upgrade that the front would give to websockets as a
    connection's first request: any target but the OpenAI API's."""
    upgrade = any(
        name == b"upgrade" and value.strip().lower() == b"websocket"
        for name, value in request.headers
    )
    return upgrade and not is_openai_target(request.method + b" " + request.target)


def _head_bytes(request: h11.Request) -> bytes:
    """The request's head as it came (h11 keeps the headers' own spelling)."""
    lines = [b"%s %s HTTP/%s" % (request.method, request.target, request.http_version)]
    lines += [name + b": " + value for name, value in request.headers.raw_items()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _path_of(request: h11.Request) -> str:
    """The request's path without its query."""
    return request.target.decode("ascii", "replace").split("?", 1)[0]


def _clip(text: str) -> str:
    """A client's input as it may be echoed: at most :data:`MAX_ECHO` characters."""
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "…"


def _not_allowed(method: str, allowed: str) -> ApiError:
    return ApiError(
        HTTPStatus.METHOD_NOT_ALLOWED,
        f"{_clip(method)} is not allowed here; use {allowed}",
        "bad_request",
    )


def _encode(headers: Headers) -> list[tuple[bytes, bytes]]:
    return [(name.encode("ascii"), value.encode("latin-1")) for name, value in headers]
