"""Images sent as binary WebSocket frames, kept for the next ``generate`` (sans-I/O).

An image need not travel as base64 inside a JSON frame (a third larger, and
over ``limits.max_frame_bytes`` for any photo): a client sends its bytes in
**binary frames** — each the upload's id (1-64 characters of the request-id
alphabet), a newline, then a chunk of the image — and a ``generate`` then
names it, ``{"upload": "<id>"}``, in a user message's ``images``
(docs/protocol.md, "Images"). Chunks of one id are joined in the order they
came; no frame answers an upload unless it is refused.

**Bounds.** What a connection holds here is bounded in bytes
(``limits.max_upload_bytes``: a chunk that would pass it is refused, and its
upload dropped) and in count (:data:`~wsserver.core.image_check.MAX_IMAGES`
uploads at once, what one request can read). **The next ``generate`` or
``restart`` frame takes every upload** — those it names go into its request,
the others are dropped — whether it is accepted or refused; a connection
that closes drops what it holds. So an unreferenced upload lives until the
next request, never longer.

A refused upload is remembered (at most :data:`~wsserver.core.image_check.MAX_IMAGES`
of them) until that request too: its later chunks are dropped without a word
more, and a request that names it is refused saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ..errors import ProtocolError
from .fields import ID_RE
from .image_check import MAX_IMAGES

__all__ = ["Pending", "UploadChunk", "Uploads", "parse_upload"]

#: Between an upload's id and its bytes in a binary frame.
SEPARATOR: Final = b"\n"
_MAX_HEAD: Final = 65


@dataclass(frozen=True, slots=True)
class UploadChunk:
    """One binary frame: a piece of upload ``id``'s bytes."""

    id: str
    data: bytes


def parse_upload(frame: bytes) -> UploadChunk:
    """A binary frame as an upload's chunk (``bad_json`` if its head is wrong)."""
    at = frame.find(SEPARATOR, 0, _MAX_HEAD)
    head = frame[:at] if at > 0 else b""
    upload_id = head.decode("ascii", errors="replace")
    if not ID_RE.fullmatch(upload_id):
        # bad_json, as every binary frame was before uploads.
        raise ProtocolError(
            "bad_json",
            "a binary frame is an image upload: its id (1-64 characters of "
            "A-Z a-z 0-9 _ . : -), a newline, then the image's bytes",
        )
    return UploadChunk(upload_id, frame[at + 1 :])


@dataclass(frozen=True, slots=True)
class Pending:
    """The uploads one ``generate`` took: their bytes, and why refused ones were."""

    data: dict[str, bytes]
    refused: dict[str, str]


class Uploads:
    """One connection's uploads, until the next request takes them."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._parts: dict[str, list[bytes]] = {}
        self._refused: dict[str, str] = {}
        #: The bytes held (every chunk kept).
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._parts)

    def add(self, chunk: UploadChunk) -> None:
        """Keep a chunk; a refusal (``too_large``) drops its whole upload."""
        if chunk.id in self._refused:
            return  # refused once already: said once
        parts = self._parts.get(chunk.id)
        if self.max_bytes == 0:
            self._refuse(chunk.id, "this server takes no uploads (limits.max_upload_bytes = 0)")
        if parts is None and len(self._parts) >= MAX_IMAGES:
            self._refuse(
                chunk.id, f"more than {MAX_IMAGES} uploads wait for a request on this connection"
            )
        if self.bytes + len(chunk.data) > self.max_bytes:
            self._refuse(
                chunk.id,
                f"the connection's uploads would exceed {self.max_bytes} bytes "
                "(limits.max_upload_bytes)",
            )
        if parts is None:
            parts = self._parts[chunk.id] = []
        parts.append(chunk.data)
        self.bytes += len(chunk.data)

    def take(self) -> Pending:
        """Every upload, each joined, and the refusals: none are kept after."""
        data = {upload_id: b"".join(parts) for upload_id, parts in self._parts.items()}
        pending = Pending(data, self._refused)
        self.clear()
        return pending

    def clear(self) -> None:
        self._parts = {}
        self._refused = {}
        self.bytes = 0

    def fail(self, upload_id: str, why: str) -> None:
        """Drop an upload (a piece of it was refused elsewhere: over the frame
        rate) and remember why, as a refusal here would."""
        dropped = self._parts.pop(upload_id, None)
        if dropped is not None:
            self.bytes -= sum(len(part) for part in dropped)
        if len(self._refused) < MAX_IMAGES:
            self._refused[upload_id] = why

    def _refuse(self, upload_id: str, why: str) -> None:
        self.fail(upload_id, why)
        raise ProtocolError("too_large", f"upload {upload_id!r} refused: {why}", upload_id)
