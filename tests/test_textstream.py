"""Incremental decoding and stop strings, sans-I/O."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from wsserver.core.textstream import TextAssembler


def feed_all(assembler: TextAssembler, chunks: list[bytes]) -> list[str]:
    out = [assembler.feed(c) for c in chunks]
    out.append(assembler.flush())
    return out


def test_split_characters_are_held_until_complete() -> None:
    data = "a日😀b".encode()
    assembler = TextAssembler()
    pieces = feed_all(assembler, [bytes([b]) for b in data])
    assert "".join(pieces) == "a日😀b"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1:3] == ["", ""]  # the first two bytes of 日 release nothing


def test_stop_string_across_tokens_is_never_partly_emitted() -> None:
    assembler = TextAssembler(["END"])
    pieces = feed_all(assembler, [b"hello E", b"N", b"D tail"])
    assert "".join(pieces) == "hello "
    assert assembler.stopped
    assert assembler.feed(b"more") == "" and assembler.flush() == ""


def test_false_start_of_a_stop_string_is_released() -> None:
    assembler = TextAssembler(["END"])
    pieces = feed_all(assembler, [b"E", b"N", b"O"])
    assert pieces[:2] == ["", ""]
    assert "".join(pieces) == "ENO"
    assert not assembler.stopped


def test_earliest_of_several_stop_strings_wins() -> None:
    assembler = TextAssembler(["zz", "b"])
    assert "".join(feed_all(assembler, [b"aazz b"])) == "aa"
    assert assembler.stop_string == "zz"


def test_the_stop_string_that_ended_the_text_is_named() -> None:
    assembler = TextAssembler(["abc", "ab", "x"])
    assert "".join(feed_all(assembler, [b"1a", b"bc"])) == "1"
    assert assembler.stop_string == "ab"  # complete first, at the same place
    plain = TextAssembler(["zz"])
    assert "".join(feed_all(plain, [b"no stop"])) + plain.flush() == "no stop"
    assert plain.stop_string is None


def test_text_input_and_invalid_bytes() -> None:
    assembler = TextAssembler()
    assert assembler.feed_text("x") == "x"
    # Invalid UTF-8 and a truncated tail are dropped, as llama-cpp-python does.
    assert "".join(feed_all(assembler, [b"\xff", b"ok", b"\xe6\x97"])) == "ok"


@given(
    st.text(max_size=60),
    st.lists(st.integers(1, 4), max_size=60),
    st.sampled_from(["", "\n\n", "é!", "ab"]),
)
def test_any_split_gives_the_text_up_to_the_stop(text: str, cuts: list[int], stop: str) -> None:
    data = text.encode()
    chunks, i = [], 0
    for size in cuts:
        chunks.append(data[i : i + size])
        i += size
    chunks.append(data[i:])
    assembler = TextAssembler([stop] if stop else [])
    pieces = feed_all(assembler, chunks)
    expected = text[: text.find(stop)] if stop and stop in text else text
    assert "".join(pieces) == expected
