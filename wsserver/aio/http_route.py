"""The seam between the HTTP/1.1 transport and the dialects it serves.

The transport (:mod:`wsserver.aio.openai_http`) reads a request, and the
router (:mod:`wsserver.aio.http_router`) runs the gate's checks and hands it to
the route its path is registered to. A route parses the body into the core's
request and runs it on the HTTP exchange (:mod:`wsserver.aio.exchange`),
whose answer goes out through the connection's :class:`Responder`; the
connection knows the exchange running on it as a :class:`Running` (a
disconnect, the server's shutdown, a stall). Every dialect stands on this
seam, so none imports another's modules. A dialect whose errors are not
OpenAI's object gives the router an :data:`ErrorBody` for its paths: every
refusal there, the gate's included, is written its way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, Protocol

from ..dialects.api_errors import ApiError
from ..logs import ConnectionLog
from .pipeline import Generation

__all__ = [
    "MAX_ECHO",
    "ErrorBody",
    "Headers",
    "Responder",
    "Route",
    "RouteRequest",
    "Running",
    "clip",
    "no_route",
    "not_allowed",
]

Headers = list[tuple[str, str]]

#: The most of a client's input (a path, a model name) echoed in an answer or a log line.
MAX_ECHO: Final = 100


class Responder(Protocol):
    """What a request writes its response with (the HTTP connection's write side)."""

    @property
    def lost(self) -> bool: ...

    @property
    def paused(self) -> bool: ...

    def start(self, status: int, headers: Headers) -> None: ...

    def send(self, data: bytes) -> None:
        """Write body bytes now (nothing is written once the client is gone)."""

    async def drain(self) -> None:
        """Wait while the transport is above its high-water mark."""

    def end(self) -> None: ...

    def simple(self, status: int, body: bytes, headers: Headers | None = None) -> None:
        """A whole response, if one may start (a ``HEAD`` gets its head only);
        JSON unless ``headers`` name their own ``Content-Type``."""


class Running(Protocol):
    """A request running on an HTTP connection, as the connection sees it."""

    def client_gone(self) -> None:
        """The client disconnected: that is a cancel."""

    def cancel(self) -> None:
        """Server shutdown: end the request as cancelled."""

    def stall(self) -> None:
        """The client read nothing for the stall timeout."""


@dataclass(frozen=True, slots=True, eq=False)
class RouteRequest:
    """One vetted HTTP request, handed to a route."""

    method: str
    #: The path without its query.
    path: str
    body: bytes
    request_id: str
    out: Responder
    #: Headers every answer carries (X-Request-ID, CORS).
    headers: Headers
    log: ConnectionLog
    #: The connection's live generations (a driver's shared table).
    generations: dict[str, Generation]
    on_gone: Callable[[Generation], None]
    #: Tell the connection which request runs now (disconnect, shutdown, stall).
    begin: Callable[[Running], None]


#: Serves the requests under one path; raises ``ApiError`` to refuse.
Route = Callable[[RouteRequest], Awaitable[None]]

#: A refusal as one dialect writes it: the status and the body (JSON).
ErrorBody = Callable[[ApiError], tuple[int, bytes]]


def clip(text: str) -> str:
    """A client's input as it may be echoed: at most :data:`MAX_ECHO` characters."""
    return text if len(text) <= MAX_ECHO else text[:MAX_ECHO] + "…"


def not_allowed(method: str, allowed: str) -> ApiError:
    """405: a method the route does not serve."""
    return ApiError(
        HTTPStatus.METHOD_NOT_ALLOWED,
        f"{clip(method)} is not allowed here; use {allowed}",
        "bad_request",
    )


def no_route(method: str, path: str) -> ApiError:
    """404: nothing is served at this path."""
    return ApiError(HTTPStatus.NOT_FOUND, f"no route {clip(method)} {clip(path)}", "not_found")
