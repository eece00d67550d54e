"""The OpenAI dialect: one completion request, rendered as HTTP and SSE.

A :class:`Completion` runs the request exactly as a WebSocket ``generate``
runs — a :class:`~wsserver.aio.driver.RequestDriver` with a
:class:`~wsserver.session.Session` of its own takes it through the scheduler's
queue, the engine, the bounded channel, the pacing and the cancel bookkeeping —
and only renders the frames the driver gives back (:meth:`Completion.write`):

* ``queued`` → the response's headers and a ``: keep-alive`` comment (also
  every :data:`~wsserver.aio.http_answer.KEEPALIVE_S` while nothing else is
  sent; the writing is :class:`~wsserver.aio.http_answer.HttpAnswer`'s);
* ``started`` → the headers, so that a client's ``create(stream=True)``
  returns while the prompt is processed and it can abandon it;
* ``delta`` → one SSE chunk, written, then the write waits while the
  transport is above its high-water mark: the pump stops, the channel fills,
  the engine pauses, as over a WebSocket (without ``stream``, the text is
  gathered — at most ``max_tokens`` tokens —, with the tokens'
  log-probabilities if asked for);
* ``done`` → the finish chunk, the usage chunk and ``[DONE]`` (or the whole
  JSON body); an ``error`` → OpenAI's error object, with its status while
  the headers are still unsent, as an in-band event after.

A disconnect is a ``cancel`` frame (:meth:`Completion.client_gone`): the
driver ends the request as cancelled and the generation stops its engine —
within one step, mid-prefill too, through the cancel event.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from http import HTTPStatus

from ..errors import CONTEXT_LENGTH_EXCEEDED
from ..logprobs import TokenLogprob
from ..logs import ConnectionLog
from ..openai_api import ApiRequest, error_body, status_of
from ..openai_render import Reply, error_event
from ..protocol import CallPart, Delta, Done, Error, Queued, ServerFrame, Started
from ..session import Session
from .driver import RequestDriver
from .http_answer import CLIENT_GONE, KEEPALIVE, HttpAnswer
from .http_route import Headers, Responder
from .pipeline import Generation
from .services import Services

__all__ = ["Completion"]


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
        self._answer = HttpAnswer(out, headers)
        self.reply = Reply(
            api.kind,
            self.request_id,
            api.generate.model or services.backend.model_name,
            int(time.time()),
            include_usage=api.include_usage,
            logprobs=bool(api.generate.logprobs),
        )
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._tool_calls: list[CallPart] = []
        self.driver = RequestDriver(
            services,
            dialect=self,
            log=log,
            session=Session(restart_bytes=0),
            generations=generations,
            on_gone=on_gone,
        )

    async def run(self) -> None:
        """Serve the request; returns once its answer is complete (or the client gone)."""
        await self._answer.serve(self.driver, self.api.generate)

    def client_gone(self) -> None:
        """The client disconnected: that is a cancel."""
        self.driver.cancel_soon(CLIENT_GONE)

    def cancel(self) -> None:
        """Server shutdown: end the request as cancelled (the client is told)."""
        self.driver.cancel_soon()

    # ------------------------------------------------------------ the dialect

    async def write(self, frame: ServerFrame) -> None:
        """Render one frame of the request as HTTP: SSE, or the whole body."""
        stream = self.api.stream
        if isinstance(frame, Delta):
            if stream:
                self._answer.head()
                chunk = self.reply.text_chunk(
                    frame.text, frame.reasoning, frame.logprobs, frame.tool_calls
                )
                await self._answer.write(chunk)
            else:
                self._text.append(frame.text)
                if frame.reasoning:
                    self._reasoning.append(frame.reasoning)
                if frame.logprobs:
                    self._logprobs.extend(frame.logprobs)
                if frame.tool_calls:
                    self._tool_calls.extend(frame.tool_calls)
        elif isinstance(frame, Queued | Started):
            if stream:
                self._answer.head()
                if isinstance(frame, Queued):
                    await self._answer.write(KEEPALIVE, progress=False)
        elif isinstance(frame, Done):
            await self._end(frame)
        elif isinstance(frame, Error):
            if frame.detail == CONTEXT_LENGTH_EXCEEDED:
                # OpenAI's answer to a prompt beyond the context: a 400 that
                # names it (the WebSocket protocol keeps ``too_large``).
                await self._fail(HTTPStatus.BAD_REQUEST, frame.message, CONTEXT_LENGTH_EXCEEDED)
            else:
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
            self._answer.head()
            self._answer.write_last(self.reply.final_chunks(done))
        else:
            text, reasoning = "".join(self._text), "".join(self._reasoning)
            body = self.reply.body(text, done, reasoning, self._logprobs, self._tool_calls)
            self._answer.respond(HTTPStatus.OK, body)

    async def _fail(self, status: HTTPStatus, message: str, code: str) -> None:
        if self._answer.head_sent:
            self._answer.write_last(error_event(status, message, code))
        else:
            self._answer.respond(status, error_body(status, message, code))
