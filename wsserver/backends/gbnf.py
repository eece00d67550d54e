"""llama.cpp's GBNF, read as its ``llama_grammar_parser`` reads it (sans-I/O).

:class:`GbnfParser` turns a grammar's text into nodes — a rule or a group
each, a list of alternatives of items — iteratively (no recursion, linear
time), so a hostile text costs it nothing: it is what
:mod:`.grammar_bounds` measures before any native code sees a grammar. It
refuses (:class:`GrammarRefused`) what llama.cpp would not read, would read
without end (``{5,2}``), would not enforce (a count above
:data:`MAX_REPEAT`) or would recurse on past its stack (groups nested beyond
:data:`MAX_NESTING`).
"""

from __future__ import annotations

import re
from typing import Any, Final

from ..errors import WireCode

__all__ = ["MAX_NESTING", "MAX_REPEAT", "UNBOUNDED", "GbnfParser", "GrammarRefused", "Item"]

#: Groups inside groups (llama.cpp's parser recurses once per level; ~19,000
#: overflow its 8 MiB stack). The schema converter nests an optional item per
#: ``maxItems``/``maxLength``, and llama.cpp itself refuses such a chain a
#: little above 1,000 ("exceeds sane defaults").
MAX_NESTING: Final = 1000
#: A ``{m,n}`` count: llama.cpp's own ``MAX_REPETITION_THRESHOLD`` (above it a
#: minimum is refused and a maximum silently dropped).
MAX_REPEAT: Final = 2000

_WORD: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_NAME: Final = re.compile(r"[a-zA-Z0-9-]+")
_SPACE: Final = re.compile(r"(?:[ \t]+|#[^\r\n]*)+")
_SPACE_NEWLINES: Final = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)+")
_PLAIN: Final = re.compile(r'[^"\\]+')
_DIGITS: Final = frozenset("0123456789")
_ESCAPES: Final = {"x": 2, "u": 4, "U": 8}
_SIMPLE_ESCAPES: Final = frozenset('trn\\"[]-')
UNBOUNDED: Final = -1

# An item of a sequence: [kind, payload, min, max, counted, elements]
#   kind: "t" a terminal (a literal, a class, a token, "."), "r" a rule
#   reference (payload: its name), "g" a group (payload: a node id);
#   min/max: its repetition (1, 1 when none; max UNBOUNDED for *, + and {m,});
#   counted: the repetition was {m,n} (llama.cpp unrolls it into a rule chain);
#   elements: the grammar elements it is made of (a literal's characters).
Item = list[Any]


class GrammarRefused(Exception):
    """The grammar is malformed (``bad_request``) or beyond a bound."""

    def __init__(self, message: str, code: WireCode = "unsupported_option") -> None:
        super().__init__(message)
        self.code = code


