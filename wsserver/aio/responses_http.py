"""The Responses API over HTTP: ``/v1/responses`` on the HTTP/1.1 transport.

:class:`ResponsesRoute` is the route :mod:`wsserver.aio.openai_http` hands
``/v1/responses`` and everything under it (the seam of
:mod:`wsserver.aio.http_route`; the gate's checks have run):

* ``POST /v1/responses`` — the body parsed (:mod:`wsserver.dialects.responses.api`),
  the conversation a ``previous_response_id`` names looked up, and the
  request run on the HTTP exchange (:mod:`wsserver.aio.exchange`) with the
  Responses renderer (:class:`~wsserver.dialects.responses.render.ResponseAnswer`):
  with ``stream``, the events as SSE (``event:`` names, ``sequence_number``),
  the head written when the request starts or queues, then keep-alives while
  it waits; without, the ``response`` object as the body. A refusal before
  the head is OpenAI's error object with its status; after it, an ``error``
  event; a response that failed or was cancelled mid-stream ends with its own
  terminal event.
* ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}`` — responses kept
  in the server's :class:`~wsserver.dialects.responses.store.ResponseStore` (when
  ``store`` was not false), bounded by bytes and by age.

An ``input_image``'s ``http(s)`` URL is fetched before the request runs
(:mod:`wsserver.aio.image_fetch`; off unless the operator allows hosts) and
kept in the input as base64, as a ``data:`` URL's image is.

A disconnect is a cancel, as for every HTTP request (the exchange's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from http import HTTPStatus
from typing import Any

import orjson

from ..dialects.api_errors import ApiError, parse_json
from ..dialects.responses.api import ResponsesRequest, parse_body, to_generate
from ..dialects.responses.items import input_urls, with_fetched
from ..dialects.responses.render import Keep, ResponseAnswer, ResponseRender
from ..dialects.responses.store import ResponseStore, StoredResponse
from .exchange import Exchange
from .http_answer import HttpAnswer
from .http_route import RouteRequest, no_route, not_allowed
from .image_fetch import fetch_for_route
from .services import Services

__all__ = ["PREFIX", "ResponsesRoute", "new_response_id", "not_found"]

PREFIX = "/v1/responses"


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(16)


def not_found(response_id: str) -> ApiError:
    """A ``previous_response_id`` (or a GET's id) we do not have (any more)."""
    return ApiError(
        HTTPStatus.BAD_REQUEST,
        f"previous response with id {response_id[:80]!r} not found"
        " (unknown, expired, deleted, stored with store: false, or of another connection)",
        "previous_response_not_found",
        "previous_response_id",
    )


class ResponsesRoute:
    """``/v1/responses`` and ``/v1/responses/{id}``; built once by the server."""

    def __init__(self, services: Services, store: ResponseStore) -> None:
        self._services = services
        self.store = store

    async def __call__(self, request: RouteRequest) -> None:
        if request.path == PREFIX:
            if request.method != "POST":
                raise not_allowed(request.method, "POST")
            await self._create(request)
            return
        response_id = request.path[len(PREFIX) + 1 :]
        if "/" in response_id or not response_id:
            raise no_route(request.method, request.path)
        now = asyncio.get_running_loop().time()
        answer = HttpAnswer(request.out, request.headers)
        if request.method == "GET":
            entry = self.store.get(response_id, now)
            if entry is None:
                raise _no_such(response_id)
            answer.respond(HTTPStatus.OK, entry.body)
        elif request.method == "DELETE":
            if not self.store.delete(response_id):
                raise _no_such(response_id)
            body = {"id": response_id, "object": "response.deleted", "deleted": True}
            answer.respond(HTTPStatus.OK, orjson.dumps(body))
        else:
            raise not_allowed(request.method, "GET or DELETE")

    async def _create(self, route: RouteRequest) -> None:
        request = parse_body(parse_json(route.body))
        urls = input_urls(request.input)
        if urls:
            # Fetched before anything else, and kept as base64 in the input
            # (a stored conversation holds the bytes, not the URL).
            images = [i for m in request.input for i in m.get("images", ()) if isinstance(i, str)]
            held = sum(len(image) * 3 // 4 for image in images)
            config = self._services.config.images
            fetched = await fetch_for_route(route, config, urls, held)
            if fetched is None:
                return  # the client went while they were fetched
            request = dataclasses.replace(request, input=with_fetched(request.input, fetched))
        loop = asyncio.get_running_loop()
        history: tuple[Any, ...] = ()
        if request.previous_response_id is not None:
            entry = self.store.get(request.previous_response_id, loop.time())
            if entry is None:
                raise not_found(request.previous_response_id)
            history = entry.conversation
        response_id = new_response_id()
        generate = to_generate(request, history, response_id, self._services.wire_limits)
        keep = self._keeper(request)

        def answer(model: str) -> ResponseAnswer:
            render = ResponseRender(request, response_id=response_id, model=model)
            return ResponseAnswer(render, history=history, keep=keep)

        await Exchange(route, self._services).run(generate, request.model, answer)

    def _keeper(self, request: ResponsesRequest) -> Keep | None:
        if not request.store:
            return None
        store = self.store
        loop = asyncio.get_running_loop()

        def keep(response: dict[str, Any], conversation: tuple[Any, ...]) -> None:
            now = loop.time()
            store.put(StoredResponse.of(response, conversation, expires=store.expiry(now)), now)

        return keep


def _no_such(response_id: str) -> ApiError:
    return ApiError(
        HTTPStatus.NOT_FOUND,
        f"no stored response with id {response_id[:80]!r} (unknown, expired or deleted)",
        "not_found",
    )
