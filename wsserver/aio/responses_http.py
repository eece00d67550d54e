"""The Responses API over HTTP: ``/v1/responses`` on the HTTP/1.1 transport.

:class:`ResponsesRoute` is the route :mod:`wsserver.aio.openai_http` hands
``/v1/responses`` and everything under it (the seam of
:mod:`wsserver.aio.http_route`; the gate's checks have run):

* ``POST /v1/responses`` — a :class:`HttpResponse`: with ``stream``, the
  events as SSE (``event:`` names, ``sequence_number``), the head written when
  the request starts or queues, then keep-alives while it waits; without, the
  ``response`` object as the body. A refusal before the head is OpenAI's
  error object with its status; after it, an ``error`` event.
* ``GET /v1/responses/{id}``, ``DELETE /v1/responses/{id}`` — responses kept
  in the server's :class:`~wsserver.responses_store.ResponseStore` (when
  ``store`` was not false), bounded by bytes and by age.

A disconnect is a cancel, as for a chat completion.
"""

from __future__ import annotations

import asyncio
import secrets
from http import HTTPStatus
from typing import Any, cast

import orjson

from ..api_errors import ApiError, error_body, status_of
from ..errors import ProtocolError, WireCode
from ..responses_api import ResponsesRequest, parse_body, parse_json, to_generate
from ..responses_render import ResponseRender, sse
from ..responses_store import ResponseStore, StoredResponse
from .http_answer import CLIENT_GONE, KEEPALIVE, HttpAnswer
from .http_route import Responder, RouteRequest
from .responses_run import Keep, ResponseRun
from .services import Services

__all__ = ["PREFIX", "HttpResponse", "ResponsesRoute", "new_response_id", "not_found"]

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


class HttpResponse(ResponseRun):
    """One ``POST /v1/responses``, answered as SSE or as a whole body."""

    def __init__(self, *args: Any, out: Responder, stream: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._out = out
        self._stream = stream
        self._answer: HttpAnswer | None = None

    async def run(self, answer: HttpAnswer) -> None:
        """Serve the request; returns once its answer is complete (or the client gone)."""
        self._answer = answer
        await answer.serve(self.driver, self.generate)

    def client_gone(self) -> None:
        """The client disconnected: that is a cancel."""
        self.driver.cancel_soon(CLIENT_GONE)

    async def waiting(self) -> None:
        answer = self._answer
        if self._stream and answer is not None:
            answer.head()
            await answer.write(KEEPALIVE, progress=False)

    async def emit(self, events: list[dict[str, Any]], *, last: bool) -> None:
        answer = self._answer
        assert answer is not None
        render = self.render
        if render.status == "failed" and not (self._stream and answer.head_sent):
            error = render.error or {}
            code = str(error.get("code", "internal"))
            await self.refused(
                status_of(cast("WireCode", code)), code, str(error.get("message", "failed"))
            )
        elif self._stream:
            answer.head()
            data = b"".join(sse(event) for event in events)
            if last:
                answer.write_last(data)
            else:
                await answer.write(data)
        elif last:
            if render.incomplete_reason == "cancelled":
                # Only a shutdown cancels a request whose client is still there.
                await self.refused(503, "cancelled", "the server is shutting down")
            else:
                answer.respond(HTTPStatus.OK, orjson.dumps(render.response()))

    async def refused(self, status: int, code: str, message: str) -> None:
        answer = self._answer
        assert answer is not None
        if answer.head_sent:
            answer.write_last(sse(self.render.error_event(status, code, message)))
        else:
            answer.respond(status, error_body(status, message, code))


class ResponsesRoute:
    """``/v1/responses`` and ``/v1/responses/{id}``; built once by the server."""

    def __init__(self, services: Services, store: ResponseStore) -> None:
        self._services = services
        self.store = store

    async def __call__(self, request: RouteRequest) -> None:
        if request.path == PREFIX:
            if request.method != "POST":
                raise _not_allowed(request.method, "POST")
            await self._create(request)
            return
        response_id = request.path[len(PREFIX) + 1 :]
        if "/" in response_id or not response_id:
            raise ApiError(
                HTTPStatus.NOT_FOUND, f"no route {request.method} {request.path[:100]}", "not_found"
            )
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
            raise _not_allowed(request.method, "GET or DELETE")

    async def _create(self, route: RouteRequest) -> None:
        request = parse_body(parse_json(route.body))
        loop = asyncio.get_running_loop()
        history: tuple[Any, ...] = ()
        if request.previous_response_id is not None:
            entry = self.store.get(request.previous_response_id, loop.time())
            if entry is None:
                raise not_found(request.previous_response_id)
            history = entry.conversation
        response_id = new_response_id()
        generate = to_generate(request, history, response_id, self._services.wire_limits)
        try:
            generate, model = self._services.models.for_api(generate, request.model)
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc) from None
        render = ResponseRender(request, response_id=response_id, model=model.name)
        run = HttpResponse(
            generate,
            render,
            services=self._services,
            log=route.log,
            generations=route.generations,
            on_gone=route.on_gone,
            history=history,
            keep=self._keeper(request),
            out=route.out,
            stream=request.stream,
        )
        route.begin(run)
        await run.run(HttpAnswer(route.out, route.headers))

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


def _not_allowed(method: str, allowed: str) -> ApiError:
    return ApiError(
        HTTPStatus.METHOD_NOT_ALLOWED, f"{method} is not allowed here; use {allowed}", "bad_request"
    )
