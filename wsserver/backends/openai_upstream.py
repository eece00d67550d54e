"""One upstream server of the openai backend, and one request's exchange with it.

:class:`Upstream` is what the engine knows of an OpenAI-compatible server:
the requests it has in flight, whether it is in rotation (and the backoff
and probe that bring it back), its counters, the models it lists.
:func:`exchange` is one request's exchange with one upstream: it POSTs the
request with ``stream: true``, checks the answer (an event stream, not
compressed), and reads the body a chunk at a time into the request's
:class:`~.openai_relay.Relay` — which waits for room in the request's sink
before the next read — within the first-byte and silence timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import aiohttp

from .base import GenerationRequest, Outcome
from .openai_relay import Relay
from .openai_wire import UpstreamError, error_message, request_body

__all__ = ["MAX_ERROR_BODY", "Upstream", "exchange"]

#: Most of an HTTP error body read to find the upstream's message.
MAX_ERROR_BODY = 65536


@dataclass(eq=False)
class Upstream:
    """One OpenAI-compatible server and what the engine knows of it."""

    url: str
    in_flight: int = 0
    #: Seconds until the next probe while it is out of rotation.
    backoff: float = 0.0
    errors: int = 0
    requests: int = 0
    #: Seconds from sending a request to the first byte of its stream: sum and count.
    first_byte_seconds_sum: float = 0.0
    first_byte_count: int = 0
    #: The model ids its ``/v1/models`` listed (empty until it answered).
    models: tuple[str, ...] = ()
    probe: asyncio.Task[None] | None = field(default=None, repr=False)
    #: Set while in rotation (tests and /readyz wait on it).
    in_rotation: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def __post_init__(self) -> None:
        self.in_rotation.set()

    @property
    def healthy(self) -> bool:
        return self.in_rotation.is_set()


async def exchange(
    session: aiohttp.ClientSession,
    upstream: Upstream,
    request: GenerationRequest,
    relay: Relay,
    model: str,
    *,
    first_byte_timeout_s: float,
    silence_timeout_s: float,
) -> Outcome:
    """One request's exchange with ``upstream``, asking for ``model``: the
    POST, then its event stream read into ``relay`` — the first byte within
    ``first_byte_timeout_s``, then no silence (no event) longer than
    ``silence_timeout_s``; each failure an :class:`~.openai_wire.UpstreamError`
    that says whether another upstream may be tried and whether this one is
    to be taken out of rotation. A complete response's connection goes back
    to the pool; any other is dropped, so that the upstream stops generating."""
    loop = asyncio.get_running_loop()
    path, body = request_body(request, model)
    sent = loop.time()
    deadline = sent + first_byte_timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            response = await session.post(upstream.url + path, data=body)
    except aiohttp.ConnectionTimeoutError:
        raise _unreachable(upstream, "timed out connecting") from None
    except TimeoutError:
        raise _first_byte_timeout(first_byte_timeout_s) from None
    except aiohttp.ClientConnectorError as exc:
        raise _unreachable(upstream, _connect_reason(exc)) from None
    except aiohttp.ClientError:
        raise UpstreamError(
            "the upstream closed the connection before answering",
            code="upstream_truncated",
            retry=True,
            unhealthy=True,
        ) from None
    clean = False
    try:
        if response.status >= 400:
            raise await _http_error(response, deadline)
        if response.content_type != "text/event-stream":
            # E.g. a server that ignored "stream": true and answered whole.
            raise UpstreamError(
                f"the upstream answered with Content-Type {response.content_type!r}, "
                "not an event stream",
                code="upstream_bad_stream",
            )
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise UpstreamError(
                f"the upstream answered with Content-Encoding {encoding[:40]!r}, "
                "though asked for identity",
                code="upstream_bad_stream",
            )
        relay.begin()
        first = True
        while not relay.done:
            try:
                # Silence is counted from the last event, not the last
                # byte: comments (": keep-alive") and blank lines are no content.
                async with asyncio.timeout_at(
                    deadline if first else relay.last_event + silence_timeout_s
                ):
                    data = await response.content.readany()
            except TimeoutError:
                if first:
                    raise _first_byte_timeout(first_byte_timeout_s) from None
                raise UpstreamError(
                    f"the upstream sent nothing for {silence_timeout_s:g} s mid-stream",
                    code="upstream_silent",
                    unhealthy=True,
                ) from None
            except aiohttp.ClientError:
                data = None  # the connection broke: as an end without the last chunk
            if first:
                first = False
                relay.last_event = loop.time()
                upstream.first_byte_seconds_sum += loop.time() - sent
                upstream.first_byte_count += 1
            if not data:
                if relay.finish is not None:
                    break  # ended after its last choice, only without [DONE]: accepted
                raise UpstreamError(
                    "the upstream's stream ended before its final chunk",
                    code="upstream_truncated",
                    retry=True,
                    unhealthy=True,
                )
            await relay.feed(data)
            # One read's work at a time: let the other connections run.
            await asyncio.sleep(0)  # sleep-ok: a yield, no time passes
        outcome = await relay.end()
        clean = relay.done and not relay.cut
        return outcome
    finally:
        if clean:
            response.release()  # complete: the connection goes back to the pool
        else:
            # Drop the connection now: the upstream sees its client leave
            # and stops generating. (A cancel arrives here too.)
            response.close()


async def _http_error(response: aiohttp.ClientResponse, deadline: float) -> UpstreamError:
    status = response.status
    body = b""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError):
        async with asyncio.timeout_at(deadline):
            body = await response.content.read(MAX_ERROR_BODY)
    message = error_message(status, body)
    if status == 429 or status >= 500:
        # Overloaded or broken: another upstream may serve it. A 5xx also
        # takes this one out of rotation; a 429 is a busy, working server.
        return UpstreamError(message, code="upstream_failed", retry=True, unhealthy=status >= 500)
    return UpstreamError(message, code="upstream_rejected")


def _unreachable(upstream: Upstream, reason: str) -> UpstreamError:
    return UpstreamError(
        f"cannot reach the upstream {upstream.url}: {reason}",
        code="upstream_unreachable",
        retry=True,
        unhealthy=True,
    )


def _first_byte_timeout(seconds: float) -> UpstreamError:
    return UpstreamError(
        f"the upstream sent nothing within {seconds:g} s of the request",
        code="upstream_timeout",
        retry=True,
        unhealthy=True,
    )


def _connect_reason(exc: aiohttp.ClientConnectorError) -> str:
    error = exc.os_error
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    return "connection failed"
