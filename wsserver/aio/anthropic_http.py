"""Anthropic's Messages API over HTTP: ``/v1/messages`` on the HTTP/1.1 transport.

:class:`MessagesRoute` is the route :mod:`wsserver.aio.openai_http` hands
``/v1/messages`` and everything under it (the seam of
:mod:`wsserver.aio.http_route`; the gate's checks have run, the token
accepted as ``x-api-key`` too):

* ``POST /v1/messages`` — a :class:`MessageRun` on the request driver, as
  every request runs (the shared queue, paced deltas, bounded memory behind a slow
  reader, disconnect = cancel even mid-prompt). With ``stream``, Anthropic's
  events as SSE (:mod:`wsserver.anthropic_render`), the head written when the
  request starts or waits, ``message_start`` once the engine counted the
  prompt (with the first block), a ``ping`` event while it waits (and every
  :data:`~wsserver.aio.http_answer.KEEPALIVE_S` while nothing else is sent);
  without, the ``message`` object as the body.
* ``POST /v1/messages/count_tokens`` — ``{"input_tokens": n}`` for the same
  body, counted by the engine (:meth:`~wsserver.backends.Backend.count_prompt_tokens`)
  on a worker thread; an engine that cannot count refuses.

Every refusal and failure is Anthropic's error object with its status
(:func:`wsserver.anthropic_api.error_body`; the transport uses it for this
path's refusals too, the gate's 401 included): before the head, as the
response; after it, as an ``error`` event.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from http import HTTPStatus
from typing import Final

import orjson

from ..anthropic_api import (
    anthropic_status,
    error_object,
    parse_body,
    refusal_wording,
    to_generate,
)
from ..anthropic_content import forced_call_refusal
from ..anthropic_render import PING, MessageRender, sse
from ..api_errors import ApiError, parse_json, status_of
from ..backends.base import GenerationRequest
from ..errors import ProtocolError, WireCode
from ..logs import ConnectionLog
from ..protocol import Delta, Done, Error, Generate, Queued, ServerFrame, Started
from ..session import Session
from .driver import RequestDriver
from .http_answer import CLIENT_GONE, HttpAnswer
from .http_route import Responder, RouteRequest
from .pipeline import Generation
from .services import Services

__all__ = ["COUNT_TOKENS", "PREFIX", "MessageRun", "MessagesRoute"]

PREFIX: Final = "/v1/messages"
COUNT_TOKENS: Final = PREFIX + "/count_tokens"


class MessageRun:
    """One ``POST /v1/messages``: the driver's dialect, answered as SSE or a whole body."""

    def __init__(
        self,
        generate: Generate,
        render: MessageRender,
        *,
        services: Services,
        log: ConnectionLog,
        out: Responder,
        answer: HttpAnswer,
        generations: dict[str, Generation],
        on_gone: Callable[[Generation], None] | None = None,
    ) -> None:
        self.generate = generate
        self.render = render
        self.log = log.request(generate.id)
        self._out = out
        self._answer = answer
        self._stream = render.request.stream
        self.driver = RequestDriver(
            services,
            dialect=self,
            log=log,
            session=Session(restart_bytes=0),
            generations=generations,
            on_gone=on_gone,
            on_prompt=lambda event: render.prompt_counted(event.prompt_tokens, event.cached_tokens),
        )

    async def run(self) -> None:
        """Serve the request; returns once its answer is complete (or the client gone)."""
        await self._answer.serve(self.driver, self.generate)

    def client_gone(self) -> None:
        """The client disconnected: that is a cancel."""
        self.driver.cancel_soon(CLIENT_GONE)

    def cancel(self) -> None:
        """Server shutdown: end the request as cancelled (the client is told)."""
        self.driver.cancel_soon()

    # ------------------------------------------------------------ the dialect

    async def write(self, frame: ServerFrame) -> None:
        render, answer = self.render, self._answer
        if isinstance(frame, Delta):
            events = render.delta(frame.text, frame.reasoning, frame.tool_calls)
            if self._stream:
                answer.head()
                await answer.write(b"".join(sse(event) for event in events))
        elif isinstance(frame, Started):
            # The head now (the SDK's stream returns while the prompt is read);
            # message_start once the prompt's count is known (render.delta).
            if self._stream:
                answer.head()
        elif isinstance(frame, Queued):
            if self._stream:
                answer.head()
                await answer.write(PING, progress=False)
        elif isinstance(frame, Done):
            await self._end(frame)
        elif isinstance(frame, Error):
            message = refusal_wording(frame.message)
            if self.generate.tool_choice == "required" and "'tool_choice'" in message:
                # The engine cannot force a call: say so the Messages API's way.
                message = forced_call_refusal(self.render.model).message
            await self._fail(status_of(frame.code), frame.code, message)

    async def _end(self, done: Done) -> None:
        if done.reason == "cancelled":
            # Only a shutdown cancels a request whose client is still there.
            await self._fail(
                HTTPStatus.SERVICE_UNAVAILABLE, "overloaded", "the server is shutting down"
            )
        elif done.reason == "error":
            code = done.error_code or "internal"
            await self._fail(status_of(code), code, done.error_message or "generation failed")
        else:
            events = self.render.end(done)
            if self._stream:
                self._answer.head()
                self._answer.write_last(b"".join(sse(event) for event in events))
            else:
                self._answer.respond(HTTPStatus.OK, orjson.dumps(self.render.message()))

    async def _fail(self, status: int, code: WireCode | str, message: str) -> None:
        status = anthropic_status(status, code)
        error = error_object(status, message)
        if self._answer.head_sent:
            self._answer.write_last(sse(error))
        else:
            self._answer.respond(status, orjson.dumps(error))


