"""The chat page and the JS client, served on the WebSocket port.

``GET /`` answers with clients/web/index.html; its assets and the JS client
module (clients/js/wsserver.js) are served beside it. The files are package
data of ``wsserver.clients`` (clients/ in the checkout, wsserver/clients/ in an
installed wheel), found with :mod:`importlib.resources`, so an installed server
serves its page from any directory. In the editable install they are the
checkout's files, so an edit shows on the next reload: each is cached until its
modification time or size changes.

Every response carries a Content-Security-Policy that allows only this
origin's scripts and styles, and WebSocket connections back to the host the
page was loaded from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Final

from websockets.http11 import Request, Response

from .http import Route, text_response

__all__ = ["CLIENTS_DIR", "web_routes"]

#: The one resource root: ``web/`` and ``js/`` below it (see clients/__init__.py).
CLIENTS_DIR: Final[Traversable] = files("wsserver.clients")


@dataclass(frozen=True, slots=True)
class _Asset:
    path: Traversable
    content_type: str


_ASSETS: Final = {
    "/": _Asset(CLIENTS_DIR / "web" / "index.html", "text/html; charset=utf-8"),
    "/index.html": _Asset(CLIENTS_DIR / "web" / "index.html", "text/html; charset=utf-8"),
    "/app.js": _Asset(CLIENTS_DIR / "web" / "app.js", "text/javascript; charset=utf-8"),
    "/log.js": _Asset(CLIENTS_DIR / "web" / "log.js", "text/javascript; charset=utf-8"),
    "/markdown.js": _Asset(CLIENTS_DIR / "web" / "markdown.js", "text/javascript; charset=utf-8"),
    "/store.js": _Asset(CLIENTS_DIR / "web" / "store.js", "text/javascript; charset=utf-8"),
    "/sampling.js": _Asset(CLIENTS_DIR / "web" / "sampling.js", "text/javascript; charset=utf-8"),
    "/tools.js": _Asset(CLIENTS_DIR / "web" / "tools.js", "text/javascript; charset=utf-8"),
    "/pulls.js": _Asset(CLIENTS_DIR / "web" / "pulls.js", "text/javascript; charset=utf-8"),
    "/attach.js": _Asset(CLIENTS_DIR / "web" / "attach.js", "text/javascript; charset=utf-8"),
    "/style.css": _Asset(CLIENTS_DIR / "web" / "style.css", "text/css; charset=utf-8"),
    "/wsserver.js": _Asset(CLIENTS_DIR / "js" / "wsserver.js", "text/javascript; charset=utf-8"),
    # The page's markdown parser and sanitizer, vendored (clients/web/vendor/README.md).
    "/vendor/marked.esm.js": _Asset(
        CLIENTS_DIR / "web" / "vendor" / "marked.esm.js", "text/javascript; charset=utf-8"
    ),
    "/vendor/purify.es.mjs": _Asset(
        CLIENTS_DIR / "web" / "vendor" / "purify.es.mjs", "text/javascript; charset=utf-8"
    ),
}

# A Host header is copied into the policy only if it is a plain host[:port];
# anything else could smuggle policy directives.
_HOST_RE: Final = re.compile(
    r"[A-Za-z0-9.-]{1,253}(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]{2,45}\](:[0-9]{1,5})?"
)


def _content_security_policy(request: Request) -> str:
    # CSP Level 3 lets 'self' match ws:/wss: of the page's own host, but not
    # every browser in use implements that, so the host is named as well.
    host = request.headers.get("Host", "")
    sockets = f" ws://{host} wss://{host}" if _HOST_RE.fullmatch(host) else ""
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        f"connect-src 'self'{sockets}; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


class _FileCache:
    """Bytes of each asset, reread when the file's mtime or size changes."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, int, bytes]] = {}

    def read(self, path: Traversable) -> bytes:
        key = str(path)
        entry = self._entries.get(key)
        if not isinstance(path, Path):
            # Not on a file system (imported from a zip): the contents cannot change.
            if entry is None:
                entry = self._entries[key] = (0, 0, path.read_bytes())
            return entry[2]
        stat = path.stat()
        if entry is not None and entry[0] == stat.st_mtime_ns and entry[1] == stat.st_size:
            return entry[2]
        data = path.read_bytes()
        self._entries[key] = (stat.st_mtime_ns, stat.st_size, data)
        return data


def _serve(cache: _FileCache, asset: _Asset, request: Request) -> Response:
    # Methods other than GET/HEAD, and HEAD's empty body, are handled for every
    # route in wsserver.aio.http.process_request.
    try:
        body = cache.read(asset.path)
    except OSError:
        return text_response(
            HTTPStatus.NOT_FOUND, f"{asset.path.name} is missing from this install\n"
        )
    response = text_response(HTTPStatus.OK, body, asset.content_type)
    response.headers["Content-Security-Policy"] = _content_security_policy(request)
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


def web_routes() -> dict[str, Route]:
    """The page, its assets and the JS client, by path (for :class:`~wsserver.aio.http.HttpContext`)."""
    cache = _FileCache()
    return {route: _handler(cache, asset) for route, asset in _ASSETS.items()}


def _handler(cache: _FileCache, asset: _Asset) -> Route:
    def handle(request: Request) -> Response:
        return _serve(cache, asset, request)

    return handle
