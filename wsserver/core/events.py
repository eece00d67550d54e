"""What happens to a request on the engine's side, as data (sans-I/O).

A :class:`~wsserver.core.session.Session` is fed through one entry,
:meth:`~wsserver.core.session.Session.handle`: the client's frames
(:mod:`wsserver.core.protocol`) and these *reports* — frozen events that the
request driver (:mod:`wsserver.aio.driver`) makes of what the scheduler, the
engine and the socket did. Both kinds carry the request's ``id``; the session
answers each with effects, so every frame leaves by one route.

:class:`Outcome` is how an engine says a request ended. It lives here, in the
core, and the engine seam (:mod:`wsserver.backends.base`) takes it from here:
the core depends on no engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ProtocolError, WireCode
from .call_parts import CallPart
from .logprobs import TokenLogprob
from .protocol import DoneReason, Progress

__all__ = [
    "DoneDelivered",
    "Finished",
    "ModelGranted",
    "Outcome",
    "ProducerExited",
    "PromptCounted",
    "QueuePosition",
    "Rejected",
    "Report",
    "TextProduced",
]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended, as the engine reports it.

    ``completion_tokens`` is the engine's own count when it has one (an
    upstream's usage, say); 0 means "count what was delivered".
    """

    reason: DoneReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_code: WireCode | None = None
    error_message: str | None = None
    #: The upstream engine's own figures (llama-server's ``timings``), passed on as is.
    upstream_timings: dict[str, float] | None = None
    #: The request's stop string that ended it (reason ``stop``), if one did.
    stop_sequence: str | None = None
    #: Prompt tokens the engine took from its prefix cache instead of computing them.
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class QueuePosition:
    """The request's place in the model's queue changed."""

    id: str
    position: int
    #: The model is still being loaded (the ``queued`` frame says so).
    loading: bool = False
    #: ... and, before that, downloaded: how far.
    download: Progress | None = None


@dataclass(frozen=True, slots=True)
class ModelGranted:
    """The request got the model (a slot). With a token it is resumable."""

    id: str
    resume_token: str | None = None


@dataclass(frozen=True, slots=True)
class Rejected:
    """The request was refused before it started (the model's queue was full)."""

    id: str
    error: ProtocolError


@dataclass(frozen=True, slots=True)
class PromptCounted:
    """The engine counted the prompt (``done``'s usage reports it)."""

    id: str
    prompt_tokens: int
    #: Of them, taken from the engine's prefix cache (0: none, or not known yet).
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TextProduced:
    """Text for the next ``delta``: ``tokens`` tokens, whose text may be empty
    (bytes of a character held back still count as tokens)."""

    id: str
    text: str
    tokens: int
    #: Reasoning that comes before ``text`` (wsserver.shaping.reasoning), and how
    #: many of ``tokens`` it took.
    reasoning: str = ""
    reasoning_tokens: int = 0
    #: The tokens' log-probabilities, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()
    #: Parts of the model's tool calls, after ``text`` (wsserver.shaping.tool_calls).
    tool_calls: tuple[CallPart, ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    """The request ended by itself, or was ended as stalled."""

    id: str
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class DoneDelivered:
    """The request's ``done`` was handed to the socket: its replay tail can go."""

    id: str


@dataclass(frozen=True, slots=True)
class ProducerExited:
    """The request's engine work is over and the model is free of it."""

    id: str


Report = (
    QueuePosition
    | ModelGranted
    | Rejected
    | PromptCounted
    | TextProduced
    | Finished
    | DoneDelivered
    | ProducerExited
)
