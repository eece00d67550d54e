"""Protocol v1's server frames: what the server sends, as frozen dataclasses (sans-I/O).

``hello``, ``queued``, ``started``, ``resumed``, ``delta``, ``done``,
``error``, and a pull's ``pull_progress`` and ``pull_done``. How each is
written and read back is described once, in :mod:`wsserver.core.protocol`,
which every importer uses (it re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from ..errors import WireCode
from ..pull.progress import Progress
from .call_parts import CallPart
from .client_frames import Limits
from .logprobs import TokenLogprob
from .models import ModelInfo

__all__ = [
    "PROTOCOL_VERSION",
    "ChoiceDone",
    "Delta",
    "Done",
    "DoneReason",
    "EmbedDone",
    "EmbedReason",
    "Error",
    "Hello",
    "PullDone",
    "PullReason",
    "Pulling",
    "Queued",
    "Resumed",
    "ServerFrame",
    "Started",
    "Timings",
    "Usage",
]

PROTOCOL_VERSION: Final = 1

DoneReason = Literal["stop", "length", "tool_calls", "cancelled", "error"]
PullReason = Literal["complete", "cancelled", "error"]
EmbedReason = Literal["complete", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class Hello:
    model: str
    server: str
    limits: Limits
    protocol: int = PROTOCOL_VERSION
    #: The sampler-chain and structured-output options (``NEUTRAL``'s names
    #: in :mod:`wsserver.core.sampling`) the engine honours, sorted; any other
    #: given a value that matters is refused with ``unsupported_option``.
    #: ``None``: not said (a server before this member).
    honours: tuple[str, ...] | None = None
    #: Every model the server serves (``model`` is the default), with its
    #: state and limits; a ``generate`` chooses one with ``model``.
    models: tuple[ModelInfo, ...] | None = None
    #: Whether this connection may ``pull`` models (``None``: not said, a
    #: server before it).
    pull: bool | None = None


@dataclass(frozen=True, slots=True)
class Queued:
    id: str
    position: int
    #: ``True`` while the request's model is being loaded (else not written).
    loading: bool | None = None
    #: While the model is being downloaded (a configured ``hf:`` reference):
    #: how far (else not written).
    download: Progress | None = None


@dataclass(frozen=True, slots=True)
class Started:
    id: str
    #: Only for a resumable request: what a ``resume`` must present.
    resume_token: str | None = None


@dataclass(frozen=True, slots=True)
class Resumed:
    """A ``resume`` was accepted: the deltas after ``after_seq`` follow."""

    id: str
    after_seq: int


@dataclass(frozen=True, slots=True)
class Delta:
    id: str
    seq: int
    text: str
    #: The model's reasoning, before ``text`` (which may then be "").
    reasoning: str | None = None
    #: The log-probabilities of the tokens this delta merged, when the request
    #: asked for them (a token's text may come in a later delta: held back).
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: Parts of the model's tool calls, after ``text`` (wsserver.shaping.tool_calls):
    #: a call's first part has its ``id`` and ``name``, later ones more
    #: ``arguments`` text.
    tool_calls: tuple[CallPart, ...] | None = None
    #: Which of a request's ``n`` choices it belongs to (None: it asked one).
    choice: int | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: Of the completion tokens, those of the reasoning (written when not 0).
    reasoning_tokens: int = 0
    #: Of the prompt tokens, those the engine reused from its prefix cache.
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    """Milliseconds measured on the server, from receipt of the request frame.

    ``ttft_ms`` is ``None`` when no text was sent. ``tokens_per_s`` is
    completion tokens over the time from ``started`` to the end.
    """

    queued_ms: float
    ttft_ms: float | None
    total_ms: float
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Done:
    id: str
    reason: DoneReason
    usage: Usage
    timings: Timings
    error_code: WireCode | None = None
    error_message: str | None = None
    #: Figures the upstream engine reported (llama-server's ``timings``), if any.
    upstream_timings: dict[str, float] | None = None
    #: The request's stop string that ended it (reason ``stop``), if one did.
    stop_sequence: str | None = None
    #: The model that answered (the one it asked for, or the default).
    model: str | None = None


@dataclass(frozen=True, slots=True)
class ChoiceDone:
    """One choice of a request for several (``n``) ended; not terminal: the
    request's one ``done`` follows the last choice's."""

    id: str
    choice: int
    reason: DoneReason
    #: The choice's own completion (and reasoning) tokens; the prompt's are the ``done``'s.
    usage: Usage
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Error:
    id: str | None
    code: WireCode
    message: str
    #: A finer reason than ``code`` for dialects that name one (``ProtocolError.detail``);
    #: not part of the WebSocket frame.
    detail: str | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Pulling:
    """How far a ``pull`` is (sent at once on a new status or file, else at
    most a couple of times a second)."""

    id: str
    progress: Progress


@dataclass(frozen=True, slots=True)
class PullDone:
    """The end of a ``pull`` — exactly one per accepted pull, always its last frame."""

    id: str
    reason: PullReason
    #: ``complete``: the model as the server now serves it.
    model: ModelInfo | None = None
    #: ``complete``: bytes that came over the network (0: all were cached).
    downloaded: int | None = None
    error_code: WireCode | None = None
    error_message: str | None = None


@dataclass(frozen=True, slots=True)
class EmbedDone:
    """The end of an ``embed`` — exactly one per accepted embed, its only frame."""

    id: str
    reason: EmbedReason
    #: ``complete``: the model that embedded (its served name).
    model: str | None = None
    #: ``complete``: each input's vector, little-endian float32, in input
    #: order; written as ``data`` (float lists, or base64 with ``encoding``).
    vectors: tuple[bytes, ...] | None = None
    encoding: str = "float"
    #: ``complete``: the tokens the engine read.
    prompt_tokens: int | None = None
    error_code: WireCode | None = None
    error_message: str | None = None


ServerFrame = (
    Hello
    | Queued
    | Started
    | Delta
    | ChoiceDone
    | Done
    | Error
    | Resumed
    | Pulling
    | PullDone
    | EmbedDone
)
