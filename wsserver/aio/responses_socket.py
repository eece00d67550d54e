"""The Responses API's WebSocket mode: a WebSocket upgrade on ``/v1/responses``.

A WebSocket connection whose handshake asked for ``/v1/responses`` (same
port, same Host/Origin/token checks as every upgrade; the token as
``Authorization: Bearer``, what the SDKs send) speaks this dialect on the one
:class:`~wsserver.aio.socket_connection.SocketConnection` — its receive loop,
frame rate, sender, drain, closing and memory count are the protocol's. What
the Responses event protocol says differently, as ``client.responses.connect()``
speaks it, is here:

* ``response.create`` — the body of ``POST /v1/responses`` (``stream`` is
  implicit) plus ``stream_id``: responses of one lane run one after another
  (FIFO), lanes run side by side (up to :data:`MAX_LANES`, each holding at
  most :data:`MAX_PENDING` waiting creates: :class:`~wsserver.core.lanes.Lanes`),
  sharing the engine through the scheduler like any other requests, the
  connection's requests counted together (connections take turns); every
  event of a lane's response carries its ``stream_id``;
* ``response.cancel`` with a ``response_id`` (an extension, under the
  Realtime API's name) — the response ends ``incomplete`` (``cancelled``) at
  once and its engine stops within one step, through the driver's cancel;
* out: the events of :mod:`wsserver.dialects.responses.render`, each a JSON text
  message; a refused event is an ``error`` event (``status``, ``error``),
  counted in the errors metric like every refusal, and the connection stays
  usable;
* the stall rule counts a connection's lanes together (:meth:`ResponsesDialect.stall`).

**A driver per lane.** A lane is this mode's equivalent of one connection of
our protocol: one request at a time, the next starting once the one before
has ended. So each lane runs on a :class:`~wsserver.aio.driver.RequestDriver`
of its own, with its own :class:`~wsserver.core.session.Session`, for all its
responses; a lane that has run its last response gives its driver back for
the next lane to open (at most :data:`MAX_LANES` drivers a connection). The
session's rule carries over: a lane's next response starts once the engine of
the one before is gone.

``previous_response_id`` continues a response of this connection: each
finished response's conversation is kept in a
:class:`~wsserver.dialects.responses.store.ResponseStore` of its own, bounded by
``limits.responses_memory_bytes`` and gone with the connection. A closed
socket cancels its running responses.
"""

from __future__ import annotations

import asyncio
import contextlib
from http import HTTPStatus
from typing import Any, Final

import orjson

from ..core.lanes import LaneLimit, Lanes
from ..core.protocol import ServerFrame
from ..core.session import Session
from ..dialects.api_errors import ApiError, error_object
from ..dialects.responses.api import ResponsesRequest, parse_body, parse_json, to_generate
from ..dialects.responses.render import ResponseRender
from ..dialects.responses.store import ResponseStore, StoredResponse
from ..errors import ProtocolError, WireLost
from .driver import RequestDriver
from .exchange import resolve
from .responses_http import new_response_id, not_found
from .responses_run import ResponseEvents
from .socket_connection import SocketContext

__all__ = ["MAX_LANES", "MAX_PENDING", "PATH", "ResponsesDialect"]

PATH: Final = "/v1/responses"
#: Lanes (``stream_id`` values) one connection may have at once.
MAX_LANES: Final = 8
#: ``response.create`` events one lane may hold while its current response runs.
MAX_PENDING: Final = 16


