"""Image URLs fetched on a client's behalf, behind the operator's allow-list.

A dialect's parser (sans-I/O) leaves an ``http(s)`` image URL as an
:class:`~wsserver.core.images.ImageUrl`; before the request is submitted, the
route's way in (:meth:`wsserver.aio.exchange.Exchange.run`, the Responses API's
and Anthropic's ``count_tokens`` routes) fetches it here, on the event loop,
and the bytes then go through the checks a ``data:`` URL's do
(:func:`wsserver.core.images.fill_images`). Off while ``[images] fetch_hosts``
is empty: the URL is refused as before (:func:`~wsserver.core.images.not_fetched`).

Fetching a URL a client names lets any client make the server send requests
(server-side request forgery), so each fetch, one image at a time:

* **the allow-list**: the URL's host is one of ``fetch_hosts`` (a name, or
  ``*.`` and a domain: any name under it), on the port the entry names or
  else the scheme's default; ``https`` only unless ``fetch_http``; no
  user or password in the URL;
* **the addresses**: the name is resolved here, and every address it has must
  be public — loopback, private, link-local, shared (CGNAT), reserved and
  IPv4-mapped such addresses are refused unless ``fetch_private``; multicast
  and unspecified (``0.0.0.0`` reaches this machine) always;
* **pinned**: the connection goes to the addresses checked (a resolver that
  answers only those), so a name that resolves elsewhere a moment later
  (DNS rebinding) changes nothing; TLS still checks the certificate for the
  name;
* **no redirects**: a 3xx is refused (each hop would need the same checks;
  the client can give the final URL);
* **bounded**: ``Content-Length`` over the cap is refused before the body is
  read, and the body is read up to the cap and no further (then the
  connection is closed); the cap is ``fetch_max_bytes``, or what the
  request's 20 MiB of images leave; the whole fetch — resolving, connecting,
  the last byte — within ``fetch_timeout_s``;
* **nothing of the client's**: no cookies kept or sent, no header of the
  client's request forwarded, no proxy from the environment, no compression
  asked for (``Accept-Encoding: identity``);
* **cancelled** with its request: a client that disconnects, or the server's
  shutdown, cancels the fetch (:func:`fetch_for_route`).

aiohttp (already the openai backend's client) is imported on the first
fetch (on a worker thread: an import that takes a while must not stall the
event loop), so that a server that fetches nothing does not load it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import ipaddress
import socket
import sys
from collections.abc import Sequence
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Final, cast

from ..config import ImagesConfig
from ..core.images import MAX_IMAGE_BYTES, ImageUrl, fill_images, image_urls, not_fetched
from ..core.protocol import Generate
from ..dialects.api_errors import ApiError
from ..dialects.exchange import SHUTTING_DOWN
from ..errors import ProtocolError
from .http_route import RouteRequest
from .models import Model

if TYPE_CHECKING:
    from aiohttp.abc import AbstractResolver
    from yarl import URL

__all__ = ["fetch_for_route", "fetch_images", "fetched_generate"]

#: What an image fetch asks for (the formats the checks take).
_HEADERS: Final = {
    "Accept": "image/png, image/jpeg, image/gif, image/bmp",
    "Accept-Encoding": "identity",
    "User-Agent": "wsserver-image-fetch",
}
#: Bytes read at a time.
_CHUNK: Final = 1 << 16
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class _Refused(Exception):
    """A fetch refused; the text says why (the image's refusal is made from it)."""


async def fetch_images(
    config: ImagesConfig, urls: Sequence[ImageUrl], held: int
) -> dict[int, bytes]:
    """Each URL's bytes, by image index, fetched one after another; ``held``:
    the bytes of the request's other images. A refusal is ``bad_request``
    naming the image."""
    if urls and not config.fetch_hosts:
        raise ProtocolError("bad_request", not_fetched(urls[0]))
    fetched: dict[int, bytes] = {}
    for url in urls:
        room = min(config.fetch_max_bytes, MAX_IMAGE_BYTES - held)
        try:
            if room <= 0:
                raise _Refused(f"the request's images exceed {MAX_IMAGE_BYTES} bytes together")
            async with asyncio.timeout(config.fetch_timeout_s):
                data = await _fetch(config, url.url, room)
        except _Refused as exc:
            raise ProtocolError("bad_request", url.refusal(str(exc))) from None
        except TimeoutError:
            why = f"not fetched within {config.fetch_timeout_s:g} s ([images] fetch_timeout_s)"
            raise ProtocolError("bad_request", url.refusal(why)) from None
        fetched[url.index] = data
        held += len(data)
    return fetched


class _Fetching:
    """The connection's view of a request whose image URLs are being fetched."""

    def __init__(self, task: asyncio.Task[dict[int, bytes]]) -> None:
        self.task = task
        #: Why the fetch was cancelled: ``gone`` (the client), ``shutdown``.
        self.why: str | None = None

    def client_gone(self) -> None:
        self.why = "gone"
        self.task.cancel()

    def cancel(self) -> None:
        self.why = "shutdown"
        self.task.cancel()

    def stall(self) -> None:
        """Nothing is written while fetching: no stall to judge."""


async def fetch_for_route(
    route: RouteRequest, config: ImagesConfig, urls: Sequence[ImageUrl], held: int
) -> dict[int, bytes] | None:
    """:func:`fetch_images` for a request on an HTTP connection: cancelled
    when its client goes (then ``None``) or the server shuts down (503); a
    refusal is a 400 naming the image."""
    if route.out.lost:
        return None
    task = asyncio.create_task(fetch_images(config, urls, held))
    fetching = _Fetching(task)
    route.begin(fetching)
    try:
        fetched = await task
    except asyncio.CancelledError:
        if fetching.why is None:
            raise  # our own caller was cancelled
        if fetching.why == "gone":
            route.log.request(route.request_id).info("client disconnected while fetching images")
            return None
        raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, SHUTTING_DOWN, "cancelled") from None
    except ProtocolError as exc:
        error = ApiError.from_protocol(exc)
        error.param = urls[0].where.partition("[")[0] or None
        route.log.request(route.request_id).info("image URL refused: %s", exc.message)
        raise error from None
    size = sum(len(data) for data in fetched.values())
    route.log.request(route.request_id).info(
        "fetched %d image URL(s), %d bytes", len(fetched), size
    )
    return fetched


