"""Who may connect, and how much they may send.

Theory of operation
-------------------
A server on 127.0.0.1 is reachable from every web page the user visits: a
browser lets any page open ``ws://127.0.0.1:PORT``, and cannot set headers on a
WebSocket handshake. It does, however, always send ``Origin`` and ``Host``,
and it cannot forge them. So every handshake and HTTP request passes, in order:

1. **Host** — a DNS-rebinding attack makes the browser talk to us under the
   attacker's *host name*. An IP literal, ``localhost``, ``server.host`` and
   ``security.allowed_hosts`` are accepted; any other name is refused (403).
2. **Origin** (WebSocket handshakes only) — accepted when absent (non-browser
   clients; ``security.allow_missing_origin``), when it is the server's own
   origin (``http(s)://`` + the already checked Host), a loopback origin on any
   port, or listed in ``security.allowed_origins``. Otherwise 403.
3. **Token** (when ``security.auth_token`` is set) — ``Authorization: Bearer``
   for programs; for browsers, which cannot set headers, a
   ``Sec-WebSocket-Protocol`` offer of ``wsserver.v1`` plus ``bearer.TOKEN``
   (the server selects ``wsserver.v1``, so the token is never echoed); for a
   browser loading a page, HTTP Basic with the token as password. Compared in
   constant time. Otherwise 401. Only ``/healthz`` is exempt from 1-3, and
   ``/readyz`` from 2-3 (probes carry no secret; it tells why it is not
   ready only to a caller with the token).
4. **Connection limits** (handshakes only) — in total (503) and per client
   (429). A "client" is an address group, not an address (:func:`client_group`):
   an IPv4 address on its own, an IPv6 /64 (one host or LAN usually holds a
   whole /64, so counting single v6 addresses would be no limit at all), and
   all of loopback as one (127.0.0.2, .3, … are the same machine).

After the handshake a :class:`FrameLimiter` per connection meters client
frames with a :class:`TokenBucket`: excess frames are refused with
``rate_limited``, and a client that keeps flooding is disconnected (close
1008). The OpenAI API meters requests per client with the same bucket.

This module does no I/O: the HTTP layer (:mod:`wsserver.http`) feeds it
header values and acts on the :class:`Refusal` it returns.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final, Literal
from urllib.parse import urlsplit

from .config import Config

__all__ = [
    "BEARER_PREFIX",
    "SUBPROTOCOL",
    "ConnectionLimiter",
    "FrameLimiter",
    "Gatekeeper",
    "Refusal",
    "TokenBucket",
    "client_group",
    "exposure_warning",
    "select_subprotocol",
]

#: The subprotocol a browser offers (with ``bearer.TOKEN``) and the server selects.
SUBPROTOCOL: Final = "wsserver.v1"
BEARER_PREFIX: Final = "bearer."
_LOOPBACK_NAMES: Final = frozenset({"localhost"})
#: Window over which rate-limited frames are counted towards a flood.
FLOOD_WINDOW_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused, and the HTTP answer it gets."""

    status: HTTPStatus
    #: Short label for logs and the ``wsserver_handshakes_refused_total`` metric.
    reason: str
    message: str


