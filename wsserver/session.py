"""The per-connection request state machine (sans-I/O).

Theory of operation
-------------------
A connection runs at most one request at a time. The client sees a request go
through ``accepted → (queued) → started → delta* → done``; the server also has
to track the *producer* (the generation thread), whose life does not match the
client's view: after a ``cancel`` the client gets ``done`` at once, while the
producer may need one more model step to notice and exit. The session keeps
both views:

* ``active`` is the request the client considers running (``None`` after its
  ``done`` was emitted). Frames for any other ID are refused or dropped.
* ``producer`` is the ID whose producer thread is still alive. A new request is
  accepted while an old producer winds down, but its :class:`StartGeneration`
  effect is held back until :meth:`Session.producer_stopped` reports the old
  thread gone, so two producers of one connection never overlap.

The I/O layer feeds the session with client frames (:meth:`Session.handle`,
:meth:`Session.refuse`) and with what happens to a request
(:meth:`Session.queued`, :meth:`Session.started`,
:meth:`Session.prompt_processed`, :meth:`Session.delta`,
:meth:`Session.finish`, :meth:`Session.reject`,
:meth:`Session.producer_stopped`). Every one of them returns a list of
effects, which the I/O layer carries out in order in one place: every frame,
and so every ``done`` and ``error`` with its log line and metrics, leaves that
way. Methods take ``now`` (a monotonic time in seconds): request times are
kept here, once, deterministically — the ``done`` frame's timings and the log's
(:meth:`Session.since_received_ms`) come from the same clock readings.

Request states and the events that move them (rows not listed are refused)::

    state      event                      next       effects
    ---------  -------------------------  ---------  -----------------------------------
    (none)     generate / restart(new)    WAITING    StartGeneration (maybe deferred)
    WAITING    queued(position)           WAITING    Send(queued)
    WAITING    started                    RUNNING    Send(started)
    WAITING    reject (model queue full)  DONE       Send(error overloaded), no done
    WAITING    cancel / restart(old)      DONE       StopGeneration, Send(done cancelled)
    RUNNING    delta                      RUNNING    Send(delta)
    RUNNING    finish(outcome)            DONE       Send(done stop|length|error)
    RUNNING    cancel / restart(old)      DONE       StopGeneration, Send(done cancelled)
    DONE       any producer report        DONE       nothing (late reports are dropped)

Because a request leaves ``WAITING``/``RUNNING`` exactly once, it gets exactly
one ``done``, and nothing for its ID is emitted after it.

A *resumable* request (``started`` carried a token) also keeps the deltas it
sent in a bounded :class:`~wsserver.replay.ReplayTail`. When its connection is
lost, :meth:`Session.detach` takes it out of this session as a
:class:`Parked` request (the same state: seq, timings, tail), and another
connection's session takes it in with :meth:`Session.adopt`, which replays the
tail after the client's ``after_seq``; the request then goes on as if it had
always been that session's. A request whose ``done`` was written into a
connection that broke is parked too, finished: its resume replays the tail
and the ``done``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass

from .backends.base import Outcome
from .errors import ProtocolError
from .protocol import (
    Cancel,
    ClientFrame,
    Delta,
    Done,
    Error,
    Generate,
    Queued,
    Restart,
    Resumed,
    ServerFrame,
    Started,
)
from .replay import ReplayTail
from .request_record import Parked, RequestRecord, RequestState, make_done

__all__ = [
    "Effect",
    "Parked",
    "RequestState",
    "Send",
    "Session",
    "StartGeneration",
    "StopGeneration",
]


@dataclass(frozen=True, slots=True)
class Send:
    """Send this frame to the client."""

    frame: ServerFrame


@dataclass(frozen=True, slots=True)
class StartGeneration:
    """Acquire the model and start a producer for this request."""

    request: Generate


@dataclass(frozen=True, slots=True)
class StopGeneration:
    """Stop the producer of this request (it may be waiting for the model)."""

    id: str


Effect = Send | StartGeneration | StopGeneration


def input_size(request: Generate) -> int:
    """The memory a request's input holds: its strings as Python stores them."""
    if request.prompt is not None:
        return sys.getsizeof(request.prompt)
    return sum(sys.getsizeof(m.content) + sys.getsizeof(m.role) for m in request.messages or ())


