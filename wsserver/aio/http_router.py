"""The HTTP API's routes: one table, and the way a vetted request reaches one.

Every route of the HTTP API on the WebSocket port is registered in
:func:`api_routes` and nowhere else — a path, the route that serves it and
everything under it, and how refusals there are written (OpenAI's error
object unless the dialect says otherwise):

* ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` — the OpenAI
  API (:mod:`wsserver.aio.openai_routes`);
* ``/v1/embeddings``, ``/v1/rerank`` and ``/rerank`` — embeddings and rerank
  (:mod:`wsserver.aio.embedding_routes`);
* ``/v1/responses`` — the Responses API over HTTP (:mod:`wsserver.aio.responses_http`);
* ``/v1/messages`` — Anthropic's Messages API (:mod:`wsserver.aio.anthropic_http`),
  its refusals in Anthropic's shape;
* ``/api`` — Ollama's API (:mod:`wsserver.aio.ollama_http`), its refusals
  in Ollama's shape.

A new dialect is its renderer (:class:`wsserver.dialects.exchange.Renderer`), a route
that parses its body and runs it on the HTTP exchange, and a line here.

:class:`Router` takes each request the transport (:mod:`wsserver.aio.openai_http`)
read: the gate's checks (Host, Origin and CORS, the token, the request rate;
the probes need none), a CORS preflight, the plain routes outside ``/v1`` on
a connection kept alive here, then the route of its path. An
:class:`~wsserver.dialects.api_errors.ApiError` a route raises is its refusal, written
in the route's shape, logged and — for the faults a client makes — counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, Protocol

import h11

from ..dialects.anthropic.api import error_body as anthropic_error_body
from ..dialects.api_errors import ApiError
from ..dialects.ollama.api import error_body as ollama_error_body
from ..errors import refusal_headers
from ..logs import ConnectionLog
from .anthropic_http import PREFIX as MESSAGES
from .anthropic_http import MessagesRoute
from .embedding_routes import embeddings_route, rerank_route
from .front import is_api_target
from .http_route import (
    ErrorBody,
    Headers,
    Responder,
    Route,
    RouteRequest,
    Running,
    no_route,
    not_allowed,
)
from .ollama_http import PREFIX as OLLAMA
from .ollama_http import OllamaRoute
from .openai_gate import Gate, RequestHeaders, request_id_of
from .openai_routes import CompletionsRoute, ModelsRoute
from .pipeline import Generation
from .responses_http import PREFIX as RESPONSES
from .responses_http import ResponsesRoute
from .services import Services

__all__ = ["PROBES", "Client", "PlainRoute", "RouteEntry", "RouteTable", "Router", "api_routes"]

#: Answered without the token and rate checks, as on a new connection (:mod:`.http`).
PROBES: Final = frozenset({"/healthz", "/readyz"})
#: Refusals counted in the errors metric (the gate counts its own as such).
_METRIC_CODES: Final = frozenset(
    {"bad_json", "bad_request", "too_large", "rate_limited", "overloaded", "internal"}
)

#: A plain route's answer for a kept-alive connection (probes, ``/metrics``,
#: the page): ``(path with query, headers) → (status, headers, body)``.
PlainRoute = Callable[[str, Headers], tuple[int, Headers, bytes]]


@dataclass(frozen=True, slots=True)
class RouteEntry:
    """A route, and how refusals on its paths are written."""

    route: Route
    #: None: OpenAI's error object.
    error_body: ErrorBody | None = None


class RouteTable:
    """Path → route: a path serves itself and everything under it."""

    def __init__(self, entries: dict[str, RouteEntry]) -> None:
        self._entries = entries

    def find(self, path: str) -> RouteEntry | None:
        for prefix, entry in self._entries.items():
            if path == prefix or path.startswith(prefix + "/"):
                return entry
        return None

    def error_answer(self, path: str | None, error: ApiError) -> tuple[int, bytes]:
        """A refusal's status and body, in the shape of the route asked for."""
        entry = self.find(path) if path is not None else None
        if entry is not None and entry.error_body is not None:
            return entry.error_body(error)
        return error.status, error.body()


