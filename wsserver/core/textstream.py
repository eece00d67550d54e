"""Bytes from a model → text that is safe to put on the wire (sans-I/O).

Byte-level tokens split multi-byte characters: a CJK character or an emoji may
arrive as two to four tokens, and decoding each alone yields U+FFFD. A stop
string may likewise arrive over several tokens. :class:`TextAssembler` decodes
incrementally, holds back an incomplete character, and holds back any tail of
the text that could still become a stop string, so that what it releases is
always final: valid UTF-8, never part of a stop string, never taken back.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["TextAssembler"]


class TextAssembler:
    """Incremental UTF-8 decoder with stop-string detection."""

    __slots__ = ("_decoder", "_held", "_max_stop", "_stops", "stop_string", "stopped")

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._stops = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._held = ""
        #: Set once a stop string was seen; nothing more is released after it.
        self.stopped = False
        #: The stop string that ended the text (the earliest in the text; of
        #: two starting at the same place, the shorter, which was complete first).
        self.stop_string: str | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings watched for."""
        return self._stops

    def feed(self, data: bytes) -> str:
        """Add a token's bytes; return the text that is now final (maybe "")."""
        if self.stopped:
            return ""
        return self._release(self._decoder.decode(data, final=False))

    def feed_text(self, text: str) -> str:
        """Add already-decoded text (for backends that yield ``str``)."""
        if self.stopped:
            return ""
        return self._release(text)

    def flush(self) -> str:
        """End of generation: release what was held back.

        Bytes that never formed a valid character (generation ended inside
        one, or the model emitted invalid UTF-8) are dropped, as
        llama-cpp-python's own completion text drops them (``errors="ignore"``),
        so the streamed text equals the non-streamed one.
        """
        if self.stopped:
            return ""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return self._cut_at_stop(text)[0]

    def _release(self, new: str) -> str:
        if not new:
            return ""
        if not self._stops:
            return new
        text = self._held + new
        head, hit = self._cut_at_stop(text)
        if hit:
            self._held = ""
            return head
        # Keep back the longest tail that is a prefix of some stop string.
        keep = 0
        for length in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stops):
                keep = length
                break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _cut_at_stop(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        found = [(i, len(s), s) for s in self._stops if (i := text.find(s)) >= 0]
        if not found:
            return text, False
        cut, _, self.stop_string = min(found)
        self.stopped = True
        return text[:cut], True
