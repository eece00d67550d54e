"""Wire protocol v1: the frames both ways, and one description of each server frame.

Sans-I/O: this module and :mod:`wsserver.core.client_frames` turn text into frozen
dataclasses and back; they know nothing about sockets, asyncio or websockets.
docs/protocol.md is the specification and docs/protocol.schema.json its
machine-checkable form.

The two directions:

* **Client to server** (:mod:`wsserver.core.client_frames`): ``generate``,
  ``cancel``, ``restart``, ``resume``, ``pull`` and ``embed``, the :class:`Limits` they
  are held to, and :func:`parse_client_frame`, which validates them strictly.
* **Server to client** (the dataclasses in :mod:`wsserver.core.frames`, the
  wire here): ``hello``, ``queued``, ``started``, ``resumed``, ``delta``,
  ``done``, ``error``, a pull's ``pull_progress`` and ``pull_done``, and an
  embed's ``embed_done``. Each
  is described once, in
  ``_WIRE``: its type name and its members in wire order (the order is
  visible on the wire and in the docs' examples), each member saying how it
  is written and read back. :func:`serialize` and :func:`parse_server_frame`
  are both derived from that description, so they cannot drift apart.

Every public name of both directions is importable from here; the server,
the clients and the tests import them from this module.
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from ..pull.progress import Progress
from .call_parts import CallPart
from .client_frames import (
    ID_PATTERN,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOKEN_CHARS,
    Cancel,
    ClientFrame,
    EmbedFrame,
    Generate,
    Limits,
    Message,
    Pull,
    Restart,
    Resume,
    ToolCall,
    parse_client_frame,
)
from .frames import (
    PROTOCOL_VERSION,
    ChoiceDone,
    Delta,
    Done,
    DoneReason,
    EmbedDone,
    Error,
    Hello,
    PullDone,
    Pulling,
    PullReason,
    Queued,
    Resumed,
    ServerFrame,
    Started,
    Timings,
    Usage,
)
from .models import ModelInfo
from .wire_members import (
    Group,
    Logprobs,
    Member,
    ModelList,
    ModelObject,
    Names,
    Object,
    Optional,
    ProgressObject,
    ToolCalls,
    Vectors,
)

__all__ = [
    "ID_PATTERN",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOKEN_CHARS",
    "PROTOCOL_VERSION",
    "CallPart",
    "Cancel",
    "ChoiceDone",
    "ClientFrame",
    "Delta",
    "Done",
    "DoneReason",
    "EmbedDone",
    "EmbedFrame",
    "Error",
    "Generate",
    "Hello",
    "Limits",
    "Message",
    "ModelInfo",
    "Progress",
    "Pull",
    "PullDone",
    "PullReason",
    "Pulling",
    "Queued",
    "Restart",
    "Resume",
    "Resumed",
    "ServerFrame",
    "Started",
    "Timings",
    "ToolCall",
    "Usage",
    "parse_client_frame",
    "parse_server_frame",
    "serialize",
]

# ---------------------------------------------------------------- the description


class _Frame:
    """One server frame on the wire: ``type`` first, then its members in order."""

    __slots__ = ("cls", "members", "type")

    def __init__(self, type_: str, cls: type[ServerFrame], *members: str | Member) -> None:
        self.type = type_
        self.cls = cls
        self.members = tuple(m if isinstance(m, Member) else Member(m) for m in members)


_WIRE: Final = (
    _Frame(
        "hello",
        Hello,
        "protocol",
        "server",
        "model",
        Object("limits", Limits, extensible=True),
        Names("honours"),
        ModelList("models"),
        Optional("pull"),
    ),
    _Frame("queued", Queued, "id", "position", Optional("loading"), ProgressObject("download")),
    _Frame("started", Started, "id", Optional("resume_token")),
    _Frame("resumed", Resumed, "id", "after_seq"),
    _Frame(
        "delta",
        Delta,
        "id",
        "seq",
        "text",
        Optional("reasoning"),
        Logprobs("logprobs"),
        ToolCalls("tool_calls"),
        Optional("choice"),
    ),
    _Frame(
        "choice_done",
        ChoiceDone,
        "id",
        "choice",
        "reason",
        # The choice's own tokens: the prompt's are the request's (its done).
        Object(
            "usage",
            Usage,
            omit_zero=("prompt_tokens", "reasoning_tokens", "cached_tokens"),
            extensible=True,
        ),
        Optional("stop_sequence"),
    ),
    _Frame(
        "done",
        Done,
        "id",
        "reason",
        Object("usage", Usage, omit_zero=("reasoning_tokens",), extensible=True),
        Object("timings", Timings, digits=3),
        Group("error", code="error_code", message="error_message"),
        Optional("upstream_timings"),
        Optional("stop_sequence"),
        Optional("model"),
    ),
    _Frame("error", Error, "id", "code", "message"),
    _Frame("pull_progress", Pulling, "id", ProgressObject("progress")),
    _Frame(
        "pull_done",
        PullDone,
        "id",
        "reason",
        ModelObject("model"),
        Optional("downloaded"),
        Group("error", code="error_code", message="error_message"),
    ),
    _Frame(
        "embed_done",
        EmbedDone,
        "id",
        "reason",
        Optional("model"),
        Vectors("vectors"),
        Group("usage", prompt_tokens="prompt_tokens"),
        Group("error", code="error_code", message="error_message"),
    ),
)
_BY_CLASS: Final[dict[type[Any], _Frame]] = {wire.cls: wire for wire in _WIRE}
_BY_TYPE: Final[dict[str, _Frame]] = {wire.type: wire for wire in _WIRE}


# ---------------------------------------------------------------- both ways


def serialize(frame: ServerFrame) -> bytes:
    """Encode a server frame as UTF-8 JSON (send it as a *text* frame)."""
    # Delta skips the walk over its description: it is by far the most
    # frequent frame (one per flush window of every request) and this is its
    # whole cost on the way out. test_protocol holds it to the description.
    if (
        type(frame) is Delta
        and frame.reasoning is None
        and frame.logprobs is None
        and frame.tool_calls is None
        and frame.choice is None
    ):
        return orjson.dumps({"type": "delta", "id": frame.id, "seq": frame.seq, "text": frame.text})
    return orjson.dumps(_to_wire(frame))


def _to_wire(frame: ServerFrame) -> dict[str, Any]:
    wire = _BY_CLASS.get(type(frame))
    if wire is None:
        raise TypeError(f"not a server frame: {frame!r}")
    out: dict[str, Any] = {"type": wire.type}
    for member in wire.members:
        member.write(frame, out)
    return out


def parse_server_frame(data: str | bytes) -> ServerFrame:
    """Decode a server frame (used by clients). Trusts the server's schema."""
    obj = orjson.loads(data)
    kind = obj["type"]
    wire = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if wire is None:
        raise ValueError(f"unknown server frame type {kind!r}")
    into: dict[str, Any] = {}
    for member in wire.members:
        member.read(obj, into)
    frame: ServerFrame = wire.cls(**into)
    return frame