class MessagesRoute:
    """``/v1/messages`` and ``/v1/messages/count_tokens``; built once by the server."""

    def __init__(self, services: Services) -> None:
        self._services = services

    async def __call__(self, request: RouteRequest) -> None:
        if request.path not in (PREFIX, COUNT_TOKENS):
            raise ApiError(
                HTTPStatus.NOT_FOUND, f"no route {request.method} {request.path[:100]}", "not_found"
            )
        if request.method != "POST":
            raise ApiError(
                HTTPStatus.METHOD_NOT_ALLOWED,
                f"{request.method} is not allowed here; use POST",
                "bad_request",
            )
        if request.path == COUNT_TOKENS:
            await self._count(request)
        else:
            await self._create(request)

    async def _create(self, route: RouteRequest) -> None:
        body = parse_body(parse_json(route.body))
        message_id = "msg_" + secrets.token_hex(12)
        generate = to_generate(body, message_id, self._services.wire_limits)
        try:
            generate, model = self._services.models.for_api(generate, body.model)
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc) from None
        render = MessageRender(body, message_id=message_id, model=model.name)
        answer = HttpAnswer(route.out, route.headers, keepalive=PING)
        run = MessageRun(
            generate,
            render,
            services=self._services,
            log=route.log,
            out=route.out,
            answer=answer,
            generations=route.generations,
            on_gone=route.on_gone,
        )
        route.begin(run)
        await run.run()

    async def _count(self, route: RouteRequest) -> None:
        body = parse_body(parse_json(route.body), counting=True)
        services = self._services
        generate = to_generate(body, route.request_id, services.wire_limits)
        try:
            generate, model = services.models.for_api(generate, body.model)
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc) from None
        backend = model.backend
        request = GenerationRequest.from_frame(
            generate, default_max_tokens=services.wire_limits.default_max_tokens
        )
        try:
            count = await asyncio.to_thread(backend.count_prompt_tokens, request)
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc) from None
        if count is None:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"count_tokens is not available with this server's engine"
                f" ({model.name}): it has no tokenizer of its own to ask",
                "unsupported_option",
            )
        answer = HttpAnswer(route.out, route.headers)
        answer.respond(HTTPStatus.OK, orjson.dumps({"input_tokens": count}))
