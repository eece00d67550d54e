"""The server's resumable requests: which are detached, and for how long.

A resumable request is registered when its ``started`` (with the token) is
sent, and forgotten when its engine is gone. While its connection lives it is
*attached*; when the connection is lost the connection *parks* it here
(:meth:`Resumes.park`): the request keeps its slot and its channel — which
fills, so the engine pauses, exactly as for a slow reader — and a grace timer
(``stream.resume_grace_s``) starts. A ``resume`` on any connection
(:meth:`Resumes.claim`, then :meth:`Resumes.take`) cancels the timer and
attaches it there; when the timer fires first the request is stopped and
everything is freed, as a disconnect always did.

**Detached is just slow.** A detached request holds its model slot, so it is
judged as a client that reads nothing is: once its engine has waited on its
full channel for ``stream.stall_timeout_s`` while another request waits for
the model, it is cancelled (its resume then gets ``unknown_id``), whatever
is left of its grace. And parking is capped: at most
``stream.max_detached`` requests in total and ``max_detached_per_client``
per client address group; a request lost beyond them is cancelled at once,
as a request that is not resumable.

Request ids are chosen by clients and are unique only per connection, so the
registry is keyed by id *and* token: ids map to lists, and a token is compared
with :func:`hmac.compare_digest` (no timing oracle on the token).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..core.session import Parked
from ..errors import ProtocolError
from ..security import client_group
from .pipeline import Generation

__all__ = ["Resumes"]

log = logging.getLogger("wsserver.resume")


@dataclass(slots=True, eq=False)
class Record:
    """One resumable request: attached (``parked is None``) or detached.

    Its token is the request record's (``generation.resume_token``), kept there once.
    """

    generation: Generation
    parked: Parked | None = None
    timer: asyncio.TimerHandle | None = None
    #: The stall check of a detached request.
    watch: asyncio.TimerHandle | None = None
    #: The address group of the client whose connection was lost.
    client: str | None = None


class Resumes:
    """Every resumable request of one server, attached or detached."""

    def __init__(
        self,
        *,
        grace_s: float,
        stall_s: float = 0.0,
        waiting: Callable[[], int] = lambda: 0,
        max_total: int = 0,
        max_per_client: int = 0,
    ) -> None:
        self.grace_s = grace_s
        self.stall_s = stall_s
        self._waiting = waiting
        self.max_total = max_total
        self.max_per_client = max_per_client
        #: Requests cancelled as stalled while detached (tests, logs).
        self.stalled = 0
        self._records: dict[str, list[Record]] = {}
        #: Set when the server shuts down: nothing is parked any more.
        self.closing = False
        #: Requests whose grace ran out (metrics, tests).
        self.expired = 0
        #: Set whenever a request is parked (tests wait on it; they clear it).
        self.parked_event = asyncio.Event()

    # ------------------------------------------------------------ lifecycle

    def add(self, generation: Generation) -> None:
        """A resumable request's ``started`` (with its token) is going out."""
        self._records.setdefault(generation.request.id, []).append(Record(generation))

    def discard(self, generation: Generation) -> None:
        """The request's engine is gone: forget it (idempotent)."""
        request_id = generation.request.id
        records = self._records.get(request_id)
        if not records:
            return
        for record in records:
            if record.generation is generation:
                self._cancel_timer(record)
                records.remove(record)
                break
        if not records:
            del self._records[request_id]

    def park(self, generation: Generation, parked: Parked, client: str | None = None) -> bool:
        """Its connection was lost: keep it for ``grace_s``. False if the
        server is closing, the request is unknown, or the caps on detached
        requests are reached (then stop it)."""
        record = self._record(generation)
        if self.closing or record is None:
            return False
        group = None if client is None else client_group(client)
        detached = [r for r in self._all() if r.parked is not None]
        if self.max_total and len(detached) >= self.max_total:
            generation.log.info("connection lost; %d requests detached already", len(detached))
            return False
        if self.max_per_client and group is not None:
            mine = sum(1 for r in detached if r.client == group)
            if mine >= self.max_per_client:
                generation.log.info("connection lost; %d detached for %s already", mine, group)
                return False
        record.parked = parked
        record.client = group
        loop = asyncio.get_running_loop()
        record.timer = loop.call_later(self.grace_s, self._expire, record)
        if self.stall_s > 0:
            record.watch = loop.call_later(self._watch_interval, self._watch, record)
        self.parked_event.set()
        return True

    @property
    def _watch_interval(self) -> float:
        return max(0.01, min(0.25, self.stall_s / 4))

    def _watch(self, record: Record) -> None:
        """A detached request's stall check: the rule for a client that reads nothing."""
        record.watch = None
        if record.parked is None:
            return
        since = record.generation.channel.blocked_since
        if since is not None and time.monotonic() - since >= self.stall_s and self._waiting():
            record.generation.log.warning(
                "detached and its engine waited %.1fs while others wait for the model; cancelling",
                self.stall_s,
            )
            self.stalled += 1
            self._end(record)
            return
        record.watch = asyncio.get_running_loop().call_later(
            self._watch_interval, self._watch, record
        )

    def claim(self, request_id: str, token: str) -> Record:
        """The detached request ``request_id`` whose token is ``token``.

        Refused, in this order so that a wrong token learns nothing more:
        ``unknown_id`` (no resumable request has that id), ``invalid_token``,
        ``already_attached`` (its connection is alive: the server has not
        seen the old one go yet, or it was resumed elsewhere).
        """
        records = self._records.get(request_id)
        if not records:
            raise ProtocolError("unknown_id", f"no resumable request {request_id!r}", request_id)
        given = token.encode()
        for record in records:
            token_of = record.generation.resume_token or ""
            if hmac.compare_digest(token_of.encode(), given):
                if record.parked is None:
                    raise ProtocolError(
                        "already_attached",
                        f"request {request_id!r} is attached to a live connection",
                        request_id,
                    )
                return record
        raise ProtocolError("invalid_token", "wrong resume_token", request_id)

    def take(self, record: Record) -> Parked:
        """Attach a claimed request (its new connection adopted it)."""
        parked = record.parked
        assert parked is not None
        self._cancel_timer(record)
        record.parked = None
        return parked

    def drop(self, record: Record, now: float) -> None:
        """A ``cancel`` with the token: stop the detached request now."""
        self._cancel_timer(record)
        record.parked = None
        record.generation.cancel_at(now)
        self.discard(record.generation)

    def close(self) -> list[Generation]:
        """Server shutdown: stop every detached request; their generations."""
        self.closing = True
        stopped = []
        for record in self._all():
            if record.parked is not None:
                self._cancel_timer(record)
                record.generation.stop()
                stopped.append(record.generation)
        return stopped

    # ------------------------------------------------------------ inspection

    def detached(self) -> list[Generation]:
        """Generations of detached requests (no connection holds them)."""
        return [r.generation for r in self._all() if r.parked is not None]

    def held_bytes(self) -> int:
        """What the detached requests hold: replay tails and channels."""
        return sum(
            r.parked.held_bytes() + r.generation.channel.buffered_bytes()
            for r in self._all()
            if r.parked is not None
        )

    # ------------------------------------------------------------ helpers

    def _expire(self, record: Record) -> None:
        record.timer = None
        if record.parked is None:
            return
        record.generation.log.info(
            "no resume within %.1fs; cancelling", self.grace_s, extra={"grace_s": self.grace_s}
        )
        self.expired += 1
        self._end(record)

    def _end(self, record: Record) -> None:
        self._cancel_timer(record)
        record.parked = None
        record.generation.stop()
        self.discard(record.generation)

    def _record(self, generation: Generation) -> Record | None:
        for record in self._records.get(generation.request.id, ()):
            if record.generation is generation:
                return record
        return None

    def _all(self) -> list[Record]:
        return [r for records in list(self._records.values()) for r in list(records)]

    @staticmethod
    def _cancel_timer(record: Record) -> None:
        if record.timer is not None:
            record.timer.cancel()
            record.timer = None
        if record.watch is not None:
            record.watch.cancel()
            record.watch = None
