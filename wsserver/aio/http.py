"""Plain HTTP on the WebSocket port, through websockets' ``process_request``.

A request that asks for a WebSocket upgrade continues to the handshake; any
other request is answered here: health probes, the routes in
:attr:`HttpContext.routes` (the web page), and ``/metrics``. Only GET and HEAD
are served (405 otherwise); everything but ``/healthz`` first passes the Host,
Origin, token and connection-limit checks of :mod:`wsserver.security` —
``/readyz`` only the Host check.

The probes need no token because an orchestrator's probe carries no secret
(nor does llama-server's ``/health``). ``/readyz`` then says only ready or
not ready; why not (an engine stalled, a model loading — never a request's id
or content) only to a caller with the token, when one is set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.protocol import State

from ..errors import AUTH_CHALLENGE, refusal_headers
from ..security import ConnectionLimiter, Gatekeeper, Refusal, offered_subprotocols
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics

__all__ = ["HttpContext", "Route", "process_request", "text_response"]

#: Answers one plain HTTP GET (HEAD is derived from it).
Route = Callable[[Request], Response]


@dataclass(frozen=True, slots=True, eq=False)
class HttpContext:
    """What answering plain HTTP uses; built once by the server."""

    gatekeeper: Gatekeeper
    connection_limiter: ConnectionLimiter
    metrics: Metrics
    #: Whether the model has loaded (``/readyz``).
    is_ready: Callable[[], bool]
    #: Slots the scheduler holds for no live request (``/readyz``).
    orphaned_slots: Callable[[], list[str]]
    #: Why the engine cannot serve now, or None (``/readyz``; an upstream engine's health).
    engine_unready: Callable[[], str | None] = lambda: None
    #: Extra routes (path → handler), such as the web page.
    routes: dict[str, Route] = field(default_factory=dict)


log = logging.getLogger("wsserver.http")


def text_response(
    status: HTTPStatus, body: str | bytes, content_type: str = "text/plain; charset=utf-8"
) -> Response:
    data = body.encode() if isinstance(body, str) else body
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
            # websockets half-closes the connection after any HTTP answer and
            # waits for the peer to close; without this header a browser keeps
            # the socket for reuse, holding that wait (and a server stop) up.
            ("Connection", "close"),
        ]
    )
    return Response(status.value, status.phrase, headers, data)


def _hosts(request: Request) -> list[str]:
    return request.headers.get_all("Host")


def _vet(
    http: HttpContext, connection: ServerConnection, request: Request, *, upgrade: bool
) -> Refusal | None:
    """Host, Origin, token and connection limits, in that order."""
    headers = request.headers
    gate = http.gatekeeper
    hosts = _hosts(request)
    refusal = gate.check_host(hosts)
    if refusal is None and upgrade:
        refusal = gate.check_origin(headers.get_all("Origin"), hosts)
    if refusal is None:
        offered = offered_subprotocols(headers.get_all("Sec-WebSocket-Protocol"))
        refusal = gate.check_auth(headers.get_all("Authorization"), offered, upgrade=upgrade)
    if refusal is None and upgrade:
        peer = connection.remote_address
        refusal = http.connection_limiter.admit(
            connection,
            peer[0] if peer else "?",
            lambda: connection.protocol.state is not State.CLOSED,
        )
    return refusal


def _is_upgrade(request: Request) -> bool:
    # get_all: a repeated header must not raise (MultipleValuesError) here.
    return any(value.strip().lower() == "websocket" for value in request.headers.get_all("Upgrade"))


def process_request(
    http: HttpContext, connection: ServerConnection, request: Request
) -> Response | None:
    """Answer plain HTTP, or vet a WebSocket handshake (``None`` lets it proceed).

    Every request but ``/healthz`` passes the checks of :mod:`wsserver.security`
    (``/readyz`` only the Host check).
    """
    response = _respond(http, connection, request)
    if response is not None and request.method == "HEAD":
        # Same headers (Content-Length included) as GET, no body.
        response = Response(response.status_code, response.reason_phrase, response.headers, b"")
    return response


def _respond(http: HttpContext, connection: ServerConnection, request: Request) -> Response | None:
    path = request.path.split("?", 1)[0]
    if request.method not in ("GET", "HEAD"):
        response = text_response(HTTPStatus.METHOD_NOT_ALLOWED, "method not allowed\n")
        response.headers["Allow"] = "GET, HEAD"
        return response
    if path == "/healthz":
        return text_response(HTTPStatus.OK, "ok\n")
    upgrade = _is_upgrade(request) and request.method == "GET"
    if path == "/readyz" and not upgrade and http.gatekeeper.check_host(_hosts(request)) is None:
        return plain_response(http, request)
    refusal = _vet(http, connection, request, upgrade=upgrade)
    if refusal is not None:
        http.metrics.handshakes_refused.labels(refusal.reason).inc()
        peer = connection.remote_address
        log.info(
            "refused %s %s from %s: %d %s",
            "handshake" if upgrade else "request",
            path[:100],
            peer[0] if peer else "?",
            refusal.status.value,
            refusal.message.strip(),
            extra={"status": refusal.status.value, "refusal": refusal.reason},
        )
        response = text_response(refusal.status, refusal.message)
        for name, value in refusal_headers(refusal.status, challenge=AUTH_CHALLENGE):
            response.headers[name] = value
        return response
    if upgrade:
        return None
    return plain_response(http, request)


def plain_answer(
    http: HttpContext, target: str, headers: list[tuple[str, str]]
) -> tuple[int, list[tuple[str, str]], bytes]:
    """:func:`plain_response` for a request read elsewhere (status, headers,
    body), without websockets' own ``Connection`` header."""
    response = plain_response(http, Request(target, Headers(headers)))
    kept = [(k, v) for k, v in response.headers.raw_items() if k.lower() != "connection"]
    return response.status_code, kept, bytes(response.body)


def plain_response(http: HttpContext, request: Request) -> Response:
    """A vetted ``GET``/``HEAD`` of a plain route: the probes, ``/metrics``,
    the page. Also what an HTTP connection kept alive by the OpenAI handler
    answers for these paths (:mod:`wsserver.aio.openai_http`)."""
    path = request.path.split("?", 1)[0]
    if path == "/healthz":
        return text_response(HTTPStatus.OK, "ok\n")
    if path == "/metrics":
        return text_response(HTTPStatus.OK, http.metrics.render(), METRICS_CONTENT_TYPE)
    if path == "/readyz":
        why = _unready(http)
        if why is None:
            return text_response(HTTPStatus.OK, "ready\n")
        token = http.gatekeeper.check_auth(
            request.headers.get_all("Authorization"), (), upgrade=False
        )
        # Public: the reason only to a caller who could read /metrics anyway.
        return text_response(
            HTTPStatus.SERVICE_UNAVAILABLE, why if token is None else "not ready\n"
        )
    handler = http.routes.get(path)
    if handler is not None:
        return handler(request)
    return text_response(HTTPStatus.NOT_FOUND, "not found\n")


def _unready(http: HttpContext) -> str | None:
    """Why ``/readyz`` is 503 (a line), or None: ready."""
    if not http.is_ready():
        return "loading\n"
    unready = http.engine_unready()
    if unready:
        return unready + "\n"
    orphans = http.orphaned_slots()
    if orphans:
        return f"scheduler books do not balance: slot(s) {orphans} held by no request\n"
    return None
