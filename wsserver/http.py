"""Plain HTTP on the WebSocket port, through websockets' ``process_request``.

A request that asks for a WebSocket upgrade continues to the handshake; any
other request is answered here: health probes, and the routes registered in
``Server.http_routes`` (the web page, metrics).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

if TYPE_CHECKING:
    from .server import Server

__all__ = ["process_request", "text_response"]


def text_response(status: HTTPStatus, body: str | bytes, content_type: str = "text/plain; charset=utf-8") -> Response:
    data = body.encode() if isinstance(body, str) else body
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
        ]
    )
    return Response(status.value, status.phrase, headers, data)


def _is_upgrade(request: Request) -> bool:
    upgrade = request.headers.get("Upgrade", "")
    return upgrade.lower() == "websocket"


def process_request(server: Server, connection: ServerConnection, request: Request) -> Response | None:
    if _is_upgrade(request):
        return None
    path = request.path.split("?", 1)[0]
    if path == "/healthz":
        return text_response(HTTPStatus.OK, "ok\n")
    if path == "/readyz":
        if server.ready.is_set():
            return text_response(HTTPStatus.OK, "ready\n")
        return text_response(HTTPStatus.SERVICE_UNAVAILABLE, "loading\n")
    handler = server.http_routes.get(path)
    if handler is not None:
        return handler(server, request)
    return text_response(HTTPStatus.NOT_FOUND, "not found\n")
