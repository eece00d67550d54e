"""The event-stream parser (wsserver/sse.py) and the OpenAI chunk reader, without I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wsserver.backends.openai_wire import UpstreamError, error_message, parse_chunk
from wsserver.sse import SSEError, SSEParser


def test_events_end_at_a_blank_line_whatever_the_line_endings() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\n\ndata: b\r\n\r\ndata: c\r\rdata:d") == ["a", "b", "c"]
    assert parser.partial
    assert parser.feed(b"\n\n") == ["d"]
    assert not parser.partial


def test_comments_other_fields_and_multi_line_data() -> None:
    parser = SSEParser()
    stream = b": ping\nevent: x\nid: 3\nretry: 10\ndata: one\ndata:two\nfoo\n\n"
    assert parser.feed(stream) == ["one\ntwo"]
    assert parser.feed(b"event: only\n\n") == []  # no data: no event


@given(
    st.lists(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n"))), st.data()
)
def test_any_split_of_the_bytes_gives_the_same_events(
    payloads: list[str], data: st.DataObject
) -> None:
    stream = b"".join(
        b"data: " + p.encode() + data.draw(st.sampled_from([b"\n\n", b"\r\n\r\n", b"\r\r"]))
        for p in payloads
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    parser = SSEParser()
    events: list[str] = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        events += parser.feed(stream[start:end])
    assert events == payloads


def test_too_long_or_not_utf8_is_an_error() -> None:
    with pytest.raises(SSEError):
        SSEParser(max_event_bytes=16).feed(b"data: " + b"x" * 32)
    with pytest.raises(SSEError):
        SSEParser(max_event_bytes=16).feed(b"data: 0123456789\ndata: 0123456789\n")
    with pytest.raises(SSEError):
        SSEParser().feed(b"data: \xff\n\n")


def test_chunks_of_completions_and_chats() -> None:
    text = parse_chunk('{"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}')
    assert (text.text, text.finish) == ("hi", None)
    chat = parse_chunk('{"choices": [{"delta": {"content": "yo"}, "finish_reason": "length"}]}')
    assert (chat.text, chat.finish) == ("yo", "length")
    role = parse_chunk('{"choices": [{"delta": {"role": "assistant"}}]}')
    assert role.text == "" and role.finish is None
    usage = parse_chunk('{"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 9}}')
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 9)
    other = parse_chunk('{"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}')
    assert other.finish == "stop"


@pytest.mark.parametrize(
    ("data", "code"),
    [
        ("{", "upstream_bad_stream"),
        ("[1]", "upstream_bad_stream"),
        ('{"choices": 3}', "upstream_bad_stream"),
        ('{"choices": [{"text": 5}]}', "upstream_bad_stream"),
        ('{"error": {"message": "boom"}}', "upstream_failed"),
    ],
)
def test_bad_chunks_carry_their_code(data: str, code: str) -> None:
    with pytest.raises(UpstreamError) as caught:
        parse_chunk(data)
    assert caught.value.code == code


def test_http_errors_pass_the_upstreams_message_on() -> None:
    assert error_message(404, b'{"error": {"message": "no such model"}}') == (
        "the upstream answered HTTP 404: no such model"
    )
    assert error_message(422, b'{"detail": [{"msg": "bad"}]}').startswith(
        'the upstream answered HTTP 422: [{"msg":"bad"}]'
    )
    assert error_message(502, b"<html>Bad   gateway</html>") == (
        "the upstream answered HTTP 502: <html>Bad gateway</html>"
    )
    assert len(error_message(500, b"x" * 10_000)) < 600
