"""Wire protocol v1: the frames both ways, and one description of each server frame.

Sans-I/O: this module and :mod:`wsserver.core.client_frames` turn text into frozen
dataclasses and back; they know nothing about sockets, asyncio or websockets.
docs/protocol.md is the specification and docs/protocol.schema.json its
machine-checkable form.

The two directions:

* **Client to server** (:mod:`wsserver.core.client_frames`): ``generate``,
  ``cancel``, ``restart``, ``resume`` and ``pull``, the :class:`Limits` they
  are held to, and :func:`parse_client_frame`, which validates them strictly.
* **Server to client** (the dataclasses in :mod:`wsserver.core.frames`, the
  wire here): ``hello``, ``queued``, ``started``, ``resumed``, ``delta``,
  ``done``, ``error``, and a pull's ``pull_progress`` and ``pull_done``. Each
  is described once, in
  ``_WIRE``: its type name and its members in wire order (the order is
  visible on the wire and in the docs' examples), each member saying how it
  is written and read back. :func:`serialize` and :func:`parse_server_frame`
  are both derived from that description, so they cannot drift apart.

Every public name of both directions is importable from here; the server,
the clients and the tests import them from this module.
"""

from __future__ import annotations

from dataclasses import fields
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
    Delta,
    Done,
    DoneReason,
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
from .logprobs import parse_entries
from .models import ModelInfo

__all__ = [
    "ID_PATTERN",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "MAX_TOKEN_CHARS",
    "PROTOCOL_VERSION",
    "CallPart",
    "Cancel",
    "ClientFrame",
    "Delta",
    "Done",
    "DoneReason",
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


class _Member:
    """One member of a server frame's JSON object: the attribute of the same
    name, written as it is and required when read back."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        out[self.key] = getattr(frame, self.key)

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        into[self.key] = obj[self.key]


class _Optional(_Member):
    """Left out of the frame when ``None``; read back as ``None`` when absent."""

    __slots__ = ()

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        if value is not None:
            out[self.key] = value

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        into[self.key] = obj.get(self.key)


class _Object(_Member):
    """A nested dataclass (``Usage``, ``Timings``, ``Limits``), written as an
    object of its fields in their declared order.

    ``digits``: numbers are rounded to that many decimals (``None`` stays
    ``None``). ``extensible``: servers may add members within v1, so a
    reader keeps the ones it knows and drops the rest.
    """

    __slots__ = ("cls", "digits", "extensible", "names", "omit_zero")

    def __init__(
        self,
        key: str,
        cls: type[Any],
        *,
        digits: int | None = None,
        extensible: bool = False,
        omit_zero: tuple[str, ...] = (),
    ) -> None:
        super().__init__(key)
        #: Members left out when 0 (added within v1; absent reads back as 0).
        self.omit_zero = omit_zero
        self.cls = cls
        self.names: tuple[str, ...] = tuple(f.name for f in fields(cls))
        self.digits = digits
        self.extensible = extensible

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        digits = self.digits
        if digits is None:
            out[self.key] = {
                name: getattr(value, name)
                for name in self.names
                if name not in self.omit_zero or getattr(value, name)
            }
            return
        rounded: dict[str, Any] = {}
        for name in self.names:
            number = getattr(value, name)
            rounded[name] = None if number is None else round(number, digits)
        out[self.key] = rounded

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        members: dict[str, Any] = obj[self.key]
        if self.extensible:
            members = {k: v for k, v in members.items() if k in self.names}
        into[self.key] = self.cls(**members)


class _Group(_Member):
    """An object made of several of the frame's attributes (``done``'s
    ``error``: ``error_code`` and ``error_message``), given as wire name =
    attribute. Written only when the first attribute is set, a later one
    that is ``None`` as the empty string; every attribute reads back as
    ``None`` when the object or its member is absent.
    """

    __slots__ = ("attrs",)

    def __init__(self, key: str, **attrs: str) -> None:
        super().__init__(key)
        self.attrs = tuple(attrs.items())

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        values = [(name, getattr(frame, attr)) for name, attr in self.attrs]
        if values[0][1] is not None:
            out[self.key] = {name: "" if value is None else value for name, value in values}

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        group = obj.get(self.key) or {}
        for name, attr in self.attrs:
            into[attr] = group.get(name)


class _Names(_Optional):
    """A list of names (``hello.honours``), read back as a tuple; left out when ``None``."""

    __slots__ = ()

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        value = obj.get(self.key)
        into[self.key] = None if value is None else tuple(value)


class _Logprobs(_Optional):
    """A ``delta``'s token entries (:mod:`wsserver.core.logprobs`), left out when ``None``."""

    __slots__ = ()

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        if value is not None:
            out[self.key] = [entry.to_wire() for entry in value]

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        value = obj.get(self.key)
        into[self.key] = None if value is None else parse_entries(value)