class SocketResponse(ResponseEvents):
    """One response, its events sent as WebSocket messages."""

    def __init__(self, *args: Any, dialect: ResponsesDialect, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dialect = dialect
        self._send = dialect.sender.send

    async def waiting(self) -> None:
        # The client learns the response's id now, and can cancel it while it waits.
        await self.emit(self.render.begin(), last=False)

    async def emit(self, events: list[dict[str, Any]], *, last: bool) -> None:
        send = self._send
        for event in events:
            await send(orjson.dumps(event))

    async def refused(self, status: int, code: str, message: str) -> None:
        await self._dialect.send_error(status, code, message, None, self.render.request.stream_id)


class _Lane:
    """A lane's driver and the response it runs now (the driver's dialect)."""

    __slots__ = ("driver", "response")

    def __init__(self, socket: SocketContext) -> None:
        self.response: SocketResponse | None = None
        # Nothing to restart here: the session keeps no input beyond the newest.
        self.driver = socket.new_driver(self, Session(restart_bytes=0))

    async def write(self, frame: ServerFrame) -> None:
        response = self.response
        if response is not None:
            await response.write(frame)


class ResponsesDialect:
    """The Responses WebSocket mode on one connection (a
    :class:`~wsserver.aio.socket_connection.SocketDialect`)."""

    label = " (Responses WebSocket mode)"

    def __init__(self, socket: SocketContext) -> None:
        self._socket = socket
        self._services = socket.services
        self._log = socket.log
        #: The connection's sender: each event one JSON text message.
        self.sender = socket.sender
        self._loop = asyncio.get_running_loop()
        #: This connection's responses, for previous_response_id.
        self.store = ResponseStore(max_bytes=self._services.config.limits.responses_memory_bytes)
        #: Responses running (or waiting for the model), by id.
        self.runs: dict[str, SocketResponse] = {}
        self._lanes: Lanes[ResponsesRequest] = Lanes(max_lanes=MAX_LANES, max_pending=MAX_PENDING)
        self._tasks: dict[str | None, asyncio.Task[None]] = {}
        #: Every lane driver made here; ``_idle`` those no lane runs on now.
        self._made: list[_Lane] = []
        self._idle: list[_Lane] = []
        self._closed = False

    def drivers(self) -> tuple[RequestDriver, ...]:
        return tuple(lane.driver for lane in self._made)

    async def greet(self) -> None:
        return None  # the client speaks first

    # ------------------------------------------------------------ receiving

    async def receive(self, message: str | bytes) -> None:
        # Whatever a frame holds, it is refused with an error event and the
        # connection stays: its other lanes' responses go on.
        event: dict[str, Any] | None = None
        try:
            event = parse_json(message)
            kind = event.get("type")
            if kind == "response.create":
                self._enqueue(parse_body(event, websocket=True))
            elif kind == "response.cancel":
                self._cancel(event)
            else:
                raise ApiError(
                    HTTPStatus.BAD_REQUEST,
                    f"unknown event type {str(kind)[:60]!r}"
                    " (response.create and response.cancel are served)",
                    "unknown_event",
                    "type",
                )
        except ApiError as exc:
            stream_id = event.get("stream_id") if event is not None else None
            await self._refuse(exc, stream_id if isinstance(stream_id, str) else None)

    async def refuse(self, exc: ProtocolError, message: str | bytes | None = None) -> None:
        await self._refuse(ApiError.from_protocol(exc), None)

    def _enqueue(self, request: ResponsesRequest) -> None:
        key = request.stream_id
        try:
            start = self._lanes.add(key, request)
        except LaneLimit as limit:
            message = (
                f"at most {MAX_LANES} lanes (stream_id) at once per connection"
                if limit.which == "lanes"
                else f"at most {MAX_PENDING} response.create may wait in one lane"
            )
            raise ApiError(
                HTTPStatus.TOO_MANY_REQUESTS, message, "rate_limited", "stream_id"
            ) from None
        if start is not None:
            lane = self._idle.pop() if self._idle else self._new_lane()
            self._tasks[key] = asyncio.create_task(
                self._run_lane(key, lane, start), name=f"responses-{self._log.conn_id}-lane"
            )

    def _new_lane(self) -> _Lane:
        lane = _Lane(self._socket)
        self._made.append(lane)
        return lane

    def _cancel(self, event: dict[str, Any]) -> None:
        response_id = event.get("response_id")
        run = self.runs.get(response_id) if isinstance(response_id, str) else None
        if run is None:
            raise ApiError(
                HTTPStatus.NOT_FOUND,
                f"no running response {str(response_id)[:80]!r} on this connection",
                "response_not_found",
                "response_id",
            )
        self._log.request(run.id).info("response.cancel")
        for lane in self._made:
            if lane.response is run:
                lane.driver.cancel_soon()

    # ------------------------------------------------------------ the lanes

    async def _run_lane(
        self, key: str | None, lane: _Lane, request: ResponsesRequest | None
    ) -> None:
        """Run a lane's responses one after another, on the lane's driver."""
        try:
            while request is not None and not self._closed:
                try:
                    await self._respond(lane, request)
                except ApiError as exc:
                    await self._refuse(exc, key)
                request = self._lanes.done(key)
        except WireLost:
            pass
        finally:
            if request is not None:
                self._lanes.drop(key)  # ended early: the wire is lost, or closed
            del self._tasks[key]
            if not self._closed:
                self._idle.append(lane)

    async def _respond(self, lane: _Lane, request: ResponsesRequest) -> None:
        # Looked up now, not when the create arrived: FIFO within a lane lets a
        # client chain on the response just before it without waiting for it.
        history: tuple[Any, ...] = ()
        if request.previous_response_id is not None:
            entry = self.store.get(request.previous_response_id, self._loop.time())
            if entry is None:
                raise not_found(request.previous_response_id)
            history = entry.conversation
        response_id = new_response_id()
        services = self._services
        generate = to_generate(request, history, response_id, services.wire_limits)
        generate, model = resolve(services, generate, request.model)  # once, as over HTTP
        assert generate.model is not None  # the name it is served under
        render = ResponseRender(request, response_id=response_id, model=generate.model)
        response = SocketResponse(render, history=history, keep=self._keep, dialect=self)
        lane.response = self.runs[response_id] = response
        try:
            await lane.driver.receive(generate, model=model)
            await response.finished
        finally:
            lane.response = None
            del self.runs[response_id]

    def _keep(self, response: dict[str, Any], conversation: tuple[Any, ...]) -> None:
        self.store.put(StoredResponse.of(response, conversation, expires=None), 0.0)

    # ------------------------------------------------------------ refusing

    async def _refuse(self, exc: ApiError, stream_id: str | None) -> None:
        """An event refused here, before any driver saw it: counted in the
        errors metric and logged as every wire's refusals are, then sent."""
        self._services.metrics.errors.labels(exc.code).inc()
        self._log.info("refused: %s %s", exc.code, exc.message, extra={"code": exc.code})
        await self.send_error(int(exc.status), exc.code, exc.message, exc.param, stream_id)

    async def send_error(
        self, status: int, code: str, message: str, param: str | None, stream_id: str | None
    ) -> None:
        """An ``error`` event (a refusal already counted and logged)."""
        event: dict[str, Any] = {
            "type": "error",
            "status": status,
            "error": error_object(status, message, code, param),
        }
        if stream_id is not None:
            event["stream_id"] = stream_id
        with contextlib.suppress(WireLost):
            await self.sender.send(orjson.dumps(event))

    # ------------------------------------------------------------ the connection's hooks

    def upload_bytes(self) -> int:
        return 0  # the Responses API takes its images inside its JSON

    def busy(self) -> bool:
        return len(self._lanes) > 0

    def stall(self) -> None:
        """The client read nothing for the stall timeout. Its lanes count
        together: if a request of another connection waits for the model,
        every response of this one ends as stalled — running or still waiting
        for the model, blocked or not — or else each lane's next response
        would take the engine again, one after another, for a client that
        reads nothing (issue 34). Creates still waiting in a lane start only
        once the client takes the events before them."""
        mine = sum(
            1
            for generation in list(self._socket.generations.values())
            if generation.slot is None and not generation.stopped
        )
        if self._services.models.waiting <= mine:
            return  # only this connection's own responses wait: nobody is harmed
        for lane in self._made:
            if lane.response is not None:
                lane.driver.stall(every=True)

    async def close(self) -> None:
        """The socket is gone: the lanes stop (the connection then closes
        their drivers, which stop the engines) and the kept responses go."""
        self._closed = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.store.clear()
