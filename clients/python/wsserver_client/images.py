"""Images in a request's messages, made ready for the wire (sans-I/O but for reading files).

A user message may carry ``images``: file paths (``str`` or ``os.PathLike``),
or the images' bytes (``bytes``, ``bytearray``, ``memoryview``); an entry
already in the wire's shape (``{"upload": id}``, a base64 string inside a
``dict``… see below) is passed on as is. :func:`pack_images` gives the
messages the server reads (docs/protocol.md, "Images"):

* when the server takes uploads (``hello.limits.max_upload_bytes`` > 0),
  each image becomes ``{"upload": "<id>"}`` and its bytes go ahead of the
  request in binary frames — ``<id>\\n<bytes>``, in pieces that fit
  ``max_frame_bytes`` — a third less on the wire than base64 and with no
  need for a larger frame limit;
* else (a server before uploads, or uploads off) each image is base64
  inside the frame.

To pass a base64 string or a data URL as is, give ``{"base64": "…"}``; a
plain ``str`` is a file path. A message's ``audio`` (WAV, MP3 or FLAC files,
for a model served with an audio projector) is packed the same way.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from wsserver.core.protocol import Limits

__all__ = ["ImageInput", "pack_images"]

#: What a message's ``images`` may hold.
ImageInput = str | os.PathLike[str] | bytes | bytearray | memoryview | dict[str, Any]

#: The most an upload's head (id and newline) takes of a binary frame.
_HEAD: Final = 65


def _image_bytes(item: Any, where: str) -> bytes | None:
    """An image's bytes, or None for an entry in the wire's shape."""
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item)
    if isinstance(item, str | os.PathLike):
        return Path(item).read_bytes()
    if isinstance(item, dict):
        return None
    raise TypeError(f"{where}: an image is a file path, bytes, or a dict in the wire's shape")


def _wire_entry(item: dict[str, Any]) -> Any:
    if set(item) == {"base64"}:
        return item["base64"]
    return item


def pack_images(
    messages: list[dict[str, Any]] | None,
    limits: Limits | None,
    new_id: Callable[[], str],
) -> tuple[list[dict[str, Any]] | None, list[bytes]]:
    """``messages`` with their images in the wire's shape, and the binary
    frames to send before the request (in order); ``new_id`` names uploads."""
    if not messages or not any(
        isinstance(m, dict) and (m.get("images") or m.get("audio")) for m in messages
    ):
        return messages, []
    upload = limits is not None and limits.max_upload_bytes > 0
    piece = max(1, (limits.max_frame_bytes if limits is not None else 1 << 20) - _HEAD)
    frames: list[bytes] = []
    out = []
    for index, message in enumerate(messages):
        packed = dict(message) if isinstance(message, dict) else message
        for key in ("images", "audio"):
            given = message.get(key) if isinstance(message, dict) else None
            if not given:
                continue
            entries = []
            for k, item in enumerate(given):
                data = _image_bytes(item, f"messages[{index}].{key}[{k}]")
                if data is None:
                    entries.append(_wire_entry(item))
                elif upload:
                    upload_id = new_id()
                    head = upload_id.encode() + b"\n"
                    frames.extend(head + data[at : at + piece] for at in range(0, len(data), piece))
                    if not data:
                        frames.append(head)  # the server says it is empty, naming it
                    entries.append({"upload": upload_id})
                else:
                    entries.append(base64.b64encode(data).decode())
            packed[key] = entries
        out.append(packed)
    return out, frames
