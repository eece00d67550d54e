"""The per-connection request state machine (sans-I/O).

Theory of operation
-------------------
A connection runs at most one request at a time. The client sees a request go
through ``accepted → (queued) → started → delta* → done``; the server also has
to track the *producer* (the request's engine work), whose life does not match
the client's view: after a ``cancel`` the client gets ``done`` at once, while
the producer may need one more model step to notice and exit. The session
keeps both views:

* the *active* request is the one the client considers running (none after
  its ``done`` was emitted). Frames for any other ID are refused or dropped.
* the *producer* is the ID whose engine work is still alive. A new request is
  accepted while an old producer winds down, but its :class:`StartGeneration`
  effect is held back until :class:`~wsserver.core.events.ProducerExited` reports
  the old one gone, so two producers of one connection never overlap.

**One way in, one way out.** Everything reaches the session through
:meth:`Session.handle`: the client's frames (:mod:`wsserver.core.protocol`) and the
driver's reports of what happened to a request (:mod:`wsserver.core.events`). Each
returns a list of effects, which the request driver (:mod:`wsserver.aio.driver`)
carries out in order in one place. Methods take ``now`` (a monotonic time in
seconds): request times are kept on the request's record, once — the ``done``
frame's timings and the log's come from the same clock readings.

**The transitions are data** (:mod:`wsserver.core.transitions`): which handler
runs for (the state of the event's request, the event's type), and the state
the request is in afterwards; :meth:`Session.handle` reads that table. A
client frame with no row is refused; a report with no row is late — its
request ended — and is dropped.

Because a request leaves ``WAITING``/``RUNNING`` exactly once, it gets exactly
one ``done`` (or, when rejected, one ``error``), and nothing for its ID is
emitted after it.

A *resumable* request (``started`` carried a token) also keeps the deltas it
sent in a bounded :class:`~wsserver.core.replay.ReplayTail`. When its connection is
lost, :meth:`Session.detach` takes it out of this session as a
:class:`Parked` request (the same record: seq, timings, tail), and another
connection's session takes it in with :meth:`Session.adopt`, which replays the
tail after the client's ``after_seq``; the request then goes on as if it had
always been that session's. A request whose ``done`` was written into a
connection that broke is parked too, finished: its resume replays the tail
and the ``done``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from ..errors import ProtocolError
from .events import (
    DoneDelivered,
    Finished,
    ModelGranted,
    Outcome,
    ProducerExited,
    PromptCounted,
    QueuePosition,
    Rejected,
    Report,
    TextProduced,
)
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
from .transitions import REFUSALS, TRANSITIONS

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
Event = ClientFrame | Report

WAITING, RUNNING, DONE = RequestState.WAITING, RequestState.RUNNING, RequestState.DONE


def input_size(request: Generate) -> int:
    """The memory a request's input holds: its strings as Python stores them,
    and its images' bytes.
    (Also what decides whether the engine's check runs off the loop: a large
    grammar or schema takes its bounds' parse and llama.cpp's with it.)"""
    # A grammar or schema: its text, counted at the widest (two bytes a character).
    constraint = 2 * (len(request.grammar or "") + len(request.json_schema or ""))
    if request.prompt is not None:
        return sys.getsizeof(request.prompt) + constraint
    messages = request.messages or ()
    chat = sum(sys.getsizeof(m.content) + sys.getsizeof(m.role) for m in messages)
    # Tool calls and tools: their text, counted at the widest (two bytes a character).
    calls = sum(m.size() - len(m.content) for m in messages)
    # Images: their encoded bytes (a running request and its kept input share them).
    images = sum(len(image) for m in messages for image in m.images)
    return (
        chat
        + constraint
        + images
        + 2 * (calls + len(request.tools or "") + len(request.chat_template_kwargs or ""))
    )


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
        #: The accepted request held until the old producer is gone.
        self._held: RequestRecord | None = None

    # ------------------------------------------------------------ inspection

    @property
    def active_id(self) -> str | None:
        """The request the client considers running, if any."""
        return None if self._active is None else self._active.request.id

    def state_of(self, request_id: str) -> RequestState | None:
        if self._active is not None and self._active.request.id == request_id:
            return self._active.state
        return DONE if request_id in self._seen else None

    def record(self, request_id: str) -> RequestRecord | None:
        """The active request's record (its times, counts, token), if it is ``request_id``."""
        active = self._active
        return active if active is not None and active.request.id == request_id else None

    @property
    def resume_bytes(self) -> int:
        """Wire bytes of the replay tails this session holds (a resumable
        request's, running or just finished)."""
        return sum(
            entry.tail.bytes
            for entry in (self._active, self._finished)
            if entry is not None and entry.tail is not None
        )

    def kept_input(self, request_id: str) -> Generate | None:
        """The input kept for a ``restart`` of ``request_id``, if any."""
        kept = self._inputs.get(request_id)
        return kept[0] if kept is not None else None

    @property
    def restart_bytes(self) -> int:
        """Memory held by the inputs kept for ``restart`` (see :func:`input_size`)."""
        return self._inputs_size

    # ------------------------------------------------------------ the one way in

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Apply a client frame or a report. Refusals come back as an ``error`` frame."""
        state = self.state_of(event.id)
        row = TRANSITIONS.get((state, type(event)))
        try:
            if row is None:
                refusal = REFUSALS.get(type(event))
                if refusal is None:
                    return []  # a late report: its request has ended
                code, message = refusal
                reply_to = event.new_id if isinstance(event, Restart) else event.id
                raise ProtocolError(code, message.format(id=event.id), reply_to)
            return _HANDLERS[row.handler](self, event, now)
        except ProtocolError as exc:
            return self.refuse(exc)

    def refuse(self, exc: ProtocolError) -> list[Effect]:
        """Turn a parse error into the ``error`` frame the client gets."""
        return [
            Send(Error(id=exc.request_id, code=exc.code, message=exc.message, detail=exc.detail))
        ]

    # ------------------------------------------------------------ client frames

    def _accept(self, request: Generate, now: float) -> list[Effect]:
        if self._active is not None:
            raise ProtocolError(
                "busy", f"request {self._active.request.id!r} is still running", request.id
            )
        self._remember(request)
        entry = RequestRecord(request=request, received=now)
        self._active = entry
        if self._producer is not None:
            # The previous producer is still winding down; start when it is gone.
            self._held = entry
            return []
        self._producer = request.id
        return [StartGeneration(request)]

    def _cancel(self, frame: Cancel | Restart, now: float) -> list[Effect]:
        entry = self._active
        assert entry is not None
        effects: list[Effect] = []
        if entry is self._held:
            # Never started: there is no producer of its own to stop.
            self._held = None
        else:
            effects.append(StopGeneration(entry.request.id))
        effects.append(Send(self._done(entry, Outcome(reason="cancelled"), now)))
        return effects

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
        active = self._active
        if active is not None and active.request.id != frame.id:
            raise ProtocolError(
                "busy", f"request {active.request.id!r} is still running", frame.new_id
            )
        effects = self._cancel(frame, now) if active is not None else []
        effects.extend(self._accept(frame.apply(kept[0]), now))
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

    # ------------------------------------------------------------ reports

    def _queued(self, event: QueuePosition, now: float) -> list[Effect]:
        entry = self._active
        assert entry is not None
        if entry.position == event.position and entry.download == event.download:
            return []
        entry.position = event.position
        entry.download = event.download
        loading = True if event.loading else None
        return [
            Send(
                Queued(
                    id=event.id, position=event.position, loading=loading, download=event.download
                )
            )
        ]

    def _granted(self, event: ModelGranted, now: float) -> list[Effect]:
        entry = self._active
        assert entry is not None
        entry.state = RUNNING
        entry.started = now
        if event.resume_token is not None:
            entry.resume_token = event.resume_token
            entry.tail = ReplayTail(self._resume_tail_bytes)
        return [Send(Started(id=event.id, resume_token=event.resume_token))]

    def _rejected(self, event: Rejected, now: float) -> list[Effect]:
        entry = self._active
        assert entry is not None
        entry.state = DONE
        self._active = None
        if self._producer == event.id:
            self._producer = None
        return self.refuse(event.error)

    def _prompt_counted(self, event: PromptCounted, now: float) -> list[Effect]:
        assert self._active is not None
        self._active.prompt_tokens = event.prompt_tokens
        return []

    def _text(self, event: TextProduced, now: float) -> list[Effect]:
        entry = self._active
        assert entry is not None
        entry.completion_tokens += event.tokens
        entry.reasoning_tokens += event.reasoning_tokens
        if not event.text and not event.reasoning and not event.logprobs and not event.tool_calls:
            return []
        if entry.first_delta is None and (event.text or event.reasoning or event.tool_calls):
            # The first thing the client reads: answer or reasoning (a delta
            # that carries only log-probabilities of held-back bytes is not).
            entry.first_delta = now
        frame = Delta(
            id=event.id,
            seq=entry.seq,
            text=event.text,
            reasoning=event.reasoning or None,
            logprobs=event.logprobs or None,
            tool_calls=event.tool_calls or None,
        )
        entry.seq += 1
        if entry.tail is not None:
            entry.tail.add(frame)
        return [Send(frame)]

    def _ended(self, event: Finished, now: float) -> list[Effect]:
        assert self._active is not None
        return [Send(self._done(self._active, event.outcome, now))]

    def _done_delivered(self, event: DoneDelivered, now: float) -> list[Effect]:
        finished = self._finished
        if finished is not None and finished.request.id == event.id:
            finished.tail = None
            self._finished = None
        return []

    def _producer_exited(self, event: ProducerExited, now: float) -> list[Effect]:
        if self._producer != event.id:
            return []
        self._producer = None
        entry = self._active
        if entry is not None and entry.request.id == event.id:
            # A producer that exits without reporting an end is an engine bug;
            # the request still gets its one ``done``.
            internal = Outcome(
                "error", error_code="internal", error_message="generation ended unexpectedly"
            )
            return [Send(self._done(entry, internal, now))]
        held = self._held
        if held is None:
            return []
        self._held = None
        self._producer = held.request.id
        return [StartGeneration(held.request)]

    # ------------------------------------------------------------ resuming

    def detach(self, request_id: str) -> Parked | None:
        """Take a resumable request out of this session (its connection is
        lost): a running one, or one whose ``done`` was emitted last. ``None``
        if ``request_id`` is neither (it is cancelled as before)."""
        entry = self._active
        if entry is not None and entry.request.id == request_id:
            if entry.state is not RUNNING or entry.tail is None:
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
        replay = entry.tail.after(after_seq, entry.seq, request_id)
        effects: list[Effect] = [Send(Resumed(id=request_id, after_seq=after_seq))]
        effects.extend(Send(delta) for delta in replay)
        if entry.done is not None:
            effects.append(Send(entry.done))
            return effects
        self._remember(entry.request)
        self._active = entry
        self._producer = request_id
        return effects

    # ------------------------------------------------------------ helpers

    def _done(self, entry: RequestRecord, outcome: Outcome, now: float) -> Done:
        if self._active is entry:
            self._active = None
        entry.state = DONE
        done = make_done(entry, outcome, now)
        if entry.tail is not None:
            entry.done = done
            self._finished = entry
        return done


#: The table's handlers, looked up once (``Session.handle`` runs per delta).
_HANDLERS: Final[dict[str, Callable[[Session, Any, float], list[Effect]]]] = {
    row.handler: getattr(Session, row.handler) for row in TRANSITIONS.values()
}
