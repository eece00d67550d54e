"""One response of the Responses API on the request driver, for either transport.

A :class:`ResponseEvents` renders one response's frames — what a
:class:`~wsserver.aio.driver.RequestDriver` gives back, the driver having
taken the request through the scheduler's queue, the engine, the bounded
channel, the pacing and the cancel bookkeeping exactly as a WebSocket
``generate`` or a chat completion — as Responses events
(:class:`~wsserver.responses_render.ResponseRender`), and hands them to its
transport: SSE or a whole body over HTTP (:mod:`wsserver.aio.responses_http`),
JSON messages in WebSocket mode (:mod:`wsserver.aio.responses_socket`). Over
HTTP a :class:`ResponseRun` is that renderer on a driver of its own (with a
:class:`~wsserver.session.Session` of its own); in WebSocket mode the driver
is the response's lane's, which runs the lane's responses one after another.

* ``queued`` → :meth:`ResponseEvents.waiting` (an HTTP stream's head and keep-alive);
* ``started`` → ``response.created``, ``response.in_progress``;
* ``delta`` → ``response.output_text.delta`` (the item and part open first);
* ``done`` → the item closed and ``response.completed`` / ``incomplete`` /
  ``failed`` — the conversation is kept for ``previous_response_id`` *before*
  that last event goes out, so a client may chain on it at once;
* ``error`` (refused before it ran: the queue is full, …) → :meth:`ResponseEvents.refused`.

A cancel — the client gone, ``response.cancel``, the server's shutdown — is
the driver's: the response ends ``incomplete`` (``cancelled``) at once and the
engine stops within one step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..api_errors import status_of
from ..errors import CONTEXT_LENGTH_EXCEEDED
from ..logs import ConnectionLog
from ..protocol import Delta, Done, Error, Generate, Queued, ServerFrame, Started
from ..responses_api import Message, refusal_wording
from ..responses_render import ResponseRender
from ..session import Session
from .driver import RequestDriver
from .pipeline import Generation
from .services import Services

__all__ = ["Keep", "ResponseEvents", "ResponseRun"]

#: Keeps a finished response for ``previous_response_id``: (the response
#: object, the conversation up to its output).
Keep = Callable[[dict[str, Any], tuple[Message, ...]], None]


class ResponseEvents:
    """One response's frames rendered as Responses events; a transport
    subclasses the three outputs. It drives nothing: a driver writes to it
    (the WebSocket mode's lane driver, or a :class:`ResponseRun`'s own)."""

    def __init__(
        self,
        render: ResponseRender,
        *,
        history: tuple[Message, ...] = (),
        keep: Keep | None = None,
    ) -> None:
        self.render = render
        self.id = render.id
        self._history = history
        self._keep = keep
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # ------------------------------------------------------------ the dialect

    async def write(self, frame: ServerFrame) -> None:
        render = self.render
        if isinstance(frame, Delta):
            await self.emit(
                render.delta(frame.text, frame.reasoning, frame.tool_calls or ()), last=False
            )
        elif isinstance(frame, Started):
            await self.emit(render.begin(), last=False)
        elif isinstance(frame, Queued):
            await self.waiting()
        elif isinstance(frame, Done):
            events = render.end(frame)
            if self._keep is not None and render.status in ("completed", "incomplete"):
                self._keep(render.response(), render.conversation(self._history))
            try:
                await self.emit(events, last=True)
            finally:
                self._finish()
        elif isinstance(frame, Error):
            try:
                if frame.detail == CONTEXT_LENGTH_EXCEEDED:  # as OpenAI answers it
                    await self.refused(400, CONTEXT_LENGTH_EXCEEDED, frame.message)
                else:
                    message = refusal_wording(frame.message)
                    await self.refused(status_of(frame.code), frame.code, message)
            finally:
                self._finish()

    def _finish(self) -> None:
        if not self.finished.done():
            self.finished.set_result(None)

    # ------------------------------------------------------------ the transport's part

    async def emit(self, events: list[dict[str, Any]], *, last: bool) -> None:
        """Write these events (``last``: the response's terminal one is among them)."""
        raise NotImplementedError

    async def waiting(self) -> None:
        """The request waits for the model."""

    async def refused(self, status: int, code: str, message: str) -> None:
        """The request was refused before it ran."""
        raise NotImplementedError


class ResponseRun(ResponseEvents):
    """One response on a driver of its own (over HTTP): the driver's dialect."""

    def __init__(
        self,
        generate: Generate,
        render: ResponseRender,
        *,
        services: Services,
        log: ConnectionLog,
        generations: dict[str, Generation],
        on_gone: Callable[[Generation], None] | None = None,
        history: tuple[Message, ...] = (),
        keep: Keep | None = None,
    ) -> None:
        super().__init__(render, history=history, keep=keep)
        self.generate = generate
        self.log = log.request(self.id)
        self.driver = RequestDriver(
            services,
            dialect=self,
            log=log,
            session=Session(restart_bytes=0),
            generations=generations,
            on_gone=on_gone,
        )

    def cancel(self) -> None:
        """End the response as cancelled (its last events are still written)."""
        self.driver.cancel_soon()
