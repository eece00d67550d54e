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
waiting for it (see :mod:`.llama_samplers`, "Grammar work and its deadline").

No library parses GBNF to the structure these measures need (llguidance and
xgrammar parse their own dialects into their own engines; the ``gbnf``
package is a small, young port): this is a focused parser of what llama.cpp
reads, not a grammar engine.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from ..errors import BackendError
from .gbnf import MAX_NESTING, MAX_REPEAT, GbnfParser, GrammarRefused
from .gbnf_measure import (
    MAX_EXPANDED_ELEMENTS,
    MAX_FANOUT,
    MAX_REPETITION_PRODUCT,
    MAX_START_DEPTH,
    GrammarShape,
    measure,
)

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
#: ``maxItems``, ``minItems``, ``maxLength``, ``minLength`` of a JSON Schema,
#: and a counted quantifier in its ``pattern``: the converter nests or repeats
#: that many items (and their sum over the schema, times 20).
MAX_SCHEMA_COUNT: Final = MAX_NESTING


def check_gbnf(text: str, *, subject: str = "'grammar'") -> GrammarShape:
    """Refuse ``text`` (raise :class:`~wsserver.errors.BackendError`) when it
    is malformed (``bad_request``) or beyond a bound (``unsupported_option``),
    naming the bound and its value; else its shape. ``subject`` starts the
    message (the request field it came from)."""
    try:
        return measure_gbnf(text)
    except GrammarRefused as exc:
        raise BackendError(f"{subject} {exc}", code=exc.code) from None


def measure_gbnf(text: str) -> GrammarShape:
    """Parse ``text`` as llama.cpp does and measure it; raises ``GrammarRefused``."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarRefused(f"is {size} bytes (at most {MAX_GRAMMAR_BYTES} are served)")
    if "\x00" in text:
        raise GrammarRefused("holds a NUL character", "bad_request")
    parser = GbnfParser(text)
    parser.parse()
    shape = measure(parser)
    shape.bytes = size
    return shape


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
