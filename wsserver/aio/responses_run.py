"""One response of the Responses API's WebSocket mode on the request driver.

(Over HTTP a response is an HTTP exchange's, :mod:`wsserver.aio.exchange`,
rendered by :class:`~wsserver.responses_render.ResponseAnswer`.)

A :class:`ResponseRun` runs its request exactly as a WebSocket ``generate``
runs — a :class:`~wsserver.aio.driver.RequestDriver` with a
:class:`~wsserver.session.Session` of its own takes it through the scheduler's
queue, the engine, the bounded channel, the pacing and the cancel bookkeeping —
and is the driver's :class:`~wsserver.aio.driver.Dialect`: it renders the
frames it gets back as Responses events (:class:`~wsserver.responses_render.ResponseRender`)
and hands them to its transport, JSON messages in WebSocket mode
(:mod:`wsserver.aio.responses_socket`):

* ``queued`` → :meth:`ResponseRun.waiting`;
* ``started`` → ``response.created``, ``response.in_progress``;
* ``delta`` → ``response.output_text.delta`` (the item and part open first);
* ``done`` → the item closed and ``response.completed`` / ``incomplete`` /
  ``failed`` — the conversation is kept for ``previous_response_id`` *before*
  that last event goes out, so a client may chain on it at once;
* ``error`` (refused before it ran: the queue is full, …) → :meth:`ResponseRun.refused`,
  with the status the HTTP exchange's table gives it (:func:`wsserver.exchange.failure_of`).

A cancel — the client gone, ``response.cancel``, the server's shutdown — is
the driver's: the response ends ``incomplete`` (``cancelled``) at once and the
engine stops within one step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..exchange import failure_of
from ..logs import ConnectionLog
from ..protocol import Delta, Done, Error, Generate, Queued, ServerFrame, Started
from ..responses_api import Message, refusal_wording
from ..responses_render import Keep, ResponseRender
from ..session import Session
from .driver import RequestDriver
from .pipeline import Generation
from .services import Services

__all__ = ["Keep", "ResponseRun"]


class ResponseRun:
    """One response: the driver's dialect; a transport subclasses the three outputs."""

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
        self.generate = generate
        self.render = render
        self.id = render.id
        self.log = log.request(self.id)
        self._history = history
        self._keep = keep
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.driver = RequestDriver(
            services,
            dialect=self,
            log=log,
            session=Session(restart_bytes=0),
            generations=generations,
            on_gone=on_gone,
        )

    async def start(self) -> None:
        """Hand the request to the driver (it then runs on its own)."""
        await self.driver.receive(self.generate)

    def cancel(self) -> None:
        """End the response as cancelled (its last events are still written)."""
        self.driver.cancel_soon()

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
            failure = failure_of(frame)
            try:
                message = refusal_wording(failure.message)
                await self.refused(failure.status, failure.code, message)
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
