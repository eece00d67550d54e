"""JSON text read as it arrives, piece by piece (sans-I/O).

A model writes JSON a token at a time, and what wraps its answer — a tool
call, llama.cpp's generic ``{"response": "…"}`` — must be read before it is
complete: :func:`json_extent` says where the value that opens a text ends
(or that it has not ended yet), and :class:`StringDecoder` decodes the inside
of a JSON string as it comes, so that an answer inside one can stream.

A JSON string's escapes can be split anywhere by the tokens: ``\\`` in one
piece and ``n`` in the next, ``\\u00`` and ``e9``, or a character outside the
Basic Multilingual Plane written as two escapes (a UTF-16 surrogate pair,
``\\ud83d\\ude00``) split between or inside them. The decoder holds back
exactly what is not decided yet — an incomplete escape, a high surrogate
waiting for its low half — and never takes back what it gave. A surrogate
without its other half (which JSON allows and UTF-8 cannot carry) becomes
U+FFFD.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["StringDecoder", "json_extent"]

_WS: Final = " \t\r\n"


def json_extent(text: str) -> int:
    """The length of the JSON object or array that opens ``text`` (after
    whitespace), or -1 while it is incomplete."""
    depth = 0
    in_string = escaped = False
    for position, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return position + 1
        elif depth == 0 and char not in _WS:
            return position + 1  # not JSON: the parse of this much fails
    return -1


_ESCAPES: Final = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}
_PLAIN: Final = re.compile(r'[^"\\]+')
_HEX: Final = re.compile(r"[0-9a-fA-F]{4}")
_REPLACEMENT: Final = "\ufffd"


class StringDecoder:
    """The inside of one JSON string (after its opening quote), decoded piece
    by piece: :meth:`feed` gives what each piece decides."""

    __slots__ = ("_held", "_high", "closed")

    def __init__(self) -> None:
        #: An escape not complete yet (``\\`` or ``\\u`` and up to three digits).
        self._held = ""
        #: A high surrogate waiting for its low half.
        self._high: int | None = None
        #: The closing quote was read.
        self.closed = False

    def feed(self, text: str) -> tuple[str, int | None]:
        """The characters ``text`` decides, and — once the closing quote is in
        it — the position in ``text`` just after that quote (None before)."""
        if self.closed:
            return "", 0
        held = len(self._held)
        data = self._held + text
        self._held = ""
        out: list[str] = []
        position = 0
        while position < len(data):
            char = data[position]
            if char == '"':
                self._settle(out)
                self.closed = True
                return "".join(out), position + 1 - held
            if char != "\\":
                plain = _PLAIN.match(data, position)
                assert plain is not None
                self._settle(out)
                out.append(plain.group())
                position = plain.end()
                continue
            if position + 1 >= len(data):
                break  # a lone backslash: its escape comes next
            escape = data[position + 1]
            if escape != "u":
                self._settle(out)
                out.append(_ESCAPES.get(escape, escape))
                position += 2
                continue
            digits = data[position + 2 : position + 6]
            if len(digits) < 4 and _HEX.match(digits.ljust(4, "0")):
                break  # "\u" and some of its four digits: the rest comes next
            position += 2
            if _HEX.fullmatch(digits) is None:
                self._settle(out)
                out.append(_REPLACEMENT)  # not an escape JSON allows
                continue
            position += 4
            self._code(int(digits, 16), out)
        self._held = data[position:]
        return "".join(out), None

    def _code(self, code: int, out: list[str]) -> None:
        """One ``\\uXXXX``: a character, or half of a surrogate pair."""
        if 0xDC00 <= code < 0xE000:
            if self._high is not None:
                pair = 0x10000 + ((self._high - 0xD800) << 10) + (code - 0xDC00)
                self._high = None
                out.append(chr(pair))
            else:
                out.append(_REPLACEMENT)  # a low half alone
            return
        self._settle(out)
        if 0xD800 <= code < 0xDC00:
            self._high = code  # wait for the low half
        else:
            out.append(chr(code))

    def _settle(self, out: list[str]) -> None:
        """Something other than a low half follows: a waiting high half is alone."""
        if self._high is not None:
            self._high = None
            out.append(_REPLACEMENT)
