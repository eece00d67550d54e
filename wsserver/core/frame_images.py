"""A ``generate`` frame's images: a user message's ``images`` read into bytes (sans-I/O).

Each entry of ``images`` is one of (docs/protocol.md, "Images"):

* a base64 string (Ollama's shape), or a ``data:image/…;base64,`` URL —
  inside the JSON frame, so within ``limits.max_frame_bytes``;
* ``{"upload": "<id>"}``: the bytes of an upload this connection sent in
  binary frames before this request (:mod:`wsserver.core.uploads`), the
  cheap way for anything larger than a thumbnail.

Every image is then checked from its header and the request's images are
bounded together (:class:`~wsserver.core.image_check.ImageBudget`); a
refusal names the image by its index in the request and its place
(``image 1 (messages[0].images[1]): …``).
"""

from __future__ import annotations

from typing import Any

from .image_check import MAX_IMAGES, ImageBudget
from .uploads import Pending

__all__ = ["FrameImages"]


class FrameImages:
    """Reads one request's images, in order, from its frame and its uploads."""

    def __init__(self, budget: ImageBudget, pending: Pending | None) -> None:
        self.budget = budget
        self.pending = pending

    def __call__(self, value: Any, where: str) -> tuple[bytes, ...]:
        """One message's ``images`` (``where``: ``messages[i].images``)."""
        budget = self.budget
        if not isinstance(value, list) or len(value) > MAX_IMAGES:
            raise budget.fail(f"{where} must be a list of at most {MAX_IMAGES} images")
        return tuple(self._one(item, f"{where}[{k}]") for k, item in enumerate(value))

    def _one(self, item: Any, where: str) -> bytes:
        budget = self.budget
        if isinstance(item, str):
            if item.startswith("data:"):
                return budget.from_url(item, where)
            return budget.from_base64(item, where)
        upload = item.get("upload") if isinstance(item, dict) and len(item) == 1 else None
        if not isinstance(upload, str):
            raise budget.fail(
                f"image {budget.count} ({where}): an image is a base64 string, a data: URL, "
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
                f"image {budget.count} ({where}): no upload {upload[:64]!r} on this "
                f"connection ({why})"
            )
        return budget.take(data, where)
