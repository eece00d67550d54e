"""Who may use the OpenAI API: the WebSocket handshake's checks, per HTTP request.

:class:`Gate` runs what :mod:`wsserver.security` decides for a WebSocket
handshake: the connection limits once, when the connection is handed over
(:meth:`Gate.admit`, before any request is read); then per request Host;
Origin, when a browser sends one (then the CORS headers for that origin); a
request rate per client (:class:`RateLimiter`) and only then the token, so
that a client guessing tokens is slowed down like any other.
A refusal is an :class:`~wsserver.dialects.openai.api.ApiError` with OpenAI's error
object, counted in ``wsserver_handshakes_refused_total`` like a refused
handshake.
"""

from __future__ import annotations

import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final

from ..core.protocol import ID_PATTERN
from ..dialects.openai.api import ApiError
from ..security import ConnectionLimiter, Gatekeeper, Refusal, TokenBucket, client_group
from .metrics import Metrics

__all__ = ["Gate", "RateLimiter", "RequestHeaders", "request_id_of"]

Headers = list[tuple[str, str]]

_ID_RE: Final = re.compile(ID_PATTERN)
#: What a preflight may ask to send: header names (RFC 7230 tokens) and commas.
_HEADER_TOKENS: Final = re.compile(r"[A-Za-z0-9!#$%&'*+\-.^_`|~, ]{1,512}")
_ALLOW_HEADERS: Final = (
    "Authorization, Content-Type, X-Request-ID, X-Api-Key, Anthropic-Version, Anthropic-Beta"
)


class RequestHeaders:
    """Request headers by lower-case name (h11 lower-cases them already)."""

    __slots__ = ("_items",)

    def __init__(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        self._items = [(n.decode("ascii"), v.decode("latin-1")) for n, v in items]

    def all(self, name: str) -> list[str]:
        return [value for key, value in self._items if key == name]

    def one(self, name: str) -> str | None:
        values = self.all(name)
        return values[0] if len(values) == 1 else None


def request_id_of(headers: RequestHeaders) -> str:
    """The client's ``X-Request-ID`` if it is a valid request ID, else a new one."""
    given = headers.one("x-request-id")
    if given is not None and _ID_RE.fullmatch(given):
        return given
    return secrets.token_hex(8)


class RateLimiter:
    """Requests per client address group, a token bucket each (bounded in count)."""

    def __init__(self, *, rate: float, burst: int, clients: int = 4096) -> None:
        self._rate = rate
        self._burst = burst
        self._clients = clients
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def allow(self, ip: str, now: float) -> bool:
        if self._rate <= 0:
            return True
        group = client_group(ip)
        bucket = self._buckets.get(group)
        if bucket is None:
            bucket = TokenBucket(rate=self._rate, burst=self._burst, now=now)
            self._buckets[group] = bucket
            while len(self._buckets) > self._clients:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(group)
        return bucket.take(now)


@dataclass(frozen=True, slots=True, eq=False)
class Gate:
    """The checks of every OpenAI API request; built once by the server."""

    gatekeeper: Gatekeeper
    connection_limiter: ConnectionLimiter
    rate_limiter: RateLimiter
    metrics: Metrics

    def check_browser(self, headers: RequestHeaders, extra: Headers) -> None:
        """Host, then Origin if there is one; adds the CORS headers to ``extra``."""
        hosts = headers.all("host")
        self._check(self.gatekeeper.check_host(hosts))
        origins = headers.all("origin")
        if origins:
            # A browser: only the origins a WebSocket page may come from.
            self._check(self.gatekeeper.check_origin(origins, hosts))
            extra.extend(
                [
                    ("Access-Control-Allow-Origin", origins[0]),
                    ("Vary", "Origin"),
                    ("Access-Control-Expose-Headers", "X-Request-ID"),
                ]
            )

    def preflight(self, headers: RequestHeaders, extra: Headers) -> None:
        """A CORS preflight's answer headers (the origin is already vetted)."""
        asked = headers.one("access-control-request-headers")
        allowed = asked if asked is not None and _HEADER_TOKENS.fullmatch(asked) else _ALLOW_HEADERS
        extra.extend(
            [
                ("Access-Control-Allow-Methods", "GET, POST, OPTIONS"),
                ("Access-Control-Allow-Headers", allowed),
                ("Access-Control-Max-Age", "600"),
            ]
        )

    def admit(self, connection: Hashable, peer: str, alive: Callable[[], bool]) -> ApiError | None:
        """The connection limits, when the connection is handed over (before
        any of its request is read); the refusal, counted, or ``None``."""
        try:
            self._check(self.connection_limiter.admit(connection, peer, alive))
        except ApiError as exc:
            return exc
        return None

    def check_client(self, headers: RequestHeaders, *, peer: str, now: float) -> None:
        """The request rate, then the token: a client guessing tokens is slowed
        down (and logged at the rate) like any other."""
        if not self.rate_limiter.allow(peer, now):
            raise ApiError(
                HTTPStatus.TOO_MANY_REQUESTS, "too many requests; slow down", "rate_limited"
            )
        # The token as ``Authorization: Bearer`` or, as Anthropic's clients
        # send it, as one ``x-api-key`` header.
        gatekeeper = self.gatekeeper
        refusal = gatekeeper.check_auth(headers.all("authorization"), (), upgrade=False)
        api_keys = headers.all("x-api-key")
        if refusal is not None and len(api_keys) == 1:
            bearer = "Bearer " + api_keys[0].strip()
            refusal = gatekeeper.check_auth([bearer], (), upgrade=False)
        self._check(refusal)

    def _check(self, refusal: Refusal | None) -> None:
        if refusal is None:
            return
        self.metrics.handshakes_refused.labels(refusal.reason).inc()
        code = "invalid_api_key" if refusal.reason == "auth" else refusal.reason
        raise ApiError(refusal.status, refusal.message.strip(), code)
