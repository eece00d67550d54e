"""How each member of a server frame is written to JSON and read back (sans-I/O).

:mod:`wsserver.core.protocol` describes every server frame once, as a table
of members (``_WIRE``); a member is a plain attribute (:class:`Member`) or one
of the kinds here, which leave it out when empty, nest it in an object, or
write a richer value (vectors, progress, models, logprobs, tool calls).
"""

from __future__ import annotations

import base64
import struct
from dataclasses import fields
from typing import Any, Final

from ..pull.progress import Progress
from .call_parts import CallPart
from .frames import ServerFrame
from .logprobs import parse_entries
from .models import ModelInfo


class Member:
    """One member of a server frame's JSON object: the attribute of the same
    name, written as it is and required when read back."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        out[self.key] = getattr(frame, self.key)

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        into[self.key] = obj[self.key]


class Optional(Member):
    """Left out of the frame when ``None``; read back as ``None`` when absent."""

    __slots__ = ()

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        if value is not None:
            out[self.key] = value

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        into[self.key] = obj.get(self.key)


class Object(Member):
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


class Group(Member):
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


class Vectors(Optional):
    """``embed_done``'s vectors, left out when ``None``: ``data`` — each a list
    of floats, or (``encoding`` ``base64``) its little-endian float32 bytes in
    base64 — and ``encoding_format``; read back as the bytes."""

    __slots__ = ()

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        vectors = getattr(frame, self.key)
        if vectors is None:
            return
        encoding = getattr(frame, "encoding")  # noqa: B009 - the frame's other half
        if encoding == "base64":
            out["data"] = [base64.b64encode(v).decode("ascii") for v in vectors]
        else:
            out["data"] = [list(struct.unpack(f"<{len(v) // 4}f", v)) for v in vectors]
        out["encoding_format"] = encoding

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        data = obj.get("data")
        encoding = obj.get("encoding_format", "float")
        into["encoding"] = encoding
        if data is None:
            into[self.key] = None
        elif encoding == "base64":
            into[self.key] = tuple(base64.b64decode(v) for v in data)
        else:
            into[self.key] = tuple(struct.pack(f"<{len(v)}f", *v) for v in data)


class Names(Optional):
    """A list of names (``hello.honours``), read back as a tuple; left out when ``None``."""

    __slots__ = ()

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        value = obj.get(self.key)
        into[self.key] = None if value is None else tuple(value)


class Logprobs(Optional):
    """A ``delta``'s token entries (:mod:`wsserver.core.logprobs`), left out when ``None``."""

    __slots__ = ()

    def write(self, frame: ServerFrame, out: dict[str, Any]) -> None:
        value = getattr(frame, self.key)
        if value is not None:
            out[self.key] = [entry.to_wire() for entry in value]

    def read(self, obj: dict[str, Any], into: dict[str, Any]) -> None:
        value = obj.get(self.key)
        into[self.key] = None if value is None else parse_entries(value)


class ToolCalls(Optional):
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


class ProgressObject(Optional):
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


class ModelObject(Optional):
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


class ModelList(Optional):
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
    for name in ("chat_template", "embeddings", "input_modalities"):
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
