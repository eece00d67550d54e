"""The OpenAI dialect: one completion request, rendered as HTTP and SSE.

A :class:`Completion` runs the request exactly as a WebSocket ``generate``
runs — a :class:`~wsserver.aio.driver.RequestDriver` with a
:class:`~wsserver.session.Session` of its own takes it through the scheduler's
FIFO, the engine, the bounded channel, the pacing and the cancel bookkeeping —
and only renders the frames the driver gives back (:meth:`Completion.write`):

* ``queued`` → the response's headers and a ``: keep-alive`` comment (also
  every :data:`KEEPALIVE_S` while nothing else is sent);
* ``started`` → the headers, so that a client's ``create(stream=True)``
  returns while the prompt is processed and it can abandon it;
* ``delta`` → one SSE chunk, written, then the write waits while the
  transport is above its high-water mark: the pump stops, the channel fills,
  the engine pauses, as over a WebSocket (without ``stream``, the text is
  gathered: at most ``max_tokens`` tokens);
* ``done`` → the finish chunk, the usage chunk and ``[DONE]`` (or the whole
  JSON body); an ``error`` → OpenAI's error object, with its status while
  the headers are still unsent, as an in-band event after.

A disconnect is a ``cancel`` frame (:meth:`Completion.client_gone`): the
driver ends the request as cancelled and the generation stops its engine —
within one step, mid-prefill too, through the cancel event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Protocol

from ..errors import refusal_headers
from ..logs import ConnectionLog
from ..openai_api import KEEPALIVE, ApiRequest, Reply, error_body, error_event, status_of
from ..protocol import Delta, Done, Error, Queued, ServerFrame, Started
from ..session import Session
from .driver import RequestDriver
from .pipeline import Generation
from .services import Services

__all__ = ["KEEPALIVE_S", "Completion", "Responder"]

#: While a streamed request waits (for the model, or its prompt), a comment
#: this often keeps proxies and clients from timing it out.
KEEPALIVE_S = 10.0

Headers = list[tuple[str, str]]


class Responder(Protocol):
    """What a completion writes its response with (the HTTP connection)."""

    @property
    def lost(self) -> bool: ...

    @property
    def paused(self) -> bool: ...

    def start(self, status: int, headers: Headers) -> None: ...

    def send(self, data: bytes) -> None:
        """Write body bytes now (nothing is written once the client is gone)."""

    async def drain(self) -> None:
        """Wait while the transport is above its high-water mark."""

    def end(self) -> None: ...


class Completion:
    """One request of ``/v1/chat/completions`` or ``/v1/completions``."""

    def __init__(
        self,
        api: ApiRequest,
        *,
        services: Services,
        out: Responder,
        headers: Headers,
        log: ConnectionLog,
        generations: dict[str, Generation],
        on_gone: Callable[[Generation], None],
    ) -> None:
        self.api = api
        self.request_id = api.generate.id
        self.log = log.request(self.request_id)
        self._out = out
        self._headers = headers
        self._loop = asyncio.get_running_loop()
        self.reply = Reply(
            api.kind,
            self.request_id,
            services.backend.model_name,
            int(time.time()),
            include_usage=api.include_usage,
        )
        self._text: list[str] = []
        self._head_sent = False
        self._finished: asyncio.Future[None] = self._loop.create_future()
        self._keepalive: asyncio.TimerHandle | None = None
        self._wrote = False
        self.driver = RequestDriver(
            services,
            dialect=self,
            log=log,
            session=Session(restart_bytes=0),
            generations=generations,
            on_gone=on_gone,
        )

    async def run(self) -> None:
        """Serve the request; returns once its response is complete (or the client gone)."""
        try:
            await self.driver.receive(self.api.generate)
            if self._out.lost:
                self.client_gone()  # went while the request was being set up
            await self._finished
        finally:
            self._stop_keepalive()

    def client_gone(self) -> None:
        """The client disconnected: that is a cancel."""
        if self.driver.session.active_id is None:
            return
        self.log.info("client disconnected; cancelling")
        self.driver.services.in_background(self.driver.cancel_active())

    def cancel(self) -> None:
        """Server shutdown: end the request as cancelled (the client is told)."""
        self.driver.services.in_background(self.driver.cancel_active())

    # ------------------------------------------------------------ the dialect

    async def write(self, frame: ServerFrame) -> None:
        """Render one frame of the request as HTTP: SSE, or the whole body."""
        stream = self.api.stream
        if isinstance(frame, Delta):
            if stream:
                self._head()
                self._wrote = True
                await self._write(self.reply.text_chunk(frame.text))
            else:
                self._text.append(frame.text)
        elif isinstance(frame, Queued | Started):
            if stream:
                self._head()
                if isinstance(frame, Queued):
                    await self._write(KEEPALIVE)
        elif isinstance(frame, Done):
            await self._end(frame)
        elif isinstance(frame, Error):
            await self._fail(status_of(frame.code), frame.message, frame.code)

    async def _end(self, done: Done) -> None:
        if done.reason == "cancelled":
            # Only a shutdown cancels a request whose client is still there.
            await self._fail(
                HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down", "cancelled"
            )
        elif done.reason == "error":
            code = done.error_code or "internal"
            await self._fail(status_of(code), done.error_message or "generation failed", code)
        elif self.api.stream:
            self._head()
            await self._write_last(self.reply.final_chunks(done))
        else:
            body = self.reply.body("".join(self._text), done)
            self._respond(HTTPStatus.OK, body, "application/json")

    async def _fail(self, status: HTTPStatus, message: str, code: str) -> None:
        if self._head_sent:
            await self._write_last(error_event(status, message, code))
        else:
            self._respond(status, error_body(status, message, code), "application/json")

    # ------------------------------------------------------------ writing

    def _head(self) -> None:
        if self._head_sent or self._out.lost:
            return
        self._head_sent = True
        headers = [
            ("Content-Type", "text/event-stream; charset=utf-8"),
            ("Cache-Control", "no-cache"),
            # nginx buffers a proxied body unless told otherwise.
            ("X-Accel-Buffering", "no"),
            *self._headers,
        ]
        self._out.start(HTTPStatus.OK, headers)
        self._keepalive = self._loop.call_later(KEEPALIVE_S, self._keep_alive)

    def _keep_alive(self) -> None:
        self._keepalive = None
        if self._finished.done() or self._out.lost:
            return
        if not self._wrote and not self._out.paused:
            self._out.send(KEEPALIVE)
        self._wrote = False
        self._keepalive = self._loop.call_later(KEEPALIVE_S, self._keep_alive)

    def _stop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    async def _write(self, data: bytes) -> None:
        self._out.send(data)
        await self._out.drain()

    async def _write_last(self, data: bytes) -> None:
        if self._finished.done():
            return
        self._finish()
        if not self._out.lost:
            self._out.send(data)
            self._out.end()

    def _respond(self, status: int, body: bytes, content_type: str) -> None:
        if self._finished.done():
            return
        self._finish()
        if self._out.lost:
            return
        self._head_sent = True
        headers = [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            *self._headers,
            *refusal_headers(status),
        ]
        self._out.start(status, headers)
        self._out.send(body)
        self._out.end()

    def _finish(self) -> None:
        self._stop_keepalive()
        if not self._finished.done():
            self._finished.set_result(None)
