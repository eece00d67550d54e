"""The request state machine's transitions, as data (sans-I/O).

:class:`~wsserver.core.session.Session` reads this table: for each event — a
client frame (:mod:`wsserver.core.protocol`) or a report (:mod:`wsserver.core.events`) —
the state of the request it names decides which handler runs, and the
request's state afterwards is the row's ``next`` (or unchanged, when a
handler's guard refuses or drops the event; the session checks it).

**The transitions are data.** :data:`TRANSITIONS` maps (the state of the
event's request, the event's type) to the handler that runs, the state the
request is in afterwards, and the effects; :meth:`Session.handle` reads it, and
the table below is rendered from it (a test checks that they match). A client
frame whose row is missing is refused with :data:`REFUSALS`' code; a report
whose row is missing is late — its request ended — and is dropped.

.. transitions::

    state    event           next     effects
    -------  --------------  -------  -----------------------------------------------------
    -        Generate        WAITING  StartGeneration (held while a producer winds down)
    WAITING  QueuePosition   WAITING  Send(queued) when the position or download changed
    WAITING  ModelGranted    RUNNING  Send(started)
    WAITING  Rejected        DONE     Send(error overloaded), no done
    WAITING  PromptCounted   WAITING  -
    WAITING  Finished        DONE     Send(done)
    WAITING  Cancel          DONE     StopGeneration (unless held), Send(done cancelled)
    WAITING  Restart         DONE     Cancel it, then Generate its input as new_id
    WAITING  ProducerExited  DONE     Send(done internal) if it was the producer
    RUNNING  PromptCounted   RUNNING  -
    RUNNING  TextProduced    RUNNING  Send(delta) unless the text is empty
    RUNNING  Finished        DONE     Send(done stop|length|error)
    RUNNING  Cancel          DONE     StopGeneration, Send(done cancelled)
    RUNNING  Restart         DONE     Cancel it, then Generate its input as new_id
    RUNNING  ProducerExited  DONE     Send(done internal): the engine ended without an end
    DONE     Restart         DONE     Generate its input as new_id
    DONE     DoneDelivered   DONE     drop the replay tail
    DONE     ProducerExited  DONE     StartGeneration of the held request, if any
"""

from __future__ import annotations

from typing import Final, NamedTuple

from ..errors import WireCode
from .events import (
    DoneDelivered,
    Finished,
    ModelGranted,
    ProducerExited,
    PromptCounted,
    QueuePosition,
    Rejected,
    TextProduced,
)
from .protocol import Cancel, EmbedFrame, Generate, Pull, Restart, Resume
from .request_record import RequestState

__all__ = ["REFUSALS", "TRANSITIONS", "Row", "render_transitions"]

WAITING, RUNNING, DONE = RequestState.WAITING, RequestState.RUNNING, RequestState.DONE


class Row(NamedTuple):
    """One transition: the handler that runs, the state after it, its effects."""

    handler: str
    next: RequestState
    effects: str


#: (state of the event's request — ``None``: never seen —, event type) → transition.
TRANSITIONS: Final[dict[tuple[RequestState | None, type], Row]] = {
    (None, Generate): Row("_accept", WAITING, "StartGeneration (held while a producer winds down)"),
    (WAITING, QueuePosition): Row(
        "_queued", WAITING, "Send(queued) when the position or download changed"
    ),
    (WAITING, ModelGranted): Row("_granted", RUNNING, "Send(started)"),
    (WAITING, Rejected): Row("_rejected", DONE, "Send(error overloaded), no done"),
    (WAITING, PromptCounted): Row("_prompt_counted", WAITING, "-"),
    (WAITING, Finished): Row("_ended", DONE, "Send(done)"),
    (WAITING, Cancel): Row("_cancel", DONE, "StopGeneration (unless held), Send(done cancelled)"),
    (WAITING, Restart): Row("_restart", DONE, "Cancel it, then Generate its input as new_id"),
    (WAITING, ProducerExited): Row(
        "_producer_exited", DONE, "Send(done internal) if it was the producer"
    ),
    (RUNNING, PromptCounted): Row("_prompt_counted", RUNNING, "-"),
    (RUNNING, TextProduced): Row("_text", RUNNING, "Send(delta) unless the text is empty"),
    (RUNNING, Finished): Row("_ended", DONE, "Send(done stop|length|error)"),
    (RUNNING, Cancel): Row("_cancel", DONE, "StopGeneration, Send(done cancelled)"),
    (RUNNING, Restart): Row("_restart", DONE, "Cancel it, then Generate its input as new_id"),
    (RUNNING, ProducerExited): Row(
        "_producer_exited", DONE, "Send(done internal): the engine ended without an end"
    ),
    (DONE, Restart): Row("_restart", DONE, "Generate its input as new_id"),
    (DONE, DoneDelivered): Row("_done_delivered", DONE, "drop the replay tail"),
    (DONE, ProducerExited): Row(
        "_producer_exited", DONE, "StartGeneration of the held request, if any"
    ),
}

#: A client frame with no row is refused with this code (its message says why).
REFUSALS: Final[dict[type, tuple[WireCode, str]]] = {
    Generate: ("duplicate_id", "id {id!r} was already used"),
    Cancel: ("unknown_id", "no running request {id!r}"),
    Restart: ("unknown_id", "no recent request {id!r} to restart"),
    Resume: ("bad_request", "resume is not handled here"),
    Pull: ("bad_request", "pull is not handled here"),
    EmbedFrame: ("bad_request", "embed is not handled here"),
}

_ORDER: Final = {None: 0, WAITING: 1, RUNNING: 2, DONE: 3}


def render_transitions() -> str:
    """The transition table as the module docstring shows it."""
    rows = sorted(TRANSITIONS.items(), key=lambda item: _ORDER[item[0][0]])
    lines = [
        f"{'state':<8} {'event':<15} {'next':<8} effects",
        f"{'-' * 7}  {'-' * 14}  {'-' * 7}  {'-' * 53}",
    ]
    for (state, event), row in rows:
        name = "-" if state is None else state.name
        lines.append(f"{name:<8} {event.__name__:<15} {row.next.name:<8} {row.effects}".rstrip())
    return "\n".join(lines)