def api_routes(services: Services, responses: ResponsesRoute) -> RouteTable:
    """Every HTTP API route (``responses``: the server keeps its store)."""
    return RouteTable(
        {
            "/v1/chat/completions": RouteEntry(
                CompletionsRoute(services, "chat", "/v1/chat/completions")
            ),
            "/v1/completions": RouteEntry(
                CompletionsRoute(services, "completion", "/v1/completions")
            ),
            "/v1/models": RouteEntry(ModelsRoute(services)),
            "/v1/embeddings": RouteEntry(embeddings_route(services)),
            "/v1/rerank": RouteEntry(rerank_route(services, "/v1/rerank")),
            "/rerank": RouteEntry(rerank_route(services, "/rerank")),
            RESPONSES: RouteEntry(responses),
            MESSAGES: RouteEntry(MessagesRoute(services), anthropic_error_body),
            OLLAMA: RouteEntry(OllamaRoute(services), ollama_error_body),
        }
    )


class Client(Protocol):
    """The connection a request came on, as the router sees it."""

    log: ConnectionLog
    generations: dict[str, Generation]

    @property
    def out(self) -> Responder: ...

    @property
    def peer(self) -> str: ...

    def begin(self, running: Running) -> None: ...

    def generation_gone(self, generation: Generation) -> None: ...


class Router:
    """Takes each vetted request to its route (see the module docstring)."""

    def __init__(
        self,
        services: Services,
        gate: Gate,
        routes: RouteTable,
        *,
        plain: PlainRoute | None = None,
    ) -> None:
        self._services = services
        self._gate = gate
        self.routes = routes
        #: The plain ``GET`` routes outside ``/v1``, for a connection kept alive
        #: here that asks for one next (None: none are answered here).
        self._plain = plain

    async def handle(self, request: h11.Request, body: bytes, client: Client) -> None:
        """Answer one request (a refusal included); returns once it is answered."""
        headers = RequestHeaders(request.headers)
        request_id = request_id_of(headers)
        extra: Headers = [("X-Request-ID", request_id)]
        path = path_of(request)
        try:
            route = RouteRequest(
                method=request.method.decode("ascii", "replace"),
                path=path,
                body=body,
                request_id=request_id,
                out=client.out,
                headers=extra,
                log=client.log,
                generations=client.generations,
                on_gone=client.generation_gone,
                begin=client.begin,
            )
            await self._route(request, headers, route, client.peer)
        except ApiError as exc:
            client.log.request(request_id).info(
                "refused: %d %s", exc.status, exc.message, extra={"code": exc.code}
            )
            if exc.code in _METRIC_CODES:  # refusals by the gate are counted as such
                self._services.metrics.errors.labels(exc.code).inc()
            status, answer = self.routes.error_answer(path, exc)
            extra.extend(refusal_headers(status))
            client.out.simple(status, answer, extra)
        except Exception:
            client.log.exception("HTTP request failed")
            failed = ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error", "internal")
            client.out.simple(*self.routes.error_answer(path, failed), extra)

    async def _route(
        self, request: h11.Request, headers: RequestHeaders, route: RouteRequest, peer: str
    ) -> None:
        method, path, extra, out = route.method, route.path, route.headers, route.out
        gate = self._gate
        gate.check_browser(headers, extra)
        if path in PROBES and method in ("GET", "HEAD") and self._plain is not None:
            # The probes need no token on a kept-alive connection either (aio/http.py).
            self._answer_plain(request, out, extra)
            return
        if method == "OPTIONS":
            gate.preflight(headers, extra)
            out.simple(HTTPStatus.NO_CONTENT, b"", extra)
            return
        gate.check_client(headers, peer=peer, now=asyncio.get_running_loop().time())
        if self._plain is not None and not is_api_target(request.method + b" " + request.target):
            # A keep-alive connection that asked /v1 before stays here: what
            # websockets answers on a new connection is answered here too.
            if method not in ("GET", "HEAD"):
                raise not_allowed(method, "GET, HEAD")
            self._answer_plain(request, out, extra)
            return
        entry = self.routes.find(path)
        if entry is None:
            raise no_route(method, path)
        if out.lost:
            return  # gone before its request could start: nothing to run for it
        await entry.route(route)

    def _answer_plain(self, request: h11.Request, out: Responder, extra: Headers) -> None:
        """A plain route's answer (the probes, /metrics, the page) on this connection."""
        assert self._plain is not None
        target = request.target.decode("ascii", "replace")
        given = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers]
        status, answer_headers, answer = self._plain(target, given)
        out.simple(status, answer, [*answer_headers, *extra])


def path_of(request: h11.Request) -> str:
    """The request's path without its query."""
    return request.target.decode("ascii", "replace").split("?", 1)[0]