class GbnfParser:
    """llama.cpp's ``llama_grammar_parser`` syntax, iteratively.

    Groups become nodes of their own (as llama.cpp makes them rules); a rule is
    a node too. ``nodes[i]`` is a list of alternatives, each a list of items.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.n = len(text)
        self.nodes: list[list[list[Item]]] = []
        self.node_names: list[str] = []
        #: Rule name → its node (the last definition wins, as in llama.cpp).
        self.rules: dict[str, int] = {}
        self.nesting = 0

    def _space(self, pos: int, newline_ok: bool) -> int:
        match = (_SPACE_NEWLINES if newline_ok else _SPACE).match(self.text, pos)
        return match.end() if match else pos

    def _at(self, pos: int) -> str:
        return self.text[pos] if pos < self.n else ""

    def _where(self, pos: int) -> str:
        return repr(self.text[pos : pos + 20]) if pos < self.n else "the end"

    def _name(self, pos: int) -> int:
        start = pos
        match = _NAME.match(self.text, pos)
        pos = match.end() if match else pos
        if pos == start:
            raise GrammarRefused(
                f"could not be parsed: expecting a rule name at {self._where(start)}", "bad_request"
            )
        return pos

    def _int(self, pos: int) -> tuple[int, int]:
        start = pos
        while pos < self.n and self.text[pos] in _DIGITS:
            pos += 1
        if pos == start:
            raise GrammarRefused(
                f"could not be parsed: expecting an integer at {self._where(start)}", "bad_request"
            )
        if pos - start > 12:
            raise GrammarRefused(
                f"repeats something {self.text[start:pos]} times (at most {MAX_REPEAT})"
            )
        return int(self.text[start:pos]), pos

    def _char(self, pos: int) -> int:
        """The position after one (possibly escaped) character."""
        text = self.text
        if pos >= self.n:
            raise GrammarRefused("could not be parsed: unexpected end of input", "bad_request")
        if text[pos] != "\\":
            return pos + 1
        kind = self._at(pos + 1)
        if kind in _ESCAPES:
            digits = _ESCAPES[kind]
            hex_part = text[pos + 2 : pos + 2 + digits]
            if len(hex_part) != digits or any(h not in "0123456789abcdefABCDEF" for h in hex_part):
                raise GrammarRefused(
                    f"could not be parsed: expecting {digits} hex digits at {self._where(pos)}",
                    "bad_request",
                )
            return pos + 2 + digits
        if kind in _SIMPLE_ESCAPES:
            return pos + 2
        raise GrammarRefused(
            f"could not be parsed: unknown escape at {self._where(pos)}", "bad_request"
        )

    def parse(self) -> None:
        pos = self._space(0, True)
        while pos < self.n:
            pos = self._rule(pos)
        if "root" not in self.rules:
            raise GrammarRefused("could not be parsed: it has no 'root' rule", "bad_request")
        for node in self.nodes:
            for alternative in node:
                for item in alternative:
                    if item[0] == "r" and item[1] not in self.rules:
                        raise GrammarRefused(
                            f"could not be parsed: rule {item[1][:40]!r} is not defined",
                            "bad_request",
                        )

    def _new_node(self, name: str) -> int:
        self.nodes.append([])
        self.node_names.append(name)
        return len(self.nodes) - 1

    def _rule(self, pos: int) -> int:
        name_end = self._name(pos)
        name = self.text[pos:name_end]
        pos = self._space(name_end, False)
        if self.text[pos : pos + 3] != "::=":
            raise GrammarRefused(
                f"could not be parsed: expecting ::= at {self._where(pos)}", "bad_request"
            )
        pos = self._space(pos + 3, True)
        node = self._new_node(name)
        self.rules[name] = node
        # One frame per open group: (node, its alternatives so far, the
        # current sequence, nested). The rule's own body is the first.
        frames: list[tuple[int, list[list[Item]], list[Item], bool]] = [(node, [], [], False)]
        while True:
            owner, alternatives, sequence, nested = frames[-1]
            c = self._at(pos)
            item: Item | None = None
            if c == '"':
                pos += 1
                elements = 0
                while self._at(pos) != '"':
                    plain = _PLAIN.match(self.text, pos)
                    if plain:  # a run of characters without escapes
                        elements += plain.end() - pos
                        pos = plain.end()
                        continue
                    pos = self._char(pos)
                    elements += 1
                pos = self._space(pos + 1, nested)
                item = ["t", None, 1, 1, False, elements]
            elif c == "[":
                pos += 1
                if self._at(pos) == "^":
                    pos += 1
                elements = 0
                while self._at(pos) != "]":
                    pos = self._char(pos)
                    elements += 1
                    if self._at(pos) == "-" and self._at(pos + 1) not in ("]", ""):
                        pos = self._char(pos + 1)
                        elements += 1
                    elif self._at(pos) == "-" and self._at(pos + 1) == "":
                        raise GrammarRefused(
                            "could not be parsed: unexpected end of input", "bad_request"
                        )
                pos = self._space(pos + 1, nested)
                item = ["t", None, 1, 1, False, max(1, elements)]
            elif c in ("<", "!"):
                if c == "!":
                    pos += 1
                if self._at(pos) != "<":
                    raise GrammarRefused(
                        f"could not be parsed: expecting '<' at {self._where(pos)}", "bad_request"
                    )
                end = self.text.find(">", pos)
                if end < 0:
                    raise GrammarRefused(
                        "could not be parsed: a token without its '>'", "bad_request"
                    )
                pos = self._space(end + 1, nested)
                item = ["t", None, 1, 1, False, 1]
            elif c and c in _WORD:
                end = self._name(pos)
                item = ["r", self.text[pos:end], 1, 1, False, 1]
                pos = self._space(end, nested)
            elif c == "(":
                if len(frames) > MAX_NESTING:
                    raise GrammarRefused(
                        f"nests groups more than {MAX_NESTING} deep (at most {MAX_NESTING})"
                    )
                self.nesting = max(self.nesting, len(frames))
                group = self._new_node(f"{self.node_names[node]}")
                frames.append((group, [], [], True))
                pos = self._space(pos + 1, True)
                continue
            elif c == ".":
                pos = self._space(pos + 1, nested)
                item = ["t", None, 1, 1, False, 1]
            elif c in ("*", "+", "?"):
                pos = self._space(pos + 1, nested)
                low, high = {"*": (0, UNBOUNDED), "+": (1, UNBOUNDED), "?": (0, 1)}[c]
                self._repeat(sequence, low, high, counted=False, at=pos)
                continue
            elif c == "{":
                pos = self._space(pos + 1, nested)
                low, pos = self._int(pos)
                pos = self._space(pos, nested)
                high = low
                if self._at(pos) == ",":
                    pos = self._space(pos + 1, nested)
                    high = UNBOUNDED
                    if self._at(pos) in _DIGITS:
                        high, pos = self._int(pos)
                        pos = self._space(pos, nested)
                elif self._at(pos) != "}":
                    raise GrammarRefused(
                        f"could not be parsed: expecting ',' at {self._where(pos)}", "bad_request"
                    )
                if self._at(pos) != "}":
                    raise GrammarRefused(
                        f"could not be parsed: expecting '}}' at {self._where(pos)}", "bad_request"
                    )
                pos = self._space(pos + 1, nested)
                shown = f"{{{low},{'' if high == UNBOUNDED else high}}}"
                if high != UNBOUNDED and low > high:
                    raise GrammarRefused(
                        f"has the repetition {shown}, whose minimum is above its maximum",
                        "bad_request",
                    )
                if low > MAX_REPEAT or high > MAX_REPEAT:
                    raise GrammarRefused(
                        f"has the repetition {shown}: a count above {MAX_REPEAT} "
                        "(llama.cpp's limit; it would drop a maximum above it)"
                    )
                self._repeat(sequence, low, high, counted=True, at=pos)
                continue
            elif c == "|":
                alternatives.append(sequence)
                frames[-1] = (owner, alternatives, [], nested)
                pos = self._space(pos + 1, True)
                continue
            else:
                alternatives.append(sequence)
                self.nodes[owner] = alternatives
                if nested:
                    if c != ")":
                        raise GrammarRefused(
                            f"could not be parsed: expecting ')' at {self._where(pos)}",
                            "bad_request",
                        )
                    frames.pop()
                    parent = frames[-1]
                    parent[2].append(["g", owner, 1, 1, False, 1])
                    pos = self._space(pos + 1, parent[3])
                    continue
                break
            sequence.append(item)
        if c == "\r":
            pos += 2 if self._at(pos + 1) == "\n" else 1
        elif c == "\n":
            pos += 1
        elif c:
            raise GrammarRefused(
                f"could not be parsed: expecting a newline or the end at {self._where(pos)}",
                "bad_request",
            )
        return self._space(pos, True)

    def _repeat(self, sequence: list[Item], low: int, high: int, *, counted: bool, at: int) -> None:
        if not sequence or (sequence[-1][0] == "t" and sequence[-1][5] == 0):
            raise GrammarRefused(
                f"could not be parsed: a repetition without an item before it, at {self._where(at)}",
                "bad_request",
            )
        last = sequence[-1]
        if last[2] != 1 or last[3] != 1 or last[4]:
            # Repeating a repetition: llama.cpp repeats the whole of it.
            group = self._new_node(self.node_names[-1] if self.node_names else "")
            self.nodes[group] = [[last]]
            last = sequence[-1] = ["g", group, 1, 1, False, 1]
        last[2], last[3], last[4] = low, high, counted
