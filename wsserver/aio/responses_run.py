"""One response of the Responses API's WebSocket mode, rendered as Responses events.

(Over HTTP a response is an HTTP exchange's, :mod:`wsserver.aio.exchange`,
rendered by :class:`~wsserver.dialects.responses.render.ResponseAnswer`.)

A :class:`ResponseEvents` renders one response's frames — what a
:class:`~wsserver.aio.driver.RequestDriver` gives back, the driver having
taken the request through the scheduler's queue, the engine, the bounded
channel, the pacing and the cancel bookkeeping exactly as a WebSocket
``generate`` or a chat completion — as Responses events
(:class:`~wsserver.dialects.responses.render.ResponseRender`), and hands them to its
transport, JSON messages in WebSocket mode (:mod:`wsserver.aio.responses_socket`),
whose lane's driver runs the lane's responses one after another.

* ``queued`` → :meth:`ResponseEvents.waiting`;
* ``started`` → ``response.created``, ``response.in_progress``;
* ``delta`` → ``response.output_text.delta`` (the item and part open first);
* ``done`` → the item closed and ``response.completed`` / ``incomplete`` /
  ``failed`` — the conversation is kept for ``previous_response_id`` *before*
  that last event goes out, so a client may chain on it at once;
* ``error`` (refused before it ran: the queue is full, …) → :meth:`ResponseEvents.refused`,
  with the status the HTTP exchange's table gives it (:func:`wsserver.dialects.exchange.failure_of`).

A cancel — the client gone, ``response.cancel``, the server's shutdown — is
the driver's: the response ends ``incomplete`` (``cancelled``) at once and the
engine stops within one step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ..core.protocol import Delta, Done, Error, Queued, ServerFrame, Started
from ..dialects.exchange import failure_of
from ..dialects.responses.api import Message, refusal_wording
from ..dialects.responses.render import Keep, ResponseRender

__all__ = ["Keep", "ResponseEvents"]


class ResponseEvents:
    """One response's frames rendered as Responses events; a transport
    subclasses the three outputs. It drives nothing: a driver writes to it
    (the WebSocket mode's lane driver)."""

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