def _takes_images(model: Model) -> bool:
    """Whether ``model`` may read images: not known before it loads; a loaded
    text-only model's engine refuses a request's images itself (nothing is
    fetched for it)."""
    if model.state != "loaded":
        return True
    return "image" in (model.backend.input_modalities() or ())


async def fetched_generate(
    route: RouteRequest, config: ImagesConfig, generate: Generate, model: Model
) -> Generate | None:
    """``generate`` (for ``model``) with its image URLs' bytes in place, every
    image checked again as one request's (:func:`~wsserver.core.images.fill_images`);
    ``generate`` itself when it has none or ``model`` is loaded and reads no
    images (its refusal is the engine's); ``None``: the client went meanwhile."""
    urls = image_urls(generate.messages)
    if not urls or generate.messages is None or not _takes_images(model):
        return generate
    held = sum(len(image) for message in generate.messages for image in message.images)
    fetched = await fetch_for_route(route, config, urls, held)
    if fetched is None:
        return None
    try:
        fail = functools.partial(ProtocolError, "bad_request")
        messages = fill_images(generate.messages, fetched, fail)
    except ProtocolError as exc:
        error = ApiError.from_protocol(exc)
        error.param = urls[0].where.partition("[")[0] or None
        raise error from None
    return dataclasses.replace(generate, messages=messages)


# ------------------------------------------------------------------ one fetch


async def _fetch(config: ImagesConfig, text: str, room: int) -> bytes:
    if "aiohttp" not in sys.modules:  # its first import takes a while: not on the loop
        await asyncio.to_thread(importlib.import_module, "aiohttp")
    import aiohttp
    from yarl import URL

    try:
        url = URL(text)
    except ValueError:
        raise _Refused("not a valid URL") from None
    host, port = _allowed(config, url)
    addresses = await _addresses(config, host, port)
    connector = aiohttp.TCPConnector(
        resolver=cast("AbstractResolver", _Pinned(host, port, addresses)),
        use_dns_cache=False,
        force_close=True,
        limit=1,
    )
    async with aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        trust_env=False,
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None),
    ) as session:
        try:
            async with session.get(url, headers=_HEADERS, allow_redirects=False) as response:
                return await _body(response, room)
        except aiohttp.ClientError as exc:
            raise _Refused(f"could not be fetched: {_reason(exc)}") from None


