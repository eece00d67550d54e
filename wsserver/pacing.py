"""Frame pacing: when to turn pending tokens into one ``delta`` frame (sans-I/O).

A flush happens when any of these holds:

* it would carry the request's first text (time to first token never waits);
* ``flush_tokens`` tokens are pending;
* ``flush_window`` seconds have passed since the previous flush.

At a flush *everything* pending goes into one frame. While the socket is slow
the sender is parked in ``send()``; tokens pile up in the channel meanwhile and
come out merged at the next flush: fewer, larger frames, nothing dropped and
nothing reordered.
"""

from __future__ import annotations

__all__ = ["Coalescer"]


class Coalescer:
    """Accumulates text pieces and says when they should be flushed."""

    __slots__ = (
        "_flushed_once",
        "_last_flush",
        "_parts",
        "_tokens",
        "flush_tokens",
        "flush_window",
    )

    def __init__(self, *, flush_window: float, flush_tokens: int) -> None:
        if flush_window < 0 or flush_tokens < 1:
            raise ValueError("flush_window must be >= 0 and flush_tokens >= 1")
        self.flush_window = flush_window
        self.flush_tokens = flush_tokens
        self._parts: list[str] = []
        self._tokens = 0
        self._last_flush = 0.0
        self._flushed_once = False

    @property
    def pending(self) -> bool:
        """Whether tokens are waiting (text, or tokens whose text is held back)."""
        return self._tokens > 0 or bool(self._parts)

    @property
    def has_text(self) -> bool:
        """Whether text is waiting; only then can the window make a flush due."""
        return bool(self._parts)

    def add(self, text: str, tokens: int) -> None:
        if text:
            self._parts.append(text)
        self._tokens += tokens

    def due(self, now: float) -> bool:
        """Whether the pending tokens should be flushed now."""
        if not self._parts:
            return False
        if not self._flushed_once or self._tokens >= self.flush_tokens:
            return True
        return now >= self._last_flush + self.flush_window

    def deadline(self) -> float:
        """When the pending text becomes due by the window alone."""
        return self._last_flush + self.flush_window

    def take(self, now: float) -> tuple[str, int]:
        """Everything pending, as one text and its token count; resets the window."""
        text = "".join(self._parts)
        tokens = self._tokens
        self._parts.clear()
        self._tokens = 0
        if text:
            self._last_flush = now
            self._flushed_once = True
        return text, tokens
