"""What a grammar may cost llama.cpp, measured before any native code sees it.

A GBNF grammar (a request's ``grammar``, or what a ``json_schema`` or the
tools' schemas become) is parsed and run by llama.cpp's native grammar engine,
inside calls that no cancel reaches. Measured on llama-cpp-python 0.3.36
(docs/operations.md, "Grammar and schema bounds", has the figures):

* its **parser recurses** once per nested group: 19,000 nested groups
  overflow an 8 MiB stack (the process dies with SIGSEGV) — which is what
  ``"maxItems": 20000`` becomes, as the schema converter nests each optional
  item inside the one before;
* a **malformed repetition** ``{5,2}`` (minimum above maximum) makes it
  generate rules without end (2^64 of them);
* a **repetition count above 2,000** is silently read as no maximum at all;
* **nested counted repetitions** multiply its parse stacks:
  ``((("a"{0,20}){0,20}){0,20})`` (40 bytes) never finishes a token, three
  levels of ``{1,10}`` cost seconds a token;
* **wide or deep rules** cost it at the grammar's start and at every token
  that enters them: 10,000 alternatives cost 0.15 s a token, a chain of
  10,000 rules each starting with the next 1.7 s to parse, ``r8 ::= r7? r7?
  r7? r7?`` (and so on down) 3 s to parse.

:func:`check_gbnf` parses the grammar here — the same syntax as llama.cpp's
``llama_grammar_parser``, iteratively (no recursion, linear time), so a hostile
text costs this parser nothing either — and refuses it, naming the bound and
its value, when it is malformed (``bad_request``) or beyond a bound below
(``unsupported_option``). :func:`check_schema` bounds a JSON Schema's sizes
before the converter (which builds strings of them) runs.

These bounds keep *each* native call short and the process alive; they
cannot see every ambiguous grammar (a grammar whose parse stacks multiply
with the text, through recursion, is not decidable from its shape). What
bounds those is the engine's: grammar work runs where the engine can stop
waiting for it (see :mod:`.llama_engine`, "Grammar work and its deadline").

No library parses GBNF to the structure these measures need (llguidance and
xgrammar parse their own dialects into their own engines; the ``gbnf``
package is a small, young port): this is a focused parser of what llama.cpp
reads, not a grammar engine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import BackendError, WireCode

__all__ = [
    "MAX_EXPANDED_ELEMENTS",
    "MAX_FANOUT",
    "MAX_GRAMMAR_BYTES",
    "MAX_NESTING",
    "MAX_REPEAT",
    "MAX_REPETITION_PRODUCT",
    "MAX_SCHEMA_COUNT",
    "MAX_START_DEPTH",
    "GrammarShape",
    "check_gbnf",
    "check_schema",
    "measure_gbnf",
]

#: Bytes of GBNF text (a converted schema included).
MAX_GRAMMAR_BYTES: Final = 256 * 1024
#: Groups inside groups (llama.cpp's parser recurses once per level; ~19,000
#: overflow its 8 MiB stack). The schema converter nests an optional item per
#: ``maxItems``/``maxLength``, and llama.cpp itself refuses such a chain a
#: little above 1,000 ("exceeds sane defaults").
MAX_NESTING: Final = 1000
#: A ``{m,n}`` count: llama.cpp's own ``MAX_REPETITION_THRESHOLD`` (above it a
#: minimum is refused and a maximum silently dropped).
MAX_REPEAT: Final = 2000
#: Nested counted repetitions: the product of their counts along any path of
#: groups and rule references (one level alone is not counted).
MAX_REPETITION_PRODUCT: Final = 256
#: Grammar elements once llama.cpp has unrolled every ``{m,n}`` (memory and
#: parse time).
MAX_EXPANDED_ELEMENTS: Final = 1_000_000
#: Parse stacks a rule opens before it reads a character (its alternatives,
#: and through optional items theirs): the stacks its first character is
#: checked against.
MAX_FANOUT: Final = 4096
#: Rule references one after the other before the first character (each is a
#: frame of every parse stack; llama.cpp copies stacks whole).
MAX_START_DEPTH: Final = 1000
#: ``maxItems``, ``minItems``, ``maxLength``, ``minLength`` of a JSON Schema,
#: and a counted quantifier in its ``pattern``: the converter nests or repeats
#: that many items (and their sum over the schema, times 20).
MAX_SCHEMA_COUNT: Final = MAX_NESTING

_WORD: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_NAME: Final = re.compile(r"[a-zA-Z0-9-]+")
_SPACE: Final = re.compile(r"(?:[ \t]+|#[^\r\n]*)+")
_SPACE_NEWLINES: Final = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)+")
_PLAIN: Final = re.compile(r'[^"\\]+')
_DIGITS: Final = frozenset("0123456789")
_ESCAPES: Final = {"x": 2, "u": 4, "U": 8}
_SIMPLE_ESCAPES: Final = frozenset('trn\\"[]-')
_UNBOUNDED: Final = -1

# An item of a sequence: [kind, payload, min, max, counted, elements]
#   kind: "t" a terminal (a literal, a class, a token, "."), "r" a rule
#   reference (payload: its name), "g" a group (payload: a node id);
#   min/max: its repetition (1, 1 when none; max _UNBOUNDED for *, + and {m,});
#   counted: the repetition was {m,n} (llama.cpp unrolls it into a rule chain);
#   elements: the grammar elements it is made of (a literal's characters).
_Item = list[Any]


class _Refused(Exception):
    def __init__(self, message: str, code: WireCode = "unsupported_option") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class GrammarShape:
    """What :func:`measure_gbnf` found (for tests, and the bounds' messages)."""

    bytes: int = 0
    rules: int = 0
    nesting: int = 0
    #: The largest product of nested counted repetitions (0: none nested).
    repetition_product: int = 0
    expanded_elements: int = 0
    fanout: int = 0
    start_depth: int = 0
    #: Where the worst of each measure was found (a rule's name).
    where: dict[str, str] = field(default_factory=dict)


def check_gbnf(text: str, *, subject: str = "'grammar'") -> GrammarShape:
    """Refuse ``text`` (raise :class:`~wsserver.errors.BackendError`) when it
    is malformed (``bad_request``) or beyond a bound (``unsupported_option``),
    naming the bound and its value; else its shape. ``subject`` starts the
    message (the request field it came from)."""
    try:
        return measure_gbnf(text)
    except _Refused as exc:
        raise BackendError(f"{subject} {exc}", code=exc.code) from None


def measure_gbnf(text: str) -> GrammarShape:
    """Parse ``text`` as llama.cpp does and measure it; raises ``_Refused``."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise _Refused(f"is {size} bytes (at most {MAX_GRAMMAR_BYTES} are served)")
    if "\x00" in text:
        raise _Refused("holds a NUL character", "bad_request")
    parser = _Parser(text)
    parser.parse()
    shape = _measure(parser)
    shape.bytes = size
    return shape


# ---------------------------------------------------------------- the parser


class _Parser:
    """llama.cpp's ``llama_grammar_parser`` syntax, iteratively.

    Groups become nodes of their own (as llama.cpp makes them rules); a rule is
    a node too. ``nodes[i]`` is a list of alternatives, each a list of items.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.n = len(text)
        self.nodes: list[list[list[_Item]]] = []
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
            raise _Refused(
                f"could not be parsed: expecting a rule name at {self._where(start)}", "bad_request"
            )
        return pos

    def _int(self, pos: int) -> tuple[int, int]:
        start = pos
        while pos < self.n and self.text[pos] in _DIGITS:
            pos += 1
        if pos == start:
            raise _Refused(
                f"could not be parsed: expecting an integer at {self._where(start)}", "bad_request"
            )
        if pos - start > 12:
            raise _Refused(f"repeats something {self.text[start:pos]} times (at most {MAX_REPEAT})")
        return int(self.text[start:pos]), pos

    def _char(self, pos: int) -> int:
        """The position after one (possibly escaped) character."""
        text = self.text
        if pos >= self.n:
            raise _Refused("could not be parsed: unexpected end of input", "bad_request")
        if text[pos] != "\\":
            return pos + 1
        kind = self._at(pos + 1)
        if kind in _ESCAPES:
            digits = _ESCAPES[kind]
            hex_part = text[pos + 2 : pos + 2 + digits]
            if len(hex_part) != digits or any(h not in "0123456789abcdefABCDEF" for h in hex_part):
                raise _Refused(
                    f"could not be parsed: expecting {digits} hex digits at {self._where(pos)}",
                    "bad_request",
                )
            return pos + 2 + digits
        if kind in _SIMPLE_ESCAPES:
            return pos + 2
        raise _Refused(f"could not be parsed: unknown escape at {self._where(pos)}", "bad_request")

    def parse(self) -> None:
        pos = self._space(0, True)
        while pos < self.n:
            pos = self._rule(pos)
        if "root" not in self.rules:
            raise _Refused("could not be parsed: it has no 'root' rule", "bad_request")
        for node in self.nodes:
            for alternative in node:
                for item in alternative:
                    if item[0] == "r" and item[1] not in self.rules:
                        raise _Refused(
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
            raise _Refused(
                f"could not be parsed: expecting ::= at {self._where(pos)}", "bad_request"
            )
        pos = self._space(pos + 3, True)
        node = self._new_node(name)
        self.rules[name] = node
        # One frame per open group: (node, its alternatives so far, the
        # current sequence, nested). The rule's own body is the first.
        frames: list[tuple[int, list[list[_Item]], list[_Item], bool]] = [(node, [], [], False)]
        while True:
            owner, alternatives, sequence, nested = frames[-1]
            c = self._at(pos)
            item: _Item | None = None
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
                        raise _Refused(
                            "could not be parsed: unexpected end of input", "bad_request"
                        )
                pos = self._space(pos + 1, nested)
                item = ["t", None, 1, 1, False, max(1, elements)]
            elif c in ("<", "!"):
                if c == "!":
                    pos += 1
                if self._at(pos) != "<":
                    raise _Refused(
                        f"could not be parsed: expecting '<' at {self._where(pos)}", "bad_request"
                    )
                end = self.text.find(">", pos)
                if end < 0:
                    raise _Refused("could not be parsed: a token without its '>'", "bad_request")
                pos = self._space(end + 1, nested)
                item = ["t", None, 1, 1, False, 1]
            elif c and c in _WORD:
                end = self._name(pos)
                item = ["r", self.text[pos:end], 1, 1, False, 1]
                pos = self._space(end, nested)
            elif c == "(":
                if len(frames) > MAX_NESTING:
                    raise _Refused(
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
                low, high = {"*": (0, _UNBOUNDED), "+": (1, _UNBOUNDED), "?": (0, 1)}[c]
                self._repeat(sequence, low, high, counted=False, at=pos)
                continue
            elif c == "{":
                pos = self._space(pos + 1, nested)
                low, pos = self._int(pos)
                pos = self._space(pos, nested)
                high = low
                if self._at(pos) == ",":
                    pos = self._space(pos + 1, nested)
                    high = _UNBOUNDED
                    if self._at(pos) in _DIGITS:
                        high, pos = self._int(pos)
                        pos = self._space(pos, nested)
                elif self._at(pos) != "}":
                    raise _Refused(
                        f"could not be parsed: expecting ',' at {self._where(pos)}", "bad_request"
                    )
                if self._at(pos) != "}":
                    raise _Refused(
                        f"could not be parsed: expecting '}}' at {self._where(pos)}", "bad_request"
                    )
                pos = self._space(pos + 1, nested)
                shown = f"{{{low},{'' if high == _UNBOUNDED else high}}}"
                if high != _UNBOUNDED and low > high:
                    raise _Refused(
                        f"has the repetition {shown}, whose minimum is above its maximum",
                        "bad_request",
                    )
                if low > MAX_REPEAT or high > MAX_REPEAT:
                    raise _Refused(
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
                        raise _Refused(
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
            raise _Refused(
                f"could not be parsed: expecting a newline or the end at {self._where(pos)}",
                "bad_request",
            )
        return self._space(pos, True)

    def _repeat(
        self, sequence: list[_Item], low: int, high: int, *, counted: bool, at: int
    ) -> None:
        if not sequence or (sequence[-1][0] == "t" and sequence[-1][5] == 0):
            raise _Refused(
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


# ---------------------------------------------------------------- the measures


def _measure(parser: _Parser) -> GrammarShape:
    nodes = parser.nodes
    count = len(nodes)
    rules = parser.rules
    shape = GrammarShape(rules=len(rules), nesting=parser.nesting)
    names = parser.node_names

    def target(item: _Item) -> int:
        return int(rules[item[1]]) if item[0] == "r" else int(item[1])

    # Unrolled size: every item copied as often as llama.cpp copies it.
    expanded = 0
    for node in nodes:
        for alternative in node:
            expanded += 1
            for item in alternative:
                copies = item[3] if item[3] != _UNBOUNDED else item[2] + 1
                expanded += item[5] * max(1, copies) * (2 if item[2] != item[3] else 1)
        if expanded > MAX_EXPANDED_ELEMENTS:
            raise _Refused(
                f"unrolls to more than {MAX_EXPANDED_ELEMENTS} grammar elements "
                f"(at most {MAX_EXPANDED_ELEMENTS}; repetition counts multiply what they repeat)"
            )
    shape.expanded_elements = expanded

    nullable = _nullable(nodes, target)

    def item_nullable(item: _Item) -> bool:
        return bool(item[2] == 0 or (item[0] != "t" and nullable[target(item)]))

    # Before the first character: the rule references each node may enter
    # (through optional items), in order. A cycle is left recursion, which
    # llama.cpp refuses too.
    first_edges: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    first_terms: list[int] = [0] * count
    for index, node in enumerate(nodes):
        for alternative in node:
            for item in alternative:
                copies = item[3] if item[3] != _UNBOUNDED else item[2] + 1
                # Optional copies of an item that may be empty each open its stacks.
                weight = max(1, copies) if item[0] != "t" and nullable[target(item)] else 1
                if item[0] == "t":
                    first_terms[index] += weight
                else:
                    first_edges[index].append((target(item), weight))
                if not item_nullable(item):
                    break
    order = _topological(first_edges, names)
    fanout = [0] * count
    depth = [0] * count
    for index in order:  # every node after those it enters
        stacks = first_terms[index]
        deepest = 0
        for child, weight in first_edges[index]:
            stacks += weight * fanout[child]
            deepest = max(deepest, depth[child] + 1)
        fanout[index] = min(stacks, MAX_FANOUT + 1)
        depth[index] = deepest
        if fanout[index] > MAX_FANOUT:
            raise _Refused(
                f"opens more than {MAX_FANOUT} parse stacks before one character (in rule "
                f"{names[index][:40]!r}: its alternatives, and through optional items theirs; "
                f"at most {MAX_FANOUT})"
            )
        if depth[index] > MAX_START_DEPTH:
            raise _Refused(
                f"enters more than {MAX_START_DEPTH} rules one inside the other before one "
                f"character (from rule {names[index][:40]!r}; at most {MAX_START_DEPTH})"
            )
    shape.fanout = max(fanout, default=0)
    shape.start_depth = max(depth, default=0)
    shape.repetition_product = _repetition_product(nodes, target, names)
    return shape


def _nullable(nodes: list[list[list[_Item]]], target: Any) -> list[bool]:
    """Which nodes can match the empty text (a worklist, linear)."""
    count = len(nodes)
    nullable = [False] * count
    # For each alternative: how many of its items are not yet known to be empty.
    pending: list[int] = []
    owner: list[int] = []
    waiting: list[list[int]] = [[] for _ in range(count)]
    ready: list[int] = []
    for index, node in enumerate(nodes):
        for alternative in node:
            alt = len(pending)
            owner.append(index)
            left = 0
            for item in alternative:
                if item[2] == 0:
                    continue
                if item[0] == "t":
                    left = -1  # never empty
                    break
                left += 1
                waiting[target(item)].append(alt)
            pending.append(left)
            if left == 0:
                ready.append(index)
    while ready:
        index = ready.pop()
        if nullable[index]:
            continue
        nullable[index] = True
        for alt in waiting[index]:
            if pending[alt] > 0:
                pending[alt] -= 1
                if pending[alt] == 0:
                    ready.append(owner[alt])
    return nullable


def _topological(edges: list[list[tuple[int, int]]], names: list[str]) -> list[int]:
    """Nodes, each after every node it has an edge to; a cycle is refused."""
    count = len(edges)
    state = [0] * count  # 0 new, 1 on the path, 2 done
    order: list[int] = []
    for start in range(count):
        if state[start]:
            continue
        stack = [(start, 0)]
        state[start] = 1
        while stack:
            node, i = stack[-1]
            if i < len(edges[node]):
                stack[-1] = (node, i + 1)
                child = edges[node][i][0]
                if state[child] == 1:
                    raise _Refused(
                        f"could not be parsed: rule {names[child][:40]!r} is left-recursive "
                        "(it can reach itself before a character)",
                        "bad_request",
                    )
                if state[child] == 0:
                    state[child] = 1
                    stack.append((child, 0))
            else:
                state[node] = 2
                order.append(node)
                stack.pop()
    return order


def _repetition_product(nodes: list[list[list[_Item]]], target: Any, names: list[str]) -> int:
    """The largest product of counted repetitions nested in one another (through
    groups and rule references), over two levels or more; a counted repetition
    that contains its own rule is unbounded."""
    count = len(nodes)
    edges: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    for index, node in enumerate(nodes):
        for alternative in node:
            for item in alternative:
                # A counted repetition unrolls into a chain of rules: its
                # position in the chain (0 to n) is one more frame of state.
                factor = 1
                if item[4]:
                    factor = (item[3] if item[3] != _UNBOUNDED else item[2]) + 1
                if item[0] == "t":
                    if factor > 1:
                        edges[index].append((-1, factor))
                    continue
                edges[index].append((target(item), factor))
    components = _components([[e for e in out if e[0] >= 0] for out in edges])
    component_of = [0] * count
    for number, members in enumerate(components):
        for member in members:
            component_of[member] = number
    cap = MAX_REPETITION_PRODUCT + 1
    # single[c]: the largest product below a component (one level or more);
    # nested[c]: the same over two levels or more (0: none).
    single = [1] * len(components)
    nested = [0] * len(components)
    for number, members in enumerate(components):  # reverse topological order
        best_single, best_nested = 1, 0
        for member in members:
            for child, factor in edges[member]:
                if child < 0:  # a counted terminal: one level
                    best_single = max(best_single, min(cap, factor))
                    continue
                inner = component_of[child]
                if inner == number:
                    if factor > 1:
                        raise _Refused(
                            f"repeats a count of {factor} around rule {names[member][:40]!r}, "
                            "which contains itself: the counts multiply without bound "
                            f"(nested counted repetitions are served up to a product of "
                            f"{MAX_REPETITION_PRODUCT})"
                        )
                    continue
                best_single = max(best_single, min(cap, factor * single[inner]))
                best_nested = max(best_nested, nested[inner])
                if factor > 1 and single[inner] > 1:
                    best_nested = max(best_nested, min(cap, factor * single[inner]))
        single[number], nested[number] = best_single, best_nested
        if best_nested > MAX_REPETITION_PRODUCT:
            raise _Refused(
                f"nests counted repetitions whose counts multiply to more than "
                f"{MAX_REPETITION_PRODUCT} (in rule {names[members[0]][:40]!r}; at most "
                f"{MAX_REPETITION_PRODUCT}: llama.cpp's grammar engine keeps a parse stack "
                "per way to split the text among them)"
            )
    return max(nested, default=0)


def _components(edges: list[list[tuple[int, int]]]) -> list[list[int]]:
    """Strongly connected components (Tarjan, iteratively), each after those it reaches."""
    count = len(edges)
    index_of = [-1] * count
    low = [0] * count
    on_stack = [False] * count
    stack: list[int] = []
    components: list[list[int]] = []
    counter = 0
    for start in range(count):
        if index_of[start] >= 0:
            continue
        work = [(start, 0)]
        index_of[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack[start] = True
        while work:
            node, i = work[-1]
            if i < len(edges[node]):
                work[-1] = (node, i + 1)
                child = edges[node][i][0]
                if index_of[child] < 0:
                    index_of[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack[child] = True
                    work.append((child, 0))
                elif on_stack[child]:
                    low[node] = min(low[node], index_of[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index_of[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack[member] = False
                    members.append(member)
                    if member == node:
                        break
                components.append(members)
    return components


# ---------------------------------------------------------------- JSON Schema

_COUNT_KEYS: Final = ("maxItems", "minItems", "maxLength", "minLength")
_QUANTIFIER = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def check_schema(schema: Any, *, field_name: str = "json_schema") -> None:
    """Bound what the schema converter builds before it runs: each of
    :data:`_COUNT_KEYS` and each counted quantifier of a ``pattern`` at most
    :data:`MAX_SCHEMA_COUNT`, their sum over the schema at most 20 times that,
    and a pattern's nested quantifiers multiplied at most that. Raises
    :class:`~wsserver.errors.BackendError` (``unsupported_option``)."""
    total = 0
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        where = path or "the top level"
        for key in _COUNT_KEYS:
            value = node.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if value > MAX_SCHEMA_COUNT:
                raise BackendError(
                    f"'{field_name}' asks for {key} {_number(value)} at {where} (at most "
                    f"{MAX_SCHEMA_COUNT} are served: llama.cpp's grammar nests an item per count)",
                    code="unsupported_option",
                )
            total += max(0, int(value))
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            total += _pattern_cost(pattern, field_name, where)
        if total > 20 * MAX_SCHEMA_COUNT:
            raise BackendError(
                f"'{field_name}' asks for more than {20 * MAX_SCHEMA_COUNT} repeated items and "
                f"characters in all (maxItems, minItems, maxLength, minLength and pattern counts "
                f"added up; at most {20 * MAX_SCHEMA_COUNT})",
                code="unsupported_option",
            )
        for key, child in node.items():
            if isinstance(child, dict | list) and key not in (
                "enum",
                "const",
                "examples",
                "default",
            ):
                stack.append((child, f"{path}.{key}".lstrip(".")))


def _pattern_cost(pattern: str, field_name: str, where: str) -> int:
    """The characters and groups the converter writes for ``pattern``: an
    atom counts 1, a group what it holds, and a counted quantifier multiplies
    what it follows by its count (``(a{1,9}){1,9}`` is 81; ``*``, ``+`` and
    ``?`` are one rule each). Raises when a count, or the whole, is too many."""
    budget = 20 * MAX_SCHEMA_COUNT
    levels = [0]  # what each open group holds so far
    last = 0  # what the atom before a quantifier holds
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last = 1
        elif c == "[":
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
            last = 1
        elif c == "(":
            levels.append(0)
            i += 1
            last = 0
            continue
        elif c == ")" and len(levels) > 1:
            last = levels.pop()
            i += 1
        elif c == "{" and (match := _QUANTIFIER.match(pattern, i)):
            count = _quantifier_count(match, field_name, where)
            levels[-1] += last * (max(1, count) - 1)
            last *= max(1, count)
            i = match.end()
            if levels[-1] > budget:
                break
            continue
        elif c in "*+?|":
            i += 1
            last = 0 if c == "|" else last
            continue
        else:
            i += 1
            last = 1
        levels[-1] += last
        if levels[-1] > budget:
            break
    cost = sum(levels)
    if cost > budget:
        raise BackendError(
            f"'{field_name}' has a pattern at {where} whose counted quantifiers, nested, "
            f"write more than {budget} items (at most {budget})",
            code="unsupported_option",
        )
    return cost


def _quantifier_count(match: re.Match[str], field_name: str, where: str) -> int:
    low_text, high_text = match.group(1), match.group(2)
    low = int(low_text) if len(low_text) <= 12 else 10**12
    if high_text is None or high_text == "":
        high = low
    else:
        high = int(high_text) if len(high_text) <= 12 else 10**12
    count = max(low, high)
    if count > MAX_SCHEMA_COUNT:
        raise BackendError(
            f"'{field_name}' has a pattern at {where} that repeats something {count} times "
            f"(at most {MAX_SCHEMA_COUNT} are served)",
            code="unsupported_option",
        )
    return count


def _number(value: float) -> str:
    return json.dumps(value) if abs(value) < 1e15 else f"{value:.3g}"
