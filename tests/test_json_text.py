"""JSON text read piece by piece (wsserver/json_text.py), sans-I/O: a JSON
string decoded incrementally gives exactly what ``json.loads`` gives, however
its text is split — inside an escape, between the two halves of a surrogate
pair, inside a ``\\uXXXX`` — and says where the string ended."""

from __future__ import annotations

import itertools
import json

import pytest

from wsserver.shaping.json_text import (
    JsonEvent,
    JsonExtent,
    JsonScanner,
    StringDecoder,
    json_extent,
)

#: The inside of JSON strings (as written, up to the closing quote), and what
#: each decodes to: every escape, a pair for 😀 written as two \\u escapes, a
#: \\u escape of a BMP character, raw non-ASCII text, escaped quotes.
STRINGS = [
    r"plain",
    r"a \"quoted\" \\ back\/slash",
    r"\b\f\n\r\t",
    r"smile \ud83d\ude00 and \u00e9 \u65e5\u672c raw 日本 😀",
    r"\uD83D\uDE00\uD83D\uDE01",
    r"\"",
    r"",
]


def decode(pieces: list[str]) -> tuple[str, str]:
    """Feed ``pieces``; the decoded text and what followed the closing quote."""
    decoder = StringDecoder()
    out: list[str] = []
    after = ""
    for piece in pieces:
        if decoder.closed:
            after += piece
            continue
        text, end = decoder.feed(piece)
        out.append(text)
        if end is not None:
            assert decoder.closed
            after += piece[end:]
    assert decoder.closed
    return "".join(out), after


@pytest.mark.parametrize("inside", STRINGS)
def test_every_split_decodes_as_json_loads(inside: str) -> None:
    data = inside + '"}, 1'
    expected = json.loads('"' + inside + '"')
    assert decode([data]) == (expected, "}, 1")
    for cut in range(1, len(data)):
        assert decode([data[:cut], data[cut:]]) == (expected, "}, 1"), cut
    # Every pair of split points, for the escapes (short strings only).
    if len(data) <= 40:
        for a, b in itertools.combinations(range(1, len(data)), 2):
            assert decode([data[:a], data[a:b], data[b:]]) == (expected, "}, 1"), (a, b)
    # One character a piece, as tokens of a byte each would give.
    assert decode(list(data)) == (expected, "}, 1")


def test_nothing_is_taken_back_and_nothing_undecided_is_given() -> None:
    decoder = StringDecoder()
    assert decoder.feed("ab\\") == ("ab", None)  # the escape waits
    assert decoder.feed("u00") == ("", None)
    assert decoder.feed("e9\\ud83d") == ("é", None)  # the high half waits
    assert decoder.feed("\\ude00") == ("😀", None)
    assert decoder.feed('x"rest') == ("x", 2)


def test_a_lone_surrogate_or_a_bad_escape_is_a_replacement_character() -> None:
    assert decode(['\\ud83dx"']) == ("\ufffdx", "")
    assert decode(['\\ude00"']) == ("\ufffd", "")
    assert decode(['\\ud83d"']) == ("\ufffd", "")
    assert decode(['\\ud83d\\u0041"']) == ("\ufffdA", "")
    assert decode(['\\uzz12"']) == ("\ufffdzz12", "")
    assert decode(['\\q"']) == ("q", "")


def test_json_extent() -> None:
    assert json_extent(' {"a": "}"} tail') == len(' {"a": "}"}')
    assert json_extent('[1, {"b": [2]}]') == len('[1, {"b": [2]}]')
    assert json_extent('{"a": "\\"}') == -1
    assert json_extent('{"a": [1, 2') == -1
    assert json_extent("x") == 1  # not JSON: the parse of this much fails


#: JSON texts (and what follows them), with what each value's text is.
DOCUMENTS = [
    ' {"a": "}\\"{", "b": [1, -2.5e3, true, null, {"c": []}], "d": {}} tail',
    '[{"name": "f", "arguments": {"x": "日本 😀 \\u00e9"}}, "s", 0]',
    '"just a string" and more',
]


def scan(pieces: list[str]) -> tuple[list[JsonEvent], bool]:
    scanner = JsonScanner()
    events = [event for piece in pieces for event in scanner.feed(piece)]
    return events, scanner.ended


@pytest.mark.parametrize("text", DOCUMENTS)
def test_the_scanner_finds_every_key_and_value_however_the_text_is_split(text: str) -> None:
    whole, ended = scan([text])
    assert ended
    value = json.loads(text[: whole[-1].end])
    # Each closed value's text is that value, as the whole parse reads it.
    assert json.loads(text[whole[0].start : whole[-1].end]) == value
    keys = [json.loads(text[e.start : e.end]) for e in whole if e.kind == "key"]
    closes = [e for e in whole if e.kind == "close"]
    opens = [e for e in whole if e.kind == "open"]
    assert [e.start for e in opens] == sorted(e.start for e in closes)
    for event in closes:
        json.loads(text[event.start : event.end])  # each value's text is JSON
    if isinstance(value, dict):
        assert set(value) <= set(keys)
    # Split anywhere, or a character at a time: the same events.
    for cut in range(1, len(text)):
        assert scan([text[:cut], text[cut:]]) == (whole, True), cut
    assert scan(list(text)) == (whole, True)


def test_the_scanner_reports_depths_and_stops_at_the_end() -> None:
    events, ended = scan(['{"k": [1, {"n": "v"}]} {"more": 1}'])
    assert ended
    assert [(e.kind, e.depth) for e in events] == [
        ("open", 0),
        ("key", 1),
        ("open", 1),
        ("open", 2),
        ("close", 2),
        ("open", 2),
        ("key", 3),
        ("open", 3),
        ("close", 3),
        ("close", 2),
        ("close", 1),
        ("close", 0),
    ]


@pytest.mark.parametrize("text", ["{a: 1}", '{"a" 1}', '{"a": 1]', "[1 2]", "}", '{"a": }'])
def test_broken_structure_stops_the_scanner(text: str) -> None:
    scanner = JsonScanner()
    scanner.feed(text)
    assert scanner.broken and not scanner.ended
    assert scanner.feed('"more": 1}') == []


@pytest.mark.parametrize(
    "text", [' {"a": "}"} tail', '[1, {"b": [2]}]', '{"a": "\\"}', '{"a": [1, 2', "x", "  "]
)
def test_json_extent_piece_by_piece(text: str) -> None:
    for cut in range(len(text) + 1):
        extent = JsonExtent()
        extent.feed(text[:cut])
        assert extent.feed(text[cut:]) == json_extent(text), cut
