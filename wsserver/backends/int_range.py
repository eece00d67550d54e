"""An integer's bounds as GBNF: JSON Schema ``minimum``/``maximum`` (and the
exclusive bounds) on ``"type": "integer"`` (sans-I/O).

llama.cpp's own JSON-Schema converter (``common/json-schema-to-grammar.cpp``,
``_build_min_max_int``) enforces integer bounds; the Python port that
llama-cpp-python ships does not (its TODO), so the llama engine refused them.
This is llama.cpp's construction (its ``uniform_range``, ported): the decimal
numbers from ``low`` to ``high`` as digit ranges — each length's numbers
between the bound's digits, ``[0-9]{n}`` where any digit will do — without
leading zeros, with a ``-`` for the negative part (``-0`` is never written),
at most 16 digits where a side is open (64-bit integers, as llama.cpp). An
open side is written directly — the bound's length from the bound up, then
every longer number — rather than by llama.cpp's recursion for it, which,
ported as its json-schema-to-grammar.cpp writes it, lets ``minimum: 100``
take ``10`` to ``19`` (tests/test_int_range.py caught it). :func:`integer_rule` is the rule's body;
:func:`bounds` reads a schema's bounds (a fractional bound rounded inward; an
exclusive one moved by one).
"""

from __future__ import annotations

import math
from typing import Any, Final

__all__ = ["BOUND_KEYWORDS", "MAX_DIGITS", "bounds", "integer_rule"]

#: The keywords an integer's bounds are given by.
BOUND_KEYWORDS: Final = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
#: Digits where a side is open (llama.cpp's ``decimals_left``).
MAX_DIGITS: Final = 16


def bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """The smallest and largest integer ``schema`` allows (None: no bound);
    ``ValueError`` for a bound that is not a number, or bounds no integer meets."""
    low: int | None = None
    high: int | None = None
    for key in ("minimum", "exclusiveMinimum"):
        if key in schema:
            value = _number(schema[key], key)
            edge = math.floor(value) + 1 if key == "exclusiveMinimum" else math.ceil(value)
            low = edge if low is None else max(low, edge)
    for key in ("maximum", "exclusiveMaximum"):
        if key in schema:
            value = _number(schema[key], key)
            edge = math.ceil(value) - 1 if key == "exclusiveMaximum" else math.floor(value)
            high = edge if high is None else min(high, edge)
    if low is not None and high is not None and low > high:
        raise ValueError(f"no integer is at least {low} and at most {high}")
    limit = 10**MAX_DIGITS
    for given in (low, high):
        if given is not None and abs(given) >= limit:
            raise ValueError(f"a bound of {given} has more than {MAX_DIGITS} digits")
    return low, high


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"'{key}' must be a number")
    return value


def integer_rule(low: int | None, high: int | None) -> str:
    """The GBNF of the integers from ``low`` to ``high`` (None: open), one
    of them at least given; without the trailing ``space``."""
    if low is None and high is None:
        raise ValueError("at least one bound is needed")
    if low is not None and high is not None:
        return _between(low, high)
    if low is not None:
        return _at_least(low)
    assert high is not None
    if high >= 0:
        out = ['"-" [1-9] ']
        _more_digits(0, MAX_DIGITS - 1, out)
        return "".join(out) + " | " + _between(0, high)
    return f'"-" ({_at_least(-high)})'


def _at_least(low: int) -> str:
    """The integers from ``low`` up, of at most :data:`MAX_DIGITS` digits:
    those of ``low``'s length from it up, then every longer one."""
    if low < 0:
        out = [f'"-" ({_between(1, -low)}) | [0] | [1-9] ']
        _more_digits(0, MAX_DIGITS - 1, out)
        return "".join(out)
    low_s = str(low)
    out = []
    _uniform_range(low_s, "9" * len(low_s), out)
    if len(low_s) < MAX_DIGITS:
        out.append(" | [1-9] ")
        _more_digits(len(low_s), MAX_DIGITS - 1, out)
    return "".join(out)


def _between(low: int, high: int) -> str:
    """The integers from ``low`` to ``high``: a uniform range per length."""
    out: list[str] = []
    if low < 0 and high < 0:
        return f'"-" ({_between(-high, -low)})'
    if low < 0:
        out.append(f'"-" ({_between(1, -low)}) | ')
        low = 0
    low_s, high_s = str(low), str(high)
    for length in range(len(low_s), len(high_s)):
        _uniform_range(low_s, "9" * length, out)
        low_s = "1" + "0" * length
        out.append(" | ")
    _uniform_range(low_s, high_s, out)
    return "".join(out)


def _digit_range(low: str, high: str, out: list[str]) -> None:
    out.append(f"[{low}]" if low == high else f"[{low}-{high}]")


def _more_digits(least: int, most: int, out: list[str]) -> None:
    out.append("[0-9]")
    if least == most == 1:
        return
    out.append("{" + str(least))
    if most != least:
        out.append(",")
        out.append(str(most))
    out.append("}")


def _uniform_range(low: str, high: str, out: list[str]) -> None:
    """The numbers of ``len(low)`` digits from ``low`` to ``high``."""
    i = 0
    while i < len(low) and i < len(high) and low[i] == high[i]:
        i += 1
    if i > 0:
        out.append(f'"{low[:i]}"')
    if i < len(low) and i < len(high):
        if i > 0:
            out.append(" ")
        rest = len(low) - i - 1
        if rest > 0:
            low_rest, high_rest = low[i + 1 :], high[i + 1 :]
            zeros, nines = "0" * rest, "9" * rest
            high_reached = False
            out.append("(")
            if low_rest == zeros:
                _digit_range(low[i], chr(ord(high[i]) - 1), out)
                out.append(" ")
                _more_digits(rest, rest, out)
            else:
                out.append(f"[{low[i]}] (")
                _uniform_range(low_rest, nines, out)
                out.append(")")
                if ord(low[i]) < ord(high[i]) - 1:
                    out.append(" | ")
                    if high_rest == nines:
                        _digit_range(chr(ord(low[i]) + 1), high[i], out)
                        high_reached = True
                    else:
                        _digit_range(chr(ord(low[i]) + 1), chr(ord(high[i]) - 1), out)
                    out.append(" ")
                    _more_digits(rest, rest, out)
            if not high_reached:
                out.append(" | ")
                _digit_range(high[i], high[i], out)
                out.append(" ")
                _uniform_range(zeros, high_rest, out)
            out.append(")")
        else:
            out.append(f"[{low[i]}-{high[i]}]")
