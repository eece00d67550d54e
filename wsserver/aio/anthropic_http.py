"""Anthropic's Messages API over HTTP: ``/v1/messages`` on the HTTP/1.1 transport.

:class:`MessagesRoute` is the route :mod:`wsserver.aio.openai_http` hands
``/v1/messages`` and everything under it (the seam of
:mod:`wsserver.aio.http_route`; the gate's checks have run, the token
accepted as ``x-api-key`` too):

* ``POST /v1/messages`` — run on the HTTP exchange (:mod:`wsserver.aio.exchange`)
  with the Messages API's renderer (:class:`~wsserver.dialects.anthropic.render.MessageAnswer`),
  as every request runs (the shared queue, paced deltas, bounded memory behind a slow
  reader, disconnect = cancel even mid-prompt). With ``stream``, Anthropic's
  events as SSE (:mod:`wsserver.dialects.anthropic.render`), the head written when the
  request starts or waits, ``message_start`` once the engine counted the
  prompt (with the first block), a ``ping`` event while it waits (and every
  :data:`~wsserver.aio.http_answer.KEEPALIVE_S` while nothing else is sent);
  without, the ``message`` object as the body.
* ``POST /v1/messages/count_tokens`` — ``{"input_tokens": n}`` for the same
  body, counted by the engine (:meth:`~wsserver.backends.Backend.count_prompt_tokens`)
  on a worker thread; an engine that cannot count refuses.

Every refusal and failure is Anthropic's error object with its status
(:func:`wsserver.dialects.anthropic.api.error_body`; the transport uses it for this
path's refusals too, the gate's 401 included): before the head, as the
response; after it, as an ``error`` event.
"""

from __future__ import annotations

import asyncio
import secrets
from http import HTTPStatus
from typing import Final

import orjson

from ..backends.base import GenerationRequest
from ..dialects.anthropic.api import parse_body, to_generate
from ..dialects.anthropic.render import MessageAnswer, MessageRender
from ..dialects.api_errors import ApiError, parse_json
from ..errors import ProtocolError
from .exchange import Exchange, resolve
from .http_answer import HttpAnswer
from .http_route import RouteRequest, no_route, not_allowed
from .image_fetch import fetched_generate
from .services import Services

__all__ = ["COUNT_TOKENS", "PREFIX", "MessagesRoute"]

PREFIX: Final = "/v1/messages"
COUNT_TOKENS: Final = PREFIX + "/count_tokens"


class MessagesRoute:
    """``/v1/messages`` and ``/v1/messages/count_tokens``; built once by the server."""

    def __init__(self, services: Services) -> None:
        self._services = services

    async def __call__(self, request: RouteRequest) -> None:
        if request.path not in (PREFIX, COUNT_TOKENS):
            raise no_route(request.method, request.path)
        if request.method != "POST":
            raise not_allowed(request.method, "POST")
        if request.path == COUNT_TOKENS:
            await self._count(request)
        else:
            await self._create(request)

    async def _create(self, route: RouteRequest) -> None:
        body = parse_body(parse_json(route.body))
        message_id = "msg_" + secrets.token_hex(12)
        generate = to_generate(body, message_id, self._services.wire_limits)
        forced = generate.tool_choice == "required"

        def answer(model: str) -> MessageAnswer:
            render = MessageRender(body, message_id=message_id, model=model)
            return MessageAnswer(render, forced=forced)

        await Exchange(route, self._services).run(generate, body.model, answer)

    async def _count(self, route: RouteRequest) -> None:
        body = parse_body(parse_json(route.body), counting=True)
        services = self._services
        generate = to_generate(body, route.request_id, services.wire_limits)
        generate, model = resolve(services, generate, body.model)
        fetched = await fetched_generate(route, services.config.images, generate, model)
        if fetched is None:
            return  # the client went while its image URLs were fetched
        generate = fetched
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