class _ToolCalls(_Optional):
    """A ``delta``'s call parts, left out when ``None``; ``id`` and ``name``
    only on a call's first part."""

    __slots__ = ()

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        if value is not None:
            out[self.key] = [_call_part(part) for part in value]

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        value = obj.get(self.key)
        into[self.key] = None if value is None else tuple(CallPart(**part) for part in value)


class _Progress(_Optional):
    """A pull's progress (:class:`~wsserver.pull.progress.Progress`), left out
    when ``None``: ``status``, ``completed``, ``total``, then ``file``,
    ``rate`` and ``eta_s`` when known (the two figures rounded). Required
    where it is the frame's point (``pull_progress``): it is never ``None``
    there."""

    __slots__ = ()

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        if value is not None:
            out[self.key] = progress_object(value)

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        value = obj.get(self.key)
        into[self.key] = None if value is None else read_progress(value)


def progress_object(progress: Progress) -> dict[str, Any]:
    """A pull's progress as its wire object."""
    out: dict[str, Any] = {
        "status": progress.status,
        "completed": progress.completed,
        "total": progress.total,
    }
    if progress.file is not None:
        out["file"] = progress.file
    if progress.rate is not None:
        out["rate"] = round(progress.rate, 1)
    if progress.eta_s is not None:
        out["eta_s"] = round(progress.eta_s, 1)
    return out


def read_progress(obj: dict[str, Any]) -> Progress:
    return Progress(
        status=obj["status"],
        completed=obj["completed"],
        total=obj["total"],
        file=obj.get("file"),
        rate=obj.get("rate"),
        eta_s=obj.get("eta_s"),
    )


class _Model(_Optional):
    """One model object (``pull_done``'s), left out when ``None``."""

    __slots__ = ()

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        if value is not None:
            out[self.key] = _model_object(value)

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        value = obj.get(self.key)
        names = tuple(f.name for f in fields(ModelInfo))
        into[self.key] = None if value is None else _read_model(value, names)


class _Models(_Optional):
    """``hello``'s models: a list of objects, left out when ``None``; a reader
    keeps the members it knows (servers may add some within v1)."""

    __slots__ = ()

    _NAMES: Final = tuple(f.name for f in fields(ModelInfo))

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        if value is not None:
            out[self.key] = [_model_object(m) for m in value]

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        value = obj.get(self.key)
        into[self.key] = (
            None if value is None else tuple(_read_model(m, self._NAMES) for m in value)
        )


def _read_model(obj: dict[str, Any], names: tuple[str, ...]) -> ModelInfo:
    known: dict[str, Any] = {k: v for k, v in obj.items() if k in names}
    for name in ("aliases", "input_modalities"):
        if known.get(name) is not None:
            known[name] = tuple(known[name])
    return ModelInfo(**known)


def _model_object(model: ModelInfo) -> dict[str, Any]:
    out = {f.name: getattr(model, f.name) for f in fields(ModelInfo)}
    out["aliases"] = list(model.aliases)
    for name in ("chat_template", "input_modalities"):
        if out[name] is None:
            del out[name]  # not known: not said
    if model.input_modalities is not None:
        out["input_modalities"] = list(model.input_modalities)
    return out


def _call_part(part: CallPart) -> dict[str, Any]:
    out: dict[str, Any] = {"index": part.index}
    if part.id is not None:
        out["id"] = part.id
    if part.name is not None:
        out["name"] = part.name
    out["arguments"] = part.arguments
    return out


class _Frame:
    """One server frame on the wire: ``type`` first, then its members in order."""

    __slots__ = ("cls", "members", "type")

    def __init__(self, type_: str, cls: type[ServerFrame], *members: str | _Member) -> None:
        self.type = type_
        self.cls = cls
        self.members = tuple(m if isinstance(m, _Member) else _Member(m) for m in members)


_WIRE: Final = (
    _Frame(
        "hello",
        Hello,
        "protocol",
        "server",
        "model",
        _Object("limits", Limits, extensible=True),
        _Names("honours"),
        _Models("models"),
        _Optional("pull"),
    ),
    _Frame("queued", Queued, "id", "position", _Optional("loading"), _Progress("download")),
    _Frame("started", Started, "id", _Optional("resume_token")),
    _Frame("resumed", Resumed, "id", "after_seq"),
    _Frame(
        "delta",
        Delta,
        "id",
        "seq",
        "text",
        _Optional("reasoning"),
        _Logprobs("logprobs"),
        _ToolCalls("tool_calls"),
    ),
    _Frame(
        "done",
        Done,
        "id",
        "reason",
        _Object("usage", Usage, omit_zero=("reasoning_tokens",), extensible=True),
        _Object("timings", Timings, digits=3),
        _Group("error", code="error_code", message="error_message"),
        _Optional("upstream_timings"),
        _Optional("stop_sequence"),
        _Optional("model"),
    ),
    _Frame("error", Error, "id", "code", "message"),
    _Frame("pull_progress", Pulling, "id", _Progress("progress")),
    _Frame(
        "pull_done",
        PullDone,
        "id",
        "reason",
        _Model("model"),
        _Optional("downloaded"),
        _Group("error", code="error_code", message="error_message"),
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
