"""The seam between the HTTP/1.1 transport and the dialects it serves.

The transport (:mod:`wsserver.aio.openai_http`) reads a request, runs the
gate's checks and hands the request to a route; a route runs an
:class:`Exchange` (one request driven by the request driver) and writes its
answer through the connection's :class:`Responder`. The OpenAI
chat/completions dialect, the Responses API and Anthropic's Messages API
stand on this seam, so none imports another's modules. A dialect whose
errors are not OpenAI's object gives the transport an :data:`ErrorBody` for
its paths: every refusal there, the gate's included, is written its way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from ..api_errors import ApiError
from ..logs import ConnectionLog
from .driver import RequestDriver
from .pipeline import Generation

__all__ = ["ErrorBody", "Exchange", "Headers", "Responder", "Route", "RouteRequest"]

Headers = list[tuple[str, str]]


class Responder(Protocol):
    """What a request writes its response with (the HTTP connection)."""

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


class Exchange(Protocol):
    """A request running on an HTTP connection, as the connection sees it."""

    @property
    def driver(self) -> RequestDriver: ...

    def client_gone(self) -> None:
        """The client disconnected: that is a cancel."""

    def cancel(self) -> None:
        """Server shutdown: end the request as cancelled."""


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
    #: Tell the connection which exchange runs now (disconnect, shutdown, stall).
    begin: Callable[[Exchange], None]


#: Serves the requests under one path prefix; raises ``ApiError`` to refuse.
Route = Callable[[RouteRequest], Awaitable[None]]

#: A refusal as one dialect writes it: the status and the body (JSON).
ErrorBody = Callable[[ApiError], tuple[int, bytes]]
