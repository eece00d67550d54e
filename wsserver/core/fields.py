"""Checks every frame's fields share: ids, known keys, numbers (sans-I/O).

A failed check is a :class:`~wsserver.errors.ProtocolError` (``bad_request``)
that names the field; the caller adds the request's id.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, Final

from ..errors import ProtocolError

__all__ = [
    "ID_PATTERN",
    "ID_RE",
    "MAX_KEEP_ALIVE_S",
    "MAX_STOP_CHARS",
    "MAX_STOP_STRINGS",
    "check_keys",
    "is_int",
    "parse_float",
    "parse_id",
    "parse_ints",
    "parse_keep_alive",
    "parse_stop",
    "parse_string",
    "parse_word",
]

#: The request-id rule. Copied into clients/js (wsserver.js, wsserver.d.ts) and
#: docs/protocol.schema.json; tests/test_wire_copies.py checks the copies match.
ID_PATTERN: Final = r"[A-Za-z0-9_.:-]{1,64}"
ID_RE: Final = re.compile(ID_PATTERN)
#: The longest ``keep_alive`` a request may give, seconds (a year).
MAX_KEEP_ALIVE_S: Final = 365 * 86400.0
#: Stop strings a request may give, and their length (copied like the ID rule).
MAX_STOP_STRINGS: Final = 4
MAX_STOP_CHARS: Final = 128
# JSON integers outside this range are refused: llama.cpp takes 32-bit seeds
# and nothing else in the protocol needs more.
_INT_MAX: Final = 2**63 - 1


def parse_float(
    value: Any, name: str, low: float, high: float, fail: Callable[[str], Exception]
) -> float:
    """``value`` as a finite number in [``low``, ``high``]; else ``fail``'s error."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(f"'{name}' must be a number")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise fail(f"'{name}' must be between {low:g} and {high:g}")
    return number


def is_int(value: Any) -> bool:
    """A JSON integer (not a bool) within 64 bits."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= _INT_MAX


def parse_id(obj: dict[str, Any], key: str) -> str:
    """``obj[key]`` as a request id (:data:`ID_PATTERN`)."""
    value = obj.get(key)
    if not isinstance(value, str) or not ID_RE.fullmatch(value):
        raise ProtocolError(
            "bad_request", f"'{key}' must be 1-64 characters of A-Z a-z 0-9 _ . : -"
        )
    return value


def check_keys(obj: dict[str, Any], allowed: frozenset[str] | set[str]) -> None:
    """Refuse a field not in ``allowed``, naming (up to five of) them."""
    unknown = set(obj) - allowed
    if unknown:
        names = ", ".join(sorted(repr(k[:40]) for k in unknown)[:5])
        raise ProtocolError("bad_request", f"unknown field(s): {names}")


def parse_keep_alive(value: Any, fail: Callable[[str], Exception]) -> float:
    """A ``keep_alive``: seconds from 0 to a year, or -1 (until its memory is needed)."""
    if value == -1 and not isinstance(value, bool):
        return -1.0
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 <= value <= MAX_KEEP_ALIVE_S  # (NaN fails this too)
    ):
        raise fail(
            f"'keep_alive' must be seconds from 0 to {MAX_KEEP_ALIVE_S:.0f}, "
            "or -1 (until its memory is needed)"
        )
    return float(value)


def parse_stop(value: Any, fail: Callable[[str], Exception]) -> tuple[str, ...]:
    """``stop``: a string or a list of strings, within the bounds above."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
        raise fail(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    for item in items:
        if not isinstance(item, str) or not 1 <= len(item) <= MAX_STOP_CHARS:
            raise fail(f"each stop string must be a string of 1 to {MAX_STOP_CHARS} characters")
    return tuple(items)


def parse_ints(
    obj: dict[str, Any], bounds: dict[str, tuple[int, int]], fail: Callable[[str], Exception]
) -> dict[str, int]:
    """Each of ``bounds``' fields ``obj`` gives: an integer from low to high."""
    out: dict[str, int] = {}
    for name, (low, high) in bounds.items():
        if name in obj:
            if not is_int(obj[name]) or not low <= obj[name] <= high:
                raise fail(f"'{name}' must be an integer from {low} to {high}")
            out[name] = obj[name]
    return out


def parse_word(
    obj: dict[str, Any], name: str, words: tuple[str, ...], fail: Callable[[str], Exception]
) -> dict[str, str]:
    """``obj``'s ``name`` if it gives it: one of ``words``."""
    if name not in obj:
        return {}
    if obj[name] not in words:
        raise fail(f"'{name}' must be " + " or ".join(f'"{w}"' for w in words))
    return {name: obj[name]}


def parse_string(
    obj: dict[str, Any], name: str, most: int, fail: Callable[[str], Exception]
) -> dict[str, str]:
    """``obj``'s ``name`` if it gives it: a string of 1 to ``most`` characters."""
    if name not in obj:
        return {}
    value = obj[name]
    if not isinstance(value, str) or not 1 <= len(value) <= most:
        raise fail(f"'{name}' must be a string of 1 to {most} characters")
    return {name: value}
