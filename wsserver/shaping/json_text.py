"""JSON text read as it arrives, piece by piece (sans-I/O).

A model writes JSON a token at a time, and what wraps its answer — a tool
call, llama.cpp's generic ``{"response": "…"}`` — must be read before it is
complete: :func:`json_extent` says where the value that opens a text ends
(or that it has not ended yet) — :class:`JsonExtent` says it piece by piece —,
:class:`JsonScanner` reports where each key and value of a JSON text begins
and ends as the text comes, so that a tool call's arguments can stream while
the model writes them, and :class:`StringDecoder` decodes the inside of a
JSON string as it comes, so that an answer inside one can stream.

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
from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["JsonEvent", "JsonExtent", "JsonScanner", "StringDecoder", "json_extent"]

_WS: Final = " \t\r\n"


def json_extent(text: str) -> int:
    """The length of the JSON object or array that opens ``text`` (after
    whitespace), or -1 while it is incomplete."""
    return JsonExtent().feed(text)


class JsonExtent:
    """:func:`json_extent` piece by piece: brackets are counted outside
    strings, nothing else is checked (a parse of the text says whether it is
    JSON)."""

    __slots__ = ("_depth", "_escaped", "_in_string", "end", "position")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = self._escaped = False
        #: How much text was read.
        self.position = 0
        #: The value's length once it ended, else -1.
        self.end = -1

    def feed(self, text: str) -> int:
        """Read more of the text: the value's length once it ended, else -1."""
        if self.end >= 0:
            return self.end
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for offset, char in enumerate(text):
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
                    self.end = self.position + offset + 1
                    break
            elif depth == 0 and char not in _WS:
                self.end = self.position + offset + 1  # not JSON: the parse of this much fails
                break
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        self.position += len(text)
        return self.end


@dataclass(frozen=True, slots=True)
class JsonEvent:
    """Where a part of a JSON text is: ``kind`` ``key`` (an object's key,
    its quotes included), ``open`` (a value begins: ``end`` is -1) or
    ``close`` (that value ended, ``end`` just after it). ``depth`` is the
    value's (the whole text's value is at 0; a key's is its value's);
    ``start`` and ``end`` are positions in the whole text read so far."""

    kind: Literal["key", "open", "close"]
    depth: int
    start: int
    end: int = -1


_SCALAR: Final = frozenset("-0123456789tfn")
_SCALAR_END: Final = frozenset(_WS + ",]}")


class JsonScanner:
    """The keys and values of one JSON value, found as its text comes in
    pieces (:meth:`feed`), with their positions (:class:`JsonEvent`).

    It follows JSON's structure, not its every rule (a number's digits and
    a literal's letters are not checked; a parse of the text does that).
    Text that breaks the structure makes it :attr:`broken`: it reports
    nothing more. After the value's end it reads nothing more."""

    __slots__ = (
        "_escaped",
        "_expect",
        "_in_string",
        "_key",
        "_scalar",
        "_stack",
        "_starts",
        "position",
    )

    def __init__(self) -> None:
        #: The open containers ("{" or "[") and where each began.
        self._stack: list[str] = []
        self._starts: list[int] = []
        #: What may come next: "value", "key" (or "}"), ":", "," (or a close), "end".
        self._expect = "value"
        self._in_string = self._escaped = self._key = False
        #: Where the string or scalar being read began (-1: none).
        self._scalar = -1
        #: How much text was read.
        self.position = 0

    @property
    def broken(self) -> bool:
        """Whether the text broke JSON's structure."""
        return self._expect == "broken"

    @property
    def ended(self) -> bool:
        """Whether the value ended."""
        return self._expect == "end"

    def feed(self, text: str) -> list[JsonEvent]:
        """Read more of the text: the events it holds, in order."""
        events: list[JsonEvent] = []
        base = self.position
        self.position += len(text)
        for offset, char in enumerate(text):
            if self._expect in ("end", "broken"):
                break
            position = base + offset
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    kind: Literal["key", "close"] = "key" if self._key else "close"
                    events.append(JsonEvent(kind, len(self._stack), self._scalar, position + 1))
                    self._scalar = -1
                    self._expect = ":" if self._key else self._after()
                continue
            if self._scalar >= 0:
                if char not in _SCALAR_END:
                    continue
                events.append(JsonEvent("close", len(self._stack), self._scalar, position))
                self._scalar = -1
                self._expect = self._after()
                if self._expect == "end":
                    break
            if char in _WS:
                continue
            self._step(char, position, events)
        return events

    def _after(self) -> str:
        """What may follow a value that ended."""
        return "," if self._stack else "end"

    def _step(self, char: str, position: int, events: list[JsonEvent]) -> None:
        """One character outside strings and scalars."""
        expect = self._expect
        top = self._stack[-1] if self._stack else ""
        if expect == "value" and char in "{[":
            events.append(JsonEvent("open", len(self._stack), position))
            self._stack.append(char)
            self._starts.append(position)
            self._expect = "key" if char == "{" else "value"
        elif expect == "value" and (char == '"' or char in _SCALAR):
            events.append(JsonEvent("open", len(self._stack), position))
            self._scalar = position
            self._in_string, self._key = char == '"', False
        elif expect == "key" and char == '"':
            self._scalar = position
            self._in_string = self._key = True
        elif expect == ":" and char == ":":
            self._expect = "value"
        elif expect == "," and char == ",":
            self._expect = "key" if top == "{" else "value"
        elif (char == "}" and top == "{" and expect in ("key", ",")) or (
            char == "]" and top == "[" and expect in ("value", ",")
        ):
            self._stack.pop()
            start = self._starts.pop()
            events.append(JsonEvent("close", len(self._stack), start, position + 1))
            self._expect = self._after()
        else:
            self._expect = "broken"


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
