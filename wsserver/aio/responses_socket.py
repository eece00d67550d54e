"""The Responses API's WebSocket mode: a WebSocket upgrade on ``/v1/responses``.

The server hands a websockets connection whose handshake asked for
``/v1/responses`` (same port, same Host/Origin/token checks as every upgrade;
the token as ``Authorization: Bearer``, what the SDKs send) to a
:class:`ResponsesSocket` instead of the WebSocket protocol's connection. It
speaks the Responses event protocol, as ``client.responses.connect()`` does:

* ``response.create`` — the body of ``POST /v1/responses`` (``stream`` is
  implicit) plus ``stream_id``: responses of one lane run one after another
  (FIFO), lanes run side by side (up to :data:`MAX_LANES`, each holding at
  most :data:`MAX_PENDING` waiting creates), sharing the engine through the
  scheduler like any other requests; every event of a lane's response carries
  its ``stream_id``;
* ``response.cancel`` with a ``response_id`` (an extension, under the
  Realtime API's name) — the response ends ``incomplete`` (``cancelled``) at
  once and its engine stops within one step, through the driver's cancel;
* out: the events of :mod:`wsserver.responses_render`, each a JSON text
  message; a refused event is an ``error`` event (``status``, ``error``) and
  the connection stays usable.

``previous_response_id`` continues a response of this connection: each
finished response's conversation is kept in a
:class:`~wsserver.responses_store.ResponseStore` of its own, bounded by
``limits.responses_memory_bytes`` and gone with the connection. A closed
socket cancels its running responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from http import HTTPStatus
from typing import Any, Final

import orjson
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..api_errors import ApiError, error_object
from ..errors import ProtocolError, WireLost
from ..logs import ConnectionLog
from ..responses_api import ResponsesRequest, parse_body, parse_json, to_generate
from ..responses_render import ResponseRender
from ..responses_store import ResponseStore, StoredResponse
from ..security import FrameLimiter
from .drain import DrainWatch, write_buffered
from .pipeline import Generation
from .responses_http import new_response_id, not_found
from .responses_run import ResponseRun
from .services import Services

__all__ = ["MAX_LANES", "MAX_PENDING", "PATH", "ResponsesSocket"]

log = logging.getLogger("wsserver.responses")

PATH: Final = "/v1/responses"
#: Lanes (``stream_id`` values) one connection may have at once.
MAX_LANES: Final = 8
#: ``response.create`` events one lane may hold while its current response runs.
MAX_PENDING: Final = 16


class SocketResponse(ResponseRun):
    """One response, its events sent as WebSocket messages."""

    def __init__(self, *args: Any, socket: ResponsesSocket, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._socket = socket

    async def waiting(self) -> None:
        # The client learns the response's id now, and can cancel it while it waits.
        await self.emit(self.render.begin(), last=False)

    async def emit(self, events: list[dict[str, Any]], *, last: bool) -> None:
        for event in events:
            await self._socket.send(event)

    async def refused(self, status: int, code: str, message: str) -> None:
        await self._socket.send_error(status, code, message, None, self.render.request.stream_id)


class ResponsesSocket:
    """Serves one WebSocket-mode client. Create per handshake and ``await run()``."""

    def __init__(self, services: Services, websocket: ServerConnection, conn_id: str) -> None:
        self.ws = websocket
        self.conn_id = conn_id
        self.log = ConnectionLog(log, conn_id)
        self._services = services
        config = services.config
        self._loop = asyncio.get_running_loop()
        #: This connection's responses, for previous_response_id.
        self.store = ResponseStore(max_bytes=config.limits.responses_memory_bytes)
        #: Generations started here whose engine is not gone yet.
        self.generations: dict[str, Generation] = {}
        #: Responses running (or waiting for the model), by id.
        self.runs: dict[str, SocketResponse] = {}
        self._lanes: dict[str | None, deque[ResponsesRequest]] = {}
        self._workers: dict[str | None, asyncio.Task[None]] = {}
        self._closed = False
        self._watch = DrainWatch(
            websocket.transport,
            send_timeout=config.server.send_timeout_s,
            stall_timeout=config.stream.stall_timeout_s or None,
            on_stall=self._stall,
            log=self.log,
            request_id=lambda: next(iter(self.runs), None),
        )
        limits = config.limits
        self._frame_limiter = FrameLimiter(
            rate=limits.frames_per_s,
            burst=limits.frames_burst,
            close_after=limits.flood_close_after,
            now=self._loop.time(),
        )

    # ------------------------------------------------------------ receiving

    async def run(self) -> None:
        try:
            async for message in self.ws:
                await self._receive(message)
        except (ConnectionClosed, WireLost):
            pass
        finally:
            await self.close()

    async def _receive(self, message: str | bytes) -> None:
        verdict = self._frame_limiter.check(self._loop.time())
        if verdict == "flood":
            self.log.warning("kept sending over the frame rate limit; closing")
            self.ws.transport.abort()
            return
        if verdict != "ok":
            limited = ApiError(
                HTTPStatus.TOO_MANY_REQUESTS, "too many events; slow down", "rate_limited"
            )
            await self.refuse(limited, None)
            return
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
            await self.refuse(exc, stream_id if isinstance(stream_id, str) else None)

    def _enqueue(self, request: ResponsesRequest) -> None:
        lane = request.stream_id
        queue = self._lanes.get(lane)
        if queue is None:
            if len(self._lanes) >= MAX_LANES:
                raise ApiError(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    f"at most {MAX_LANES} lanes (stream_id) at once per connection",
                    "rate_limited",
                    "stream_id",
                )
            queue = self._lanes[lane] = deque()
        if len(queue) >= MAX_PENDING:
            raise ApiError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"at most {MAX_PENDING} response.create may wait in one lane",
                "rate_limited",
                "stream_id",
            )
        queue.append(request)
        if lane not in self._workers:
            self._workers[lane] = asyncio.create_task(
                self._lane(lane), name=f"responses-{self.conn_id}-lane"
            )

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
        run.log.info("response.cancel")
        run.cancel()

    # ------------------------------------------------------------ the lanes

    async def _lane(self, lane: str | None) -> None:
        queue = self._lanes[lane]
        try:
            while queue and not self._closed:
                request = queue.popleft()
                try:
                    await self._respond(request)
                except ApiError as exc:
                    await self.refuse(exc, request.stream_id)
        except WireLost:
            pass
        finally:
            if self._lanes.get(lane) is queue and not queue:
                del self._lanes[lane]
            self._workers.pop(lane, None)

    async def _respond(self, request: ResponsesRequest) -> None:
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
        try:
            generate, model = services.models.for_api(generate, request.model)
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc) from None
        render = ResponseRender(request, response_id=response_id, model=model.name)
        run = SocketResponse(
            generate,
            render,
            services=services,
            log=self.log,
            generations=self.generations,
            history=history,
            keep=self._keep,
            socket=self,
        )
        self.runs[response_id] = run
        try:
            await run.start()
            await run.finished
        finally:
            self.runs.pop(response_id, None)

    def _keep(self, response: dict[str, Any], conversation: tuple[Any, ...]) -> None:
        self.store.put(StoredResponse.of(response, conversation, expires=None), 0.0)

    # ------------------------------------------------------------ sending

    async def send(self, event: dict[str, Any]) -> None:
        """One event; waits while the client reads slowly (judged by the drain
        watch). Raises :class:`~wsserver.errors.WireLost` if the client is gone
        (websockets' ``ConnectionClosed`` stops here, as in ``sender.py``)."""
        data = orjson.dumps(event)
        interval = self._watch.interval
        try:
            async with asyncio.timeout(interval):
                await self.ws.send(data, text=True)
            return
        except TimeoutError:
            pass  # written; only the wait for the drain was cut short
        except ConnectionClosed:
            raise WireLost("the connection is closed") from None
        if not await self._watch.wait(self.ws.drain, waited=interval):
            raise WireLost("the connection is gone")

    async def refuse(self, exc: ApiError, stream_id: str | None) -> None:
        """An event refused here, before any driver saw it: counted in the
        errors metric and logged as every wire's refusals are, then sent."""
        self._services.metrics.errors.labels(exc.code).inc()
        self.log.info("refused: %s %s", exc.code, exc.message, extra={"code": exc.code})
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
            await self.send(event)

    def _stall(self) -> None:
        """The client read nothing for the stall timeout. Its lanes count
        together: if a request of another connection waits for the model,
        every response of this one ends as stalled — running or still waiting
        for the model, blocked or not — or else each lane's next response
        would take the engine again, one after another, for a client that
        reads nothing (issue 34). Creates still waiting in a lane start only
        once the client takes the events before them."""
        mine = sum(
            1
            for generation in list(self.generations.values())
            if generation.slot is None and not generation.stopped
        )
        if self._services.models.waiting <= mine:
            return  # only this connection's own responses wait: nobody is harmed
        for run in list(self.runs.values()):
            run.driver.stall(every=True)

    # ------------------------------------------------------------ closing

    async def close(self) -> None:
        """The socket is gone: cancel the running responses, wait for their engines."""
        self._closed = True
        for worker in list(self._workers.values()):
            worker.cancel()
        runs = list(self.runs.values())
        await asyncio.gather(*(run.driver.close() for run in runs), return_exceptions=True)
        await asyncio.gather(*self._workers.values(), return_exceptions=True)
        self.store.clear()
        self._watch.detach()

    async def shutdown(self, timeout: float | None = None) -> None:
        """Server shutdown: end the running responses as cancelled, then close 1001."""
        try:
            async with asyncio.timeout(timeout):
                for run in list(self.runs.values()):
                    await run.driver.cancel_active()
                await self.ws.close(1001, "server shutting down")
        except (TimeoutError, ConnectionClosed):
            self.ws.transport.abort()

    def buffered_bytes(self) -> int:
        """Bytes held for the client: channels + write buffer (/metrics)."""
        held = sum(g.channel.buffered_bytes() for g in list(self.generations.values()))
        return held + write_buffered(self.ws.transport)