class Session:
    """State of one connection. Not thread-safe: drive it from one thread."""

    def __init__(
        self,
        *,
        id_memory: int = 1000,
        restart_memory: int = 16,
        restart_bytes: int = 1 << 19,
        resume_tail_bytes: int = 1 << 18,
    ) -> None:
        self._id_memory = id_memory
        self._resume_tail_bytes = resume_tail_bytes
        #: The last resumable request that ended here (its done may be lost).
        self._finished: RequestRecord | None = None
        # Inputs kept for ``restart``: at most ``restart_memory`` of them and
        # ``restart_bytes`` of text — bytes, not a count, bound the memory of
        # an idle connection — but always the newest, whatever its size.
        self._restart_memory = restart_memory
        self._restart_bytes = restart_bytes
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._inputs: OrderedDict[str, tuple[Generate, int]] = OrderedDict()
        self._inputs_size = 0
        self._active: RequestRecord | None = None
        self._producer: str | None = None
        self._deferred: RequestRecord | None = None

    # ------------------------------------------------------------ inspection

    @property
    def active_id(self) -> str | None:
        """The request the client considers running, if any."""
        return None if self._active is None else self._active.request.id

    @property
    def producer_id(self) -> str | None:
        """The request whose producer is alive (or about to start), if any."""
        return self._producer

    def state_of(self, request_id: str) -> RequestState | None:
        if self._active is not None and self._active.request.id == request_id:
            return self._active.state
        return RequestState.DONE if request_id in self._seen else None

    # ------------------------------------------------------------ client frames

    def handle(self, frame: ClientFrame, now: float) -> list[Effect]:
        """Apply a client frame. Refusals come back as an ``error`` frame."""
        try:
            if isinstance(frame, Generate):
                return self._accept(frame, now)
            if isinstance(frame, Cancel):
                return self._cancel(frame.id, now)
            if isinstance(frame, Restart):
                return self._restart(frame, now)
            # A resume concerns a request of no session: the connection looks
            # it up and calls adopt().
            raise ProtocolError("bad_request", "resume is not handled here", frame.id)
        except ProtocolError as exc:
            return [Send(Error(id=exc.request_id, code=exc.code, message=exc.message))]

    def refuse(self, exc: ProtocolError) -> list[Effect]:
        """Turn a parse error into the ``error`` frame the client gets."""
        return [Send(Error(id=exc.request_id, code=exc.code, message=exc.message))]

    def _accept(self, request: Generate, now: float) -> list[Effect]:
        if request.id in self._seen:
            raise ProtocolError("duplicate_id", f"id {request.id!r} was already used", request.id)
        if self._active is not None:
            raise ProtocolError(
                "busy", f"request {self._active.request.id!r} is still running", request.id
            )
        self._remember(request)
        entry = RequestRecord(request=request, received=now)
        self._active = entry
        if self._producer is not None:
            # The previous producer is still winding down; start when it is gone.
            entry.deferred = True
            self._deferred = entry
            return []
        self._producer = request.id
        return [StartGeneration(request)]

    def _cancel(self, request_id: str, now: float) -> list[Effect]:
        active = self._active
        if active is None or active.request.id != request_id:
            raise ProtocolError("unknown_id", f"no running request {request_id!r}", request_id)
        return self._end_cancelled(active, now)

    def _restart(self, frame: Restart, now: float) -> list[Effect]:
        kept = self._inputs.get(frame.id)
        if kept is None:
            raise ProtocolError(
                "unknown_id", f"no recent request {frame.id!r} to restart", frame.new_id
            )
        if frame.new_id in self._seen:
            raise ProtocolError(
                "duplicate_id", f"id {frame.new_id!r} was already used", frame.new_id
            )
        effects: list[Effect] = []
        active = self._active
        if active is not None:
            if active.request.id != frame.id:
                raise ProtocolError(
                    "busy", f"request {active.request.id!r} is still running", frame.new_id
                )
            effects.extend(self._end_cancelled(active, now))
        new = frame.apply(kept[0])
        if new.prompt is None and new.messages is None:  # pragma: no cover - apply() keeps one
            raise ProtocolError("bad_request", "restart has no input", frame.new_id)
        effects.extend(self._accept(new, now))
        return effects

    def _end_cancelled(self, entry: RequestRecord, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if entry.deferred:
            # Never started: there is no producer of its own to stop.
            self._deferred = None
        else:
            effects.append(StopGeneration(entry.request.id))
        effects.append(Send(self._done(entry, Outcome(reason="cancelled"), now)))
        return effects

    def _remember(self, request: Generate) -> None:
        self._seen[request.id] = None
        while len(self._seen) > self._id_memory:
            self._seen.popitem(last=False)
        size = input_size(request)
        self._inputs[request.id] = (request, size)
        self._inputs_size += size
        while len(self._inputs) > 1 and (
            len(self._inputs) > self._restart_memory or self._inputs_size > self._restart_bytes
        ):
            _, (_, dropped) = self._inputs.popitem(last=False)
            self._inputs_size -= dropped

    @property
    def resume_bytes(self) -> int:
        """Wire bytes of the replay tails this session holds (a resumable
        request's, running or just finished)."""
        held = 0
        for entry in (self._active, self._finished):
            if entry is not None and entry.tail is not None:
                held += entry.tail.bytes
        return held

    @property
    def restart_bytes(self) -> int:
        """Memory held by the inputs kept for ``restart`` (see :func:`input_size`)."""
        return self._inputs_size

    # ------------------------------------------------------------ producer reports

    def queued(self, request_id: str, position: int) -> list[Effect]:
        """The request's place in the model's queue changed."""
        entry = self._current(request_id)
        if entry is None or entry.state is not RequestState.WAITING or entry.position == position:
            return []
        entry.position = position
        return [Send(Queued(id=request_id, position=position))]

    def started(self, request_id: str, now: float, resume_token: str | None = None) -> list[Effect]:
        """The request got the model. Nothing if it ended meanwhile. With a
        ``resume_token`` it is resumable: it keeps a replay tail."""
        entry = self._current(request_id)
        if entry is None or entry.state is not RequestState.WAITING:
            return []
        entry.state = RequestState.RUNNING
        entry.started = now
        if resume_token is not None:
            entry.resume_token = resume_token
            entry.tail = ReplayTail(self._resume_tail_bytes)
        return [Send(Started(id=request_id, resume_token=resume_token))]

    def prompt_processed(self, request_id: str, prompt_tokens: int) -> list[Effect]:
        """The engine counted the prompt (reported in ``done``'s usage)."""
        entry = self._current(request_id)
        if entry is not None:
            entry.prompt_tokens = prompt_tokens
        return []

    def delta(self, request_id: str, text: str, tokens: int, now: float) -> list[Effect]:
        """The next ``delta`` frame for this text; nothing if the request ended
        (or the text is empty: held-back bytes still count as tokens)."""
        entry = self._current(request_id)
        if entry is None or entry.state is not RequestState.RUNNING:
            return []
        entry.completion_tokens += tokens
        if not text:
            return []
        if entry.first_delta is None:
            entry.first_delta = now
        frame = Delta(id=request_id, seq=entry.seq, text=text)
        entry.seq += 1
        if entry.tail is not None:
            entry.tail.add(frame)
        return [Send(frame)]

    def finish(self, request_id: str, outcome: Outcome, now: float) -> list[Effect]:
        """The request ended by itself (or was ended as stalled). Nothing if it
        already ended."""
        entry = self._current(request_id)
        if entry is None:
            return []
        return [Send(self._done(entry, outcome, now))]

    def reject(self, request_id: str, exc: ProtocolError) -> list[Effect]:
        """The request was accepted here but refused before it started (the
        model queue was full): forget it without a ``done`` — the client gets
        an ``error`` frame instead, as for any refused ``generate``."""
        entry = self._current(request_id)
        if entry is None or entry.state is not RequestState.WAITING:
            return []  # it ended meanwhile (its done is out): nothing more for it
        entry.state = RequestState.DONE
        self._active = None
        if self._producer == request_id:
            self._producer = None
        return self.refuse(exc)

    # ------------------------------------------------------------ resuming

    def detach(self, request_id: str) -> Parked | None:
        """Take a resumable request out of this session (its connection is
        lost): a running one, or one whose ``done`` was emitted last. ``None``
        if ``request_id`` is neither (it is cancelled as before)."""
        entry = self._active
        if entry is not None and entry.request.id == request_id:
            if entry.state is not RequestState.RUNNING or entry.tail is None:
                return None
            self._active = None
            if self._producer == request_id:
                self._producer = None
            return Parked(entry)
        finished = self._finished
        if finished is not None and finished.request.id == request_id:
            self._finished = None
            return Parked(finished)
        return None

    def done_sent(self, request_id: str) -> None:
        """The ``done`` of ``request_id`` went out: its replay tail is no longer
        needed (a connection lost from now on has nothing to resume)."""
        finished = self._finished
        if finished is not None and finished.request.id == request_id:
            finished.tail = None
            self._finished = None

    def adopt(self, parked: Parked, after_seq: int, now: float) -> list[Effect]:
        """Take in a parked request: ``resumed``, the replay after
        ``after_seq``, and its ``done`` if it has finished. Refused (nothing
        touched) if this session runs a request, or the replay is not kept."""
        entry = parked.record
        request_id = entry.request.id
        running = self._active
        if entry.done is None and (running is not None or self._producer is not None):
            busy = running.request.id if running is not None else self._producer
            raise ProtocolError("busy", f"request {busy!r} is still running", request_id)
        assert entry.tail is not None
        replay: list[Effect] = [Send(d) for d in entry.tail.after(after_seq, request_id)]
        effects: list[Effect] = [Send(Resumed(id=request_id, after_seq=after_seq)), *replay]
        if entry.done is not None:
            effects.append(Send(entry.done))
            return effects
        self._remember(entry.request)
        self._active = entry
        self._producer = request_id
        return effects

    def since_received_ms(self, request_id: str, now: float) -> float:
        """Milliseconds from receiving the request to ``now``, on the clock of
        the ``done`` frame's timings (so log lines and ``done`` agree)."""
        entry = self._active
        if entry is None or entry.request.id != request_id:
            return 0.0
        return (now - entry.received) * 1000.0

    def producer_stopped(self, request_id: str, now: float) -> list[Effect]:
        """The producer thread of ``request_id`` has exited and freed the model."""
        if self._producer != request_id:
            return []
        self._producer = None
        entry = self._active
        if (
            entry is not None
            and entry.request.id == request_id
            and entry.state is not RequestState.DONE
        ):
            # A producer that exits without reporting an end is a backend bug;
            # the request still gets its one ``done``.
            return [
                Send(
                    self._done(
                        entry,
                        Outcome(
                            reason="error",
                            error_code="internal",
                            error_message="generation ended unexpectedly",
                        ),
                        now,
                    )
                )
            ]
        deferred = self._deferred
        if deferred is None:
            return []
        self._deferred = None
        deferred.deferred = False
        self._producer = deferred.request.id
        return [StartGeneration(deferred.request)]

    # ------------------------------------------------------------ helpers

    def _current(self, request_id: str) -> RequestRecord | None:
        entry = self._active
        if entry is None or entry.request.id != request_id or entry.state is RequestState.DONE:
            return None
        return entry

    def _done(self, entry: RequestRecord, outcome: Outcome, now: float) -> Done:
        if self._active is entry:
            self._active = None
        done = make_done(entry, outcome, now)
        if entry.tail is not None:
            entry.done = done
            self._finished = entry
        return done
