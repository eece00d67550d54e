"""One request as its client sees it, inside a session or parked (sans-I/O).

:class:`RequestRecord` is what :class:`~wsserver.core.session.Session` keeps about
the request its client considers running: state, times, counts, and for a
resumable request its token and :class:`~wsserver.core.replay.ReplayTail`. It is
its own object so that it can leave one session and join another: a request
whose connection was lost is a :class:`Parked` record until a ``resume``
adopts it (docs/protocol.md, "Resuming a stream").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .events import Outcome
from .protocol import Done, Generate, Progress, Timings, Usage
from .replay import ReplayTail

__all__ = ["Parked", "RequestRecord", "RequestState", "make_done"]


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"


@dataclass(slots=True)
class RequestRecord:
    request: Generate
    received: float
    state: RequestState = RequestState.WAITING
    started: float | None = None
    first_delta: float | None = None
    seq: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: Of those, the tokens of the model's reasoning.
    reasoning_tokens: int = 0
    position: int | None = None
    #: The download its ``queued`` frames last told of (its model's, from the Hub).
    download: Progress | None = None
    #: Only for a resumable request: its token (the one copy: the registry of
    #: resumable requests reads it here) and the deltas kept for a replay.
    resume_token: str | None = None
    tail: ReplayTail | None = None
    #: A resumable request's ``done``, once it was emitted.
    done: Done | None = None


class Parked:
    """A resumable request out of any session: its connection was lost.

    It holds what the client's view needs to go on — seq, timings, the replay
    tail — and, if the request finished meanwhile, its ``done``.
    """

    __slots__ = ("record",)

    def __init__(self, entry: RequestRecord) -> None:
        self.record = entry

    @property
    def id(self) -> str:
        return self.record.request.id

    @property
    def finished(self) -> bool:
        return self.record.done is not None

    @property
    def next_seq(self) -> int:
        return self.record.seq

    def held_bytes(self) -> int:
        """Wire bytes of the deltas kept for a replay."""
        tail = self.record.tail
        return 0 if tail is None else tail.bytes

    def cancelled_done(self, now: float) -> Done:
        """End it as ``cancelled`` (a ``cancel`` with its token): the one ``done``."""
        entry = self.record
        if entry.done is None:
            # Out of any session, the parked request is its record's only owner.
            entry.state = RequestState.DONE
            entry.done = make_done(entry, Outcome(reason="cancelled"), now)
        return entry.done


def make_done(entry: RequestRecord, outcome: Outcome, now: float) -> Done:
    """The request's one ``done`` frame, from its times and counts (the
    record's owner, a session or a parked request, marks it done)."""
    started = entry.started if entry.started is not None else now
    generating = max(now - started, 1e-9)
    # One rule for the count: the engine's own when it reports one (an
    # upstream's usage), else the record's count of what was delivered.
    completion = outcome.completion_tokens or entry.completion_tokens
    prompt = outcome.prompt_tokens or entry.prompt_tokens
    return Done(
        id=entry.request.id,
        reason=outcome.reason,
        usage=Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            reasoning_tokens=min(entry.reasoning_tokens, completion),
            cached_tokens=min(outcome.cached_tokens, prompt),
        ),
        timings=Timings(
            queued_ms=(started - entry.received) * 1000.0,
            ttft_ms=None
            if entry.first_delta is None
            else (entry.first_delta - entry.received) * 1000.0,
            total_ms=(now - entry.received) * 1000.0,
            tokens_per_s=completion / generating if entry.started is not None else 0.0,
        ),
        error_code=outcome.error_code,
        error_message=outcome.error_message,
        upstream_timings=outcome.upstream_timings,
        stop_sequence=outcome.stop_sequence,
        model=entry.request.model,
    )
