"""Log-probabilities on every wire: parsing, the pacing, the frames, the fake
engine, the OpenAI shapes (with the official SDK) and the relay.

The real model's numbers are checked in test_llama_logprobs.py.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from conftest import CLIENT_FRAME, FAKE_MODEL, running_server, validate_server_frame, wire
from fake_upstream import PIECES, FakeUpstream
from test_openai_backend import gen, relay
from test_openai_http import sdk

from wsserver.backends.base import GenerationRequest
from wsserver.backends.fake import fake_logprob
from wsserver.core.events import TextProduced
from wsserver.core.logprobs import LOGPROB_FLOOR, TokenLogprob, TopLogprob, legacy_logprobs
from wsserver.core.pacing import Coalescer
from wsserver.core.protocol import (
    Delta,
    Done,
    Generate,
    Limits,
    Timings,
    Usage,
    parse_client_frame,
    parse_server_frame,
    serialize,
)
from wsserver.core.session import Send, Session
from wsserver.dialects.openai.api import ApiError, parse_request
from wsserver.dialects.openai.render import Reply
from wsserver.errors import ProtocolError

LIMITS = Limits()


def entry(token: str, logprob: float = -0.5, top: int = 2) -> TokenLogprob:
    raw = token.encode()
    alternatives = tuple(TopLogprob(f"{token}{i}", logprob - i, raw) for i in range(top))
    return TokenLogprob(token, logprob, raw, alternatives)


# ---------------------------------------------------------------- the frames


def test_generate_takes_logprobs_and_top_logprobs() -> None:
    frame = {"type": "generate", "id": "a", "prompt": "p", "logprobs": True, "top_logprobs": 5}
    CLIENT_FRAME.validate(frame)
    parsed = parse_client_frame(json.dumps(frame), LIMITS)
    assert isinstance(parsed, Generate)
    assert parsed.logprobs is True and parsed.top_logprobs == 5
    request = GenerationRequest.from_frame(parsed, default_max_tokens=8)
    assert request.logprobs == 5
    plain = parse_client_frame('{"type":"generate","id":"b","prompt":"p"}', LIMITS)
    assert isinstance(plain, Generate)
    assert GenerationRequest.from_frame(plain, default_max_tokens=8).logprobs is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logprobs": 1}, "'logprobs' must be true or false"),
        ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be an integer from 0 to 20"),
        ({"logprobs": True, "top_logprobs": True}, "'top_logprobs' must be an integer"),
        ({"top_logprobs": 3}, "'top_logprobs' needs 'logprobs': true"),
        ({"logprobs": False, "top_logprobs": 3}, "'top_logprobs' needs 'logprobs': true"),
    ],
)
def test_bad_logprobs_fields_are_refused(fields: dict[str, Any], message: str) -> None:
    frame = {"type": "generate", "id": "a", "prompt": "p", **fields}
    with pytest.raises(ProtocolError) as caught:
        parse_client_frame(json.dumps(frame), LIMITS)
    assert caught.value.code == "bad_request" and message in caught.value.message


def test_a_delta_with_logprobs_round_trips_and_matches_the_schema() -> None:
    delta = Delta("a", 0, "Hi", logprobs=(entry("H"), entry("i", top=0)))
    wire_text = serialize(delta).decode()
    obj = validate_server_frame(wire_text)
    assert obj["logprobs"][0] == {
        "token": "H",
        "logprob": -0.5,
        "bytes": [72],
        "top_logprobs": [
            {"token": "H0", "logprob": -0.5, "bytes": [72]},
            {"token": "H1", "logprob": -1.5, "bytes": [72]},
        ],
    }
    assert parse_server_frame(wire_text) == delta
    # Without them the frame is what it always was.
    assert json.loads(serialize(Delta("a", 1, "x"))) == {
        "type": "delta",
        "id": "a",
        "seq": 1,
        "text": "x",
    }
    # Text held back: a delta may carry only entries.
    validate_server_frame(serialize(Delta("a", 2, "", logprobs=(entry("\ufffd"),))).decode())


def test_the_legacy_completions_shape() -> None:
    legacy = legacy_logprobs([entry("ab"), entry("c", top=1)], offset=3)
    assert legacy == {
        "tokens": ["ab", "c"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"ab0": -0.5, "ab1": -1.5}, {"c0": -0.5}],
        "text_offset": [3, 5],
    }


# ---------------------------------------------------------------- pacing and session


def test_a_coalesced_frame_carries_the_entries_of_its_tokens() -> None:
    coalescer = Coalescer(flush_window=1.0, flush_tokens=100)
    coalescer.add("a", 1, (entry("a"),))
    assert coalescer.due(0.0)  # the first text goes at once
    assert coalescer.take(0.0) == ("a", 1)
    assert coalescer.take_logprobs() == (entry("a"),)
    # A held-back token (no text) and two more merge into one frame.
    coalescer.add("", 1, (entry("\ufffd"),))
    assert not coalescer.due(0.1)
    coalescer.add("bc", 1, (entry("b"),))
    coalescer.add("", 1, (entry("c"),))
    assert not coalescer.due(0.2)
    assert coalescer.due(1.2)
    assert coalescer.take(1.2) == ("bc", 3)
    assert [e.token for e in coalescer.take_logprobs()] == ["\ufffd", "b", "c"]


def test_entries_alone_fill_a_frame_and_make_it_due() -> None:
    coalescer = Coalescer(flush_window=1.0, flush_tokens=100, max_logprob_tokens=3)
    coalescer.add("a", 1, (entry("a"),))
    coalescer.take(0.0)
    coalescer.take_logprobs()
    for _ in range(3):
        assert not coalescer.full
        coalescer.add("", 1, (entry("x"),))
    assert coalescer.full
    assert not coalescer.due(0.5)  # the ceiling still holds
    assert coalescer.due(1.0)
    assert coalescer.take(1.0) == ("", 3)
    assert len(coalescer.take_logprobs()) == 3


def test_the_session_sends_entries_even_without_text() -> None:
    session = Session()
    generate = Generate(id="a", prompt="p", logprobs=True)
    session.handle(generate, 0.0)
    from wsserver.core.events import ModelGranted

    session.handle(ModelGranted("a"), 0.0)
    (send,) = session.handle(TextProduced("a", "", 1, logprobs=(entry("x"),)), 0.1)
    assert isinstance(send, Send) and send.frame == Delta("a", 0, "", logprobs=(entry("x"),))
    # Without entries an empty text still sends nothing.
    assert session.handle(TextProduced("a", "", 1), 0.2) == []


# ---------------------------------------------------------------- the fake engine


def test_the_fake_engine_is_a_model_that_cannot_choose() -> None:
    made = fake_logprob(b" stream", 3)
    assert made.logprob == 0.0 and made.token == " stream"
    assert [t.logprob for t in made.top] == [0.0, LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert made.top[0].token == " stream" and len({t.token for t in made.top}) == 3
    assert fake_logprob(b"\xe6", 0).top == ()
    assert fake_logprob(b"\xe6", 0).token == "\ufffd"


async def test_websocket_deltas_carry_one_entry_per_token() -> None:
    async with running_server(backend__fake__tokens_per_s=0) as server, wire(server) as ws:
        await ws.send(
            {
                "type": "generate",
                "id": "a",
                "prompt": "x",
                "max_tokens": 40,
                "logprobs": True,
                "top_logprobs": 4,
            }
        )
        text, frames = await ws.done("a")
        await ws.send({"type": "generate", "id": "b", "prompt": "x", "max_tokens": 40})
        plain, plain_frames = await ws.done("b")
    assert text == plain
    deltas = [f for f in frames if f["type"] == "delta"]
    entries = [e for d in deltas for e in d["logprobs"]]
    assert len(entries) == frames[-1]["usage"]["completion_tokens"] == 40
    assert all(len(e["top_logprobs"]) == 4 and e["logprob"] == 0.0 for e in entries)
    # The tokens' bytes join to the text (a character cut off by max_tokens is dropped).
    assert b"".join(bytes(e["bytes"]) for e in entries).decode(errors="ignore") == text
    assert not any("logprobs" in f for f in plain_frames)


async def test_the_openai_sdk_parses_chat_and_completion_logprobs() -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with running_server(backend__fake__tokens_per_s=0) as server, sdk(server) as client:
        chat = await client.chat.completions.create(
            model=FAKE_MODEL, messages=messages, max_tokens=12, logprobs=True, top_logprobs=2
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens == 12
        assert all(len(c.top_logprobs) == 2 and c.logprob == 0.0 for c in content)
        joined = b"".join(bytes(c.bytes) for c in content).decode(errors="ignore")
        assert joined == chat.choices[0].message.content
        streamed: list[Any] = []
        text = ""
        stream = await client.chat.completions.create(
            model=FAKE_MODEL,
            messages=messages,
            max_tokens=12,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed.extend(chunk.choices[0].logprobs.content or [])
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        assert text == chat.choices[0].message.content
        assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
        plain = await client.chat.completions.create(
            model=FAKE_MODEL, messages=messages, max_tokens=4
        )
        assert plain.choices[0].logprobs is None

        completion = await client.completions.create(
            model=FAKE_MODEL, prompt="p", max_tokens=10, logprobs=3
        )
        legacy = completion.choices[0].logprobs
        assert legacy is not None and legacy.tokens is not None
        assert len(legacy.tokens) == 10 and legacy.token_logprobs == [0.0] * 10
        assert legacy.top_logprobs is not None
        assert all(len(top) == 3 for top in legacy.top_logprobs)
        assert legacy.text_offset is not None and legacy.text_offset[0] == 0
        chunks = await client.completions.create(
            model=FAKE_MODEL, prompt="p", max_tokens=10, logprobs=3, stream=True
        )
        tokens: list[str] = []
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].logprobs is not None:
                tokens.extend(chunk.choices[0].logprobs.tokens or [])
        assert tokens == legacy.tokens

        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=FAKE_MODEL, messages=messages, logprobs=True, top_logprobs=21
            )
        assert "top_logprobs" in str(caught.value)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=FAKE_MODEL, prompt="p", logprobs=21)


def test_completions_logprobs_must_be_a_count() -> None:
    for value in (True, -1, 21, "3"):
        body = json.dumps({"prompt": "p", "logprobs": value}).encode()
        with pytest.raises(ApiError) as caught:
            parse_request("completion", body, "r", LIMITS)
        assert caught.value.param == "logprobs"
    body = json.dumps({"prompt": "p", "logprobs": 0}).encode()
    generate = parse_request("completion", body, "r", LIMITS).generate
    assert generate.logprobs is True and generate.top_logprobs == 0


def test_a_reply_without_logprobs_writes_null() -> None:
    reply = Reply("chat", "r", "m", 0, include_usage=False)
    done = Done("r", "stop", Usage(1, 1), Timings(0.0, None, 0.0, 0.0))
    assert json.loads(reply.body("x", done))["choices"][0]["logprobs"] is None
    asked = Reply("chat", "r", "m", 0, include_usage=False, logprobs=True)
    body = json.loads(asked.body("x", done, logprobs=[entry("x", top=0)]))
    assert body["choices"][0]["logprobs"] == {
        "content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}],
        "refusal": None,
    }


# ---------------------------------------------------------------- the relay


async def test_the_relay_forwards_logprobs_and_passes_the_upstreams_through() -> None:
    messages = [{"role": "user", "content": "u"}]
    async with FakeUpstream() as up, relay(up.url) as server:
        async with wire(server) as client:
            await client.send(gen("a", logprobs=True, top_logprobs=2))
            _, completion = await client.done("a")
            await client.send(
                {
                    "type": "generate",
                    "id": "c",
                    "messages": messages,
                    "logprobs": True,
                    "top_logprobs": 2,
                }
            )
            _, chat = await client.done("c")
    legacy_stream, chat_stream = up.streams
    assert legacy_stream.body["logprobs"] == 2
    assert chat_stream.body["logprobs"] is True and chat_stream.body["top_logprobs"] == 2
    for frames in (completion, chat):
        entries = [e for f in frames if f["type"] == "delta" for e in f["logprobs"]]
        assert [e["token"] for e in entries] == PIECES
        assert [e["logprob"] for e in entries] == [-0.25 * (i + 1) for i in range(len(PIECES))]
        # Most likely first, whichever shape the upstream used.
        for e in entries:
            assert [t["logprob"] for t in e["top_logprobs"]] == [e["logprob"], e["logprob"] - 1]
