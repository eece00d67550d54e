"""An integer's JSON Schema bounds as GBNF (wsserver/backends/int_range.py),
checked against arithmetic: the rule, read as a regular expression, accepts
exactly the integers in its range (every canonical one in it, nothing out of
it), exhaustively around the small bounds and by property for large ones;
then on the llama engine, where such a schema was refused."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wsserver.backends.int_range import MAX_DIGITS, bounds, integer_rule

_TOKEN = re.compile(r'"[^"]*"|\[[^\]]*\]|\{[0-9,]*\}|[()|]|\s+')


def matcher(rule: str) -> re.Pattern[str]:
    """The rule's GBNF read as a regular expression: its literals, ranges,
    repetitions, groups and alternatives mean the same there."""
    tokens = _TOKEN.findall(rule)
    assert "".join(tokens) == rule, f"a token the oracle does not read in {rule!r}"
    return re.compile(
        "".join(re.escape(t[1:-1]) if t.startswith('"') else t for t in tokens if not t.isspace())
    )


def check(low: int | None, high: int | None, numbers: list[int]) -> None:
    pattern = matcher(integer_rule(low, high))

    def inside(n: int) -> bool:
        return (low is None or n >= low) and (high is None or n <= high)

    for n in numbers:
        assert (pattern.fullmatch(str(n)) is not None) == inside(n), (low, high, n)
    # Whatever else it lets through is an integer in the range: never a leading zero.
    for text in ("-0", "00", "007", "-007", "0" * 3):
        if pattern.fullmatch(text):
            assert text == "-0" and inside(0), (low, high, text)


EDGES = [None, -1000, -101, -100, -99, -10, -9, -1, 0, 1, 5, 9, 10, 11, 19, 20, 99, 100, 150, 999]
NUMBERS = list(range(-1300, 1300))


@pytest.mark.parametrize("low", EDGES)
def test_every_integer_near_the_bounds_is_in_exactly_when_it_should_be(low: int | None) -> None:
    for high in EDGES:
        if (low is None and high is None) or (low is not None and high is not None and low > high):
            continue
        check(low, high, NUMBERS)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(st.none(), st.integers(-(10**12), 10**12)),
    st.one_of(st.none(), st.integers(-(10**12), 10**12)),
    st.lists(st.integers(-(10**13), 10**13), min_size=5, max_size=30),
)
def test_large_bounds_hold_too(low: int | None, high: int | None, numbers: list[int]) -> None:
    if low is None and high is None:
        high = 0
    if low is not None and high is not None and low > high:
        low, high = high, low
    edges = [e + d for e in (low, high) if e is not None for d in (-1, 0, 1)]
    check(low, high, numbers + edges)


def test_an_open_side_allows_sixteen_digits() -> None:
    pattern = matcher(integer_rule(0, None))
    assert pattern.fullmatch("9" * MAX_DIGITS) and not pattern.fullmatch("9" * (MAX_DIGITS + 1))


def test_bounds_are_read_from_the_schema() -> None:
    assert bounds({"minimum": 3}) == (3, None)
    assert bounds({"exclusiveMinimum": 3, "maximum": 10.5}) == (4, 10)
    assert bounds({"minimum": 2.5, "exclusiveMaximum": 7}) == (3, 6)
    assert bounds({"minimum": 1, "exclusiveMinimum": 4}) == (5, None)  # the tighter
    for bad, why in (
        ({"minimum": 5, "maximum": 4}, "no integer"),
        ({"minimum": "1"}, "must be a number"),
        ({"maximum": 10**17}, "digits"),
    ):
        with pytest.raises(ValueError, match=why):
            bounds(bad)


# ---------------------------------------------------------------- the llama engine

llama_cpp = pytest.importorskip("llama_cpp")


def test_the_converter_enforces_integer_bounds_and_refuses_a_numbers() -> None:
    from wsserver.backends.llama_schema import schema_to_gbnf
    from wsserver.errors import BackendError

    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 10, "maximum": 20},
            "m": {"anyOf": [{"type": "integer", "exclusiveMinimum": 0}, {"type": "null"}]},
        },
        "required": ["n", "m"],
    }
    gbnf = schema_to_gbnf(json.dumps(schema))
    assert integer_rule(10, 20) in gbnf and integer_rule(1, None) in gbnf
    with pytest.raises(BackendError, match=r"'minimum' at properties\.x") as raised:
        schema_to_gbnf(json.dumps({"properties": {"x": {"type": "number", "minimum": 1}}}))
    assert raised.value.code == "unsupported_option"
    with pytest.raises(BackendError, match="no integer") as raised:
        schema_to_gbnf(json.dumps({"type": "integer", "minimum": 3, "maximum": 2}))
    assert raised.value.code == "bad_request"


async def test_answers_on_the_tiny_model_validate_against_their_bounds(tiny_gguf: Any) -> None:
    import jsonschema
    from conftest import make_config, running_server, wire

    schema = {
        "type": "object",
        "properties": {
            "small": {"type": "integer", "minimum": -5, "maximum": 5},
            "big": {"type": "integer", "exclusiveMinimum": 1000},
            "negative": {"type": "integer", "maximum": -10},
        },
        "required": ["small", "big", "negative"],
        "additionalProperties": False,
    }
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_threads=1,
        backend__llama__parallel=1,
    )
    async with running_server(config) as server, wire(server) as ws:
        for seed in range(4):
            await ws.send(
                {
                    "type": "generate",
                    "id": f"s{seed}",
                    "prompt": "JSON:",
                    "json_schema": schema,
                    "max_tokens": 200,
                    "temperature": 1.0,
                    "seed": seed,
                }
            )
            text, frames = await ws.done(f"s{seed}", units=60)
            assert frames[-1]["reason"] == "stop", frames[-1]
            jsonschema.validate(json.loads(text), schema)
