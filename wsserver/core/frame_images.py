"""A ``generate`` frame's images: a user message's ``images`` read into bytes (sans-I/O).

Each entry of ``images`` is one of (docs/protocol.md, "Images"):

* a base64 string (Ollama's shape), or a ``data:image/…;base64,`` URL —
  inside the JSON frame, so within ``limits.max_frame_bytes``;
* ``{"upload": "<id>"}``: the bytes of an upload this connection sent in
  binary frames before this request (:mod:`wsserver.core.uploads`), the
  cheap way for anything larger than a thumbnail.

A message's ``audio`` takes the same three shapes (a ``data:audio/…``
URL), each entry a WAV, MP3 or FLAC file; its sounds go after its images.

Every image is then checked from its header and the request's images are
bounded together (:class:`~wsserver.core.image_check.ImageBudget`); a
refusal names the image by its index in the request and its place
(``image 1 (messages[0].images[1]): …``).
"""

from __future__ import annotations

from typing import Any

from .image_check import MAX_AUDIO, MAX_IMAGES, ImageBudget
from .uploads import Pending

__all__ = ["FrameImages"]


class FrameImages:
    """Reads one request's images, in order, from its frame and its uploads."""

    def __init__(self, budget: ImageBudget, pending: Pending | None) -> None:
        self.budget = budget
        self.pending = pending

    def __call__(self, value: Any, where: str, kind: str = "images") -> tuple[bytes, ...]:
        """One message's ``images`` or ``audio`` (``kind``; ``where``:
        ``messages[i].images``)."""
        budget = self.budget
        most, noun = (MAX_IMAGES, "images") if kind == "images" else (MAX_AUDIO, "audio clips")
        if not isinstance(value, list) or len(value) > most:
            raise budget.fail(f"{where} must be a list of at most {most} {noun}")
        one = self._one if kind == "images" else self._sound
        return tuple(one(item, f"{where}[{k}]") for k, item in enumerate(value))

    def _sound(self, item: Any, where: str) -> bytes:
        budget = self.budget
        if isinstance(item, str):
            if item.startswith("data:"):
                head, comma, payload = item.partition(",")
                if not comma or not head.endswith(";base64"):
                    raise budget.fail(
                        f"audio {budget.sounds} ({where}): expected a data URL "
                        "(data:audio/wav;base64,...)"
                    )
                item = payload
            return budget.audio_from_base64(item, where)
        return budget.take_audio(self._upload(item, where, f"audio {budget.sounds}"), where)

    def _one(self, item: Any, where: str) -> bytes:
        budget = self.budget
        if isinstance(item, str):
            if item.startswith("data:"):
                return budget.from_url(item, where)
            return budget.from_base64(item, where)
        return budget.take(self._upload(item, where, f"image {budget.count}"), where)

    def _upload(self, item: Any, where: str, name: str) -> bytes:
        """The bytes of the upload ``item`` names (``{"upload": "<id>"}``)."""
        budget = self.budget
        upload = item.get("upload") if isinstance(item, dict) and len(item) == 1 else None
        if not isinstance(upload, str):
            noun = "an image" if name.startswith("image") else "a sound"
            raise budget.fail(
                f"{name} ({where}): {noun} is a base64 string, a data: URL, "
                'or {"upload": "<id>"} naming an upload sent in binary frames'
            )
        pending = self.pending
        data = pending.data.get(upload) if pending is not None else None
        if data is None:
            refused = pending.refused.get(upload) if pending is not None else None
            why = (
                f"it was refused: {refused}"
                if refused is not None
                else "uploads are kept until the next generate or restart, which takes them all"
            )
            raise budget.fail(
                f"{name} ({where}): no upload {upload[:64]!r} on this connection ({why})"
            )
        return data