def split_host(value: str) -> tuple[str, str | None]:
    """``"h:80"`` → ``("h", "80")``; ``"[::1]:80"`` → ``("::1", "80")``; lower-cased."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else None
    if value.count(":") == 1:
        host, _, port = value.partition(":")
        return host, port
    return value, None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(value: str) -> bytes:
    # Hashing first makes the comparison's time independent of the lengths too.
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


def offered_subprotocols(values: Sequence[str]) -> list[str]:
    """The subprotocols of every ``Sec-WebSocket-Protocol`` header value."""
    return [item.strip() for value in values for item in value.split(",") if item.strip()]


def select_subprotocol(offered: Sequence[str]) -> str | None:
    """Select ``wsserver.v1`` when offered; never a ``bearer.`` value."""
    return SUBPROTOCOL if SUBPROTOCOL in offered else None


class Gatekeeper:
    """Host, Origin and token checks (steps 1-3 above). Stateless after init."""

    def __init__(self, config: Config) -> None:
        security = config.security
        self._token_digest = _digest(security.auth_token) if security.auth_token else None
        self._allow_missing_origin = security.allow_missing_origin
        origins = {o.strip().lower().rstrip("/") for o in security.allowed_origins}
        self._any_origin = "*" in origins
        self._origins = frozenset(origins - {"*"})
        hosts = {h.strip().lower() for h in security.allowed_hosts}
        configured = split_host(config.server.host)[0]
        if configured and not _is_ip(configured):
            hosts.add(configured)
        self._any_host = "*" in hosts
        self._hosts = frozenset(hosts - {"*"})

    def check_host(self, values: Sequence[str]) -> Refusal | None:
        """Step 1: the ``Host`` header values of the request."""
        if not values:
            return None  # HTTP/1.0 or a bare client: no browser, no rebinding.
        if len(values) > 1:
            return Refusal(HTTPStatus.BAD_REQUEST, "host", "more than one Host header\n")
        host, _ = split_host(values[0])
        if self._any_host or _is_ip(host) or host in _LOOPBACK_NAMES or host in self._hosts:
            return None
        return Refusal(
            HTTPStatus.FORBIDDEN,
            "host",
            f"host {host[:100]!r} is not allowed (see security.allowed_hosts)\n",
        )

    def check_origin(self, values: Sequence[str], host_values: Sequence[str]) -> Refusal | None:
        """Step 2: the ``Origin`` header values of a handshake (Host already checked)."""
        if not values:
            if self._allow_missing_origin:
                return None
            return Refusal(HTTPStatus.FORBIDDEN, "origin", "an Origin header is required\n")
        if len(values) == 1 and self._origin_allowed(values[0], host_values):
            return None
        shown = values[0][:100] if len(values) == 1 else "(several)"
        return Refusal(
            HTTPStatus.FORBIDDEN,
            "origin",
            f"origin {shown!r} is not allowed (see security.allowed_origins)\n",
        )

    def _origin_allowed(self, origin: str, host_values: Sequence[str]) -> bool:
        normalized = origin.strip().lower().rstrip("/")
        if self._any_origin or normalized in self._origins:
            return True
        try:
            parts = urlsplit(normalized)
            hostname = parts.hostname or ""
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or parts.path or parts.query:
            return False
        if _is_loopback(hostname):
            return True
        # The server's own page: the origin the browser used to reach us, whose
        # host name step 1 has vetted.
        return len(host_values) == 1 and parts.netloc == host_values[0].strip().lower()

    def check_auth(
        self,
        authorization: Sequence[str],
        subprotocols: Sequence[str],
        *,
        upgrade: bool,
    ) -> Refusal | None:
        """Step 3: ``Authorization`` values and offered subprotocols."""
        if self._token_digest is None:
            return None
        for candidate in self._candidates(authorization, subprotocols if upgrade else ()):
            if hmac.compare_digest(_digest(candidate), self._token_digest):
                return None
        return Refusal(HTTPStatus.UNAUTHORIZED, "auth", "missing or wrong token\n")

    @staticmethod
    def _candidates(authorization: Sequence[str], subprotocols: Sequence[str]) -> list[str]:
        found: list[str] = []
        if len(authorization) == 1:
            scheme, _, credentials = authorization[0].strip().partition(" ")
            credentials = credentials.strip()
            if scheme.lower() == "bearer":
                found.append(credentials)
            elif scheme.lower() == "basic":
                try:
                    decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
                except (binascii.Error, UnicodeDecodeError):
                    decoded = ""
                # Any user name; the token is the password.
                found.append(decoded.partition(":")[2])
        if SUBPROTOCOL in subprotocols:
            found.extend(
                s[len(BEARER_PREFIX) :] for s in subprotocols if s.startswith(BEARER_PREFIX)
            )
        return found[:4]


def client_group(ip: str) -> str:
    """The address group that the per-client connection limit counts.

    Loopback (127.0.0.0/8 and ::1) is one group; an IPv4-mapped IPv6 address
    counts as its IPv4 address; any other IPv6 address counts as its /64;
    other IPv4 addresses count on their own. A string that is no IP address
    (a Unix socket, a test double) is its own group.
    """
    try:
        address = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback:
        return "loopback"
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class ConnectionLimiter:
    """Counts admitted WebSocket connections, in total and per client IP (step 4).

    A connection is admitted at its handshake and released when it ends. A
    handshake that fails after admission never reaches the handler that would
    release it, so each entry carries an ``alive`` check and dead entries are
    dropped whenever the limiter counts.
    """

    def __init__(self, *, max_total: int, max_per_ip: int) -> None:
        self._max_total = max_total
        self._max_per_ip = max_per_ip
        self._admitted: dict[Hashable, tuple[str, Callable[[], bool]]] = {}

    def _prune(self) -> None:
        dead = [key for key, (_, alive) in self._admitted.items() if not alive()]
        for key in dead:
            del self._admitted[key]

    def admit(self, key: Hashable, ip: str, alive: Callable[[], bool]) -> Refusal | None:
        """Admit a connection from ``ip``, or say why not (counted by :func:`client_group`)."""
        self._prune()
        ip = client_group(ip)
        if self._max_total and len(self._admitted) >= self._max_total:
            return Refusal(
                HTTPStatus.SERVICE_UNAVAILABLE,
                "connections",
                f"the server already has {self._max_total} connections\n",
            )
        if self._max_per_ip:
            mine = sum(1 for other_ip, _ in self._admitted.values() if other_ip == ip)
            if mine >= self._max_per_ip:
                return Refusal(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    "connections_per_ip",
                    f"{ip} already has {self._max_per_ip} connections\n",
                )
        self._admitted[key] = (ip, alive)
        return None

    def release(self, key: Hashable) -> None:
        self._admitted.pop(key, None)

    def count(self, ip: str | None = None) -> int:
        """Admitted connections, in all or from ``ip``'s address group."""
        self._prune()
        ip = None if ip is None else client_group(ip)
        return sum(1 for other, _ in self._admitted.values() if ip is None or other == ip)