def _allowed(config: ImagesConfig, url: URL) -> tuple[str, int]:
    """The URL's host (lower case, IDNA) and port, if the allow-list has them."""
    if url.scheme not in ("http", "https") or not url.raw_host:
        raise _Refused("not an http(s) URL")
    if url.scheme == "http" and not config.fetch_http:
        raise _Refused("plain http:// URLs are not fetched here (https only; [images] fetch_http)")
    if url.user is not None or url.password is not None:
        raise _Refused("a URL with a user or password is not fetched")
    host = url.raw_host.lower().rstrip(".")
    port = url.port if url.port is not None else _DEFAULT_PORTS[url.scheme]
    default = _DEFAULT_PORTS[url.scheme]
    for entry in config.fetch_hosts:
        name, wanted = _entry(entry)
        if (wanted is None and port != default) or (wanted is not None and port != wanted):
            continue
        if name == host or (name.startswith("*.") and host.endswith(name[1:])):
            return host, port
    shown = host if ":" not in host else f"[{host}]"
    raise _Refused(
        f"the host {shown}:{port} is not one this server fetches from ([images] fetch_hosts)"
    )


def _entry(entry: str) -> tuple[str, int | None]:
    """A ``fetch_hosts`` entry: its host (lower case, no brackets) and port."""
    entry = entry.lower()
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    host, colon, port = entry.partition(":")
    return host.rstrip("."), int(port) if colon else None


async def _addresses(config: ImagesConfig, host: str, port: int) -> list[Address]:
    """The addresses ``host`` has, each checked; refused if any is not fit."""
    try:
        addresses = [ipaddress.ip_address(host)]
    except ValueError:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise _Refused(f"its host {host} does not resolve ({exc.strerror or exc})") from None
        addresses = list(dict.fromkeys(ipaddress.ip_address(info[4][0]) for info in infos))
    for address in addresses:
        why = _unfit(address, private=config.fetch_private)
        if why is not None:
            raise _Refused(f"its host {host} resolves to {address}, {why} ([images] fetch_private)")
    return addresses


def _unfit(address: Address, *, private: bool) -> str | None:
    """Why the server does not connect to ``address``; ``None``: it may."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_multicast or address.is_unspecified:
        return "a multicast or unspecified address (never fetched from)"
    if private or address.is_global:
        return None
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    return "a private or reserved address"


class _Pinned:
    """aiohttp's resolver for one fetch: the checked addresses of its host only."""

    def __init__(self, host: str, port: int, addresses: list[Address]) -> None:
        self._host = host
        self._port = port
        self._addresses = addresses

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[dict[str, Any]]:
        if host.lower().rstrip(".") != self._host:
            raise OSError(f"{host} is not the host checked")
        return [
            {
                "hostname": host,
                "host": str(address),
                "port": port or self._port,
                "family": socket.AF_INET6 if address.version == 6 else socket.AF_INET,
                "proto": 0,
                "flags": socket.AI_NUMERICHOST,
            }
            for address in self._addresses
        ]

    async def close(self) -> None:
        """Nothing to release."""


async def _body(response: Any, room: int) -> bytes:
    """The response's body, at most ``room`` bytes, if it is an image's."""
    status = response.status
    if 300 <= status < 400:
        raise _Refused(
            f"the server answered {status}, a redirect (redirects are not followed: "
            "give the image's own URL)"
        )
    if status != HTTPStatus.OK:
        raise _Refused(f"the server answered {status}, not 200")
    kind = response.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    if kind and not kind.startswith("image/") and kind != "application/octet-stream":
        raise _Refused(f"the server answered with {kind[:60]}, not an image")
    length = response.headers.get("Content-Length")
    if length is not None and length.isdigit() and int(length) > room:
        raise _Refused(f"its Content-Length is {int(length)} bytes, over {room}")
    body = bytearray()
    while True:
        chunk = await response.content.read(min(_CHUNK, room + 1 - len(body)))
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > room:
            raise _Refused(f"it is over {room} bytes (reading stopped there)")


def _reason(exc: Exception) -> str:
    """An aiohttp error in a few words (no traceback, bounded)."""
    text = str(exc) or type(exc).__name__
    return text[:200]
