"""Server-sent events, as an OpenAI-compatible server streams them (sans-I/O).

The upstream's body is fed in whatever chunks the socket delivers; an event
is complete at its blank line. Only ``data`` fields matter to a completion
stream (``event``, ``id`` and ``retry`` are read past, comments — lines that
start with ``:``, the keep-alives some servers send — ignored), and several
``data`` lines of one event join with newlines, as the WHATWG spec says.

Memory is bounded: a line or an event longer than ``max_event_bytes`` is a
malformed stream (:class:`SSEError`), not a reason to buffer without end.
Lines may end in LF, CRLF or a lone CR.
"""

from __future__ import annotations

from typing import Final

__all__ = ["DONE", "SSEError", "SSEParser"]

#: The data of the event that ends an OpenAI stream (OpenAI-compatible
#: upstreams send it; the OpenAI dialect ends its streams with it).
DONE: Final = "[DONE]"


class SSEError(ValueError):
    """The bytes are not a well-formed event stream (or exceed the bound)."""


class SSEParser:
    """Bytes in, the ``data`` of each complete event out."""

    __slots__ = ("_data", "_data_bytes", "_line", "_max", "_pending_cr")

    def __init__(self, max_event_bytes: int = 1 << 20) -> None:
        self._max = max_event_bytes
        self._line = bytearray()
        self._data: list[str] = []
        self._data_bytes = 0
        #: The last chunk ended in CR: a LF starting the next one belongs to it.
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[str]:
        """Add bytes; return the data of the events they completed, in order."""
        events: list[str] = []
        start = 0
        if self._pending_cr and chunk[:1] == b"\n":
            start = 1
        self._pending_cr = False
        size = len(chunk)
        while start < size:
            lf = chunk.find(b"\n", start)
            cr = chunk.find(b"\r", start, lf if lf >= 0 else size)
            end = cr if cr >= 0 else lf
            if end < 0:
                self._line += chunk[start:]
                if len(self._line) > self._max:
                    raise SSEError(f"an event stream line is longer than {self._max} bytes")
                break
            self._line += chunk[start:end]
            self._end_line(events)
            if end == cr:
                if cr + 1 == size:
                    self._pending_cr = True
                    start = size
                else:
                    start = cr + 2 if chunk[cr + 1 : cr + 2] == b"\n" else cr + 1
            else:
                start = lf + 1
        return events

    @property
    def partial(self) -> bool:
        """Whether bytes of an unfinished event are held (the stream was cut mid-event)."""
        return bool(self._line) or bool(self._data)

    def _end_line(self, events: list[str]) -> None:
        raw = bytes(self._line)
        self._line.clear()
        if not raw:
            if self._data:
                events.append("\n".join(self._data))
            self._data = []
            self._data_bytes = 0
            return
        if raw.startswith(b":"):
            return  # a comment
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SSEError("an event stream line is not UTF-8") from None
        name, colon, value = line.partition(":")
        if not colon:
            value = ""
        elif value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_bytes += len(raw)
            if self._data_bytes > self._max:
                raise SSEError(f"an event is longer than {self._max} bytes")
            self._data.append(value)
        # ``event``, ``id``, ``retry`` and unknown fields: nothing a completion needs.