Verdict = Literal["ok", "limited", "flood"]


class TokenBucket:
    """A rate with bursts: ``rate`` tokens a second refill a bucket of ``burst``.

    Each :meth:`take` costs one token and is refused while the bucket is
    empty. ``rate`` 0 means no limit. The clock is the caller's (``now``,
    in seconds), so tests need no sleeps.
    """

    __slots__ = ("_burst", "_last", "_rate", "_tokens")

    def __init__(self, *, rate: float, burst: int, now: float) -> None:
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._last = now

    def take(self, now: float) -> bool:
        """Take one token if there is one; ``False`` when the bucket is empty."""
        if self._rate <= 0:
            return True
        elapsed = max(0.0, now - self._last)
        self._last = now
        self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class FrameLimiter:
    """One connection's frames: a :class:`TokenBucket`, plus flood detection.

    A frame that finds the bucket empty is ``"limited"``; the
    ``close_after``-th limited frame within :data:`FLOOD_WINDOW_S` seconds is
    ``"flood"``. ``rate`` 0 disables the limiter.
    """

    __slots__ = ("_bucket", "_close_after", "_refused")

    def __init__(self, *, rate: float, burst: int, close_after: int, now: float) -> None:
        self._bucket = TokenBucket(rate=rate, burst=burst, now=now)
        self._close_after = close_after
        self._refused: deque[float] = deque(maxlen=close_after)

    def check(self, now: float) -> Verdict:
        if self._bucket.take(now):
            return "ok"
        self._refused.append(now)
        if len(self._refused) >= self._close_after and now - self._refused[0] <= FLOOD_WINDOW_S:
            return "flood"
        return "limited"


def exposure_warning(config: Config) -> str | None:
    """A warning when the server listens beyond loopback without a token."""
    host = split_host(config.server.host)[0]
    if config.security.auth_token or _is_loopback(host):
        return None
    return (
        f"listening on {config.server.host!r}, beyond loopback, without authentication: "
        "anyone who can reach this port can use the model. Set WSSERVER_SECURITY_AUTH_TOKEN."
    )
