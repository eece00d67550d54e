"""The OpenAI API's shapes without I/O (wsserver/openai_api.py), and the front's routing rule."""

from __future__ import annotations

import dataclasses
from http import HTTPStatus
from typing import Any

import orjson
import pytest

from wsserver.aio.front import is_api_target
from wsserver.backends.openai_wire import parse_chunk
from wsserver.core.logprobs import TokenLogprob
from wsserver.core.protocol import Delta, Done, Limits, Message, Timings, Usage
from wsserver.dialects.openai.api import ApiError, error_body, parse_request, status_of
from wsserver.dialects.openai.render import CompletionAnswer, Reply
from wsserver.sse import SSEParser

LIMITS = Limits(max_prompt_chars=100, max_tokens=50)


def chat(**fields: Any) -> bytes:
    body: dict[str, Any] = {"model": "anything", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return orjson.dumps(body)


def refused(kind: str, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(kind, body, "r1", LIMITS)  # type: ignore[arg-type]
    return info.value


def test_a_chat_body_becomes_the_same_generate_a_websocket_client_sends() -> None:
    body = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "name": "kept"},
        ],
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=11,
        stop="\n",
        logprobs=None,
        presence_penalty=0.3,  # unknown to us: ignored, as the issue asks
        user="someone",
    )
    api = parse_request("chat", body, "r1", LIMITS)
    g = api.generate
    assert g.messages == (
        Message("system", "be brief"),
        Message("user", "ab"),
        Message("assistant", "", name="kept"),
    )
    assert (g.id, g.max_tokens, g.temperature, g.top_p, g.top_k, g.seed, g.stop) == (
        "r1",
        7,
        0.5,
        0.9,
        3,
        11,
        ("\n",),
    )
    assert (api.stream, api.include_usage) == (False, False)


def test_a_completion_body_with_stream_options() -> None:
    body = orjson.dumps(
        {
            "prompt": ["once"],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    api = parse_request("completion", body, "r2", LIMITS)
    assert (api.generate.prompt, api.generate.max_tokens) == ("once", 5)
    assert (api.kind, api.stream, api.include_usage) == ("completion", True, True)


@pytest.mark.parametrize(
    ("kind", "body", "status", "code", "message"),
    [
        ("chat", chat(n=0), 400, "bad_request", "'n' must be an integer from 1 to 128"),
        ("chat", chat(n=129), 400, "bad_request", "'n' must be an integer from 1 to 128"),
        ("completion", orjson.dumps({"prompt": "x", "n": 1.5}), 400, "bad_request", "'n' must"),
        (
            "chat",
            chat(temperature=101),
            400,
            "bad_request",
            "'temperature' must be between 0 and 100",
        ),
        ("chat", chat(max_tokens=51), 400, "bad_request", "'max_tokens' exceeds the limit of 50"),
        (
            "chat",
            chat(messages=[{"role": "tool", "content": "x"}]),
            400,
            "bad_request",
            "tool_call_id",
        ),
        ("chat", chat(messages=[{"role": "robot", "content": "x"}]), 400, "bad_request", "role"),
        ("chat", chat(stream_options={"include_usage": True}), 400, "bad_request", "stream: true"),
        ("chat", chat(stream="yes"), 400, "bad_request", "'stream' must be a boolean"),
        ("chat", b"{", 400, "bad_json", "invalid JSON"),
        ("chat", b"[]", 400, "bad_json", "a JSON object"),
        ("chat", orjson.dumps({"model": "m"}), 400, "bad_request", "'messages' is required"),
        ("completion", orjson.dumps({"prompt": ["a", "b"]}), 400, "bad_request", "one prompt"),
        ("completion", orjson.dumps({"prompt": "x" * 101}), 413, "too_large", "exceeds 100"),
    ],
)
def test_refusals_carry_openai_status_code_and_our_message(
    kind: str, body: bytes, status: int, code: str, message: str
) -> None:
    error = refused(kind, body)
    assert (error.status, error.code) == (status, code)
    assert message in error.message
    obj = orjson.loads(error.body())["error"]
    assert obj["message"] == error.message and obj["code"] == code and "type" in obj


def test_status_of_every_kind_of_failure() -> None:
    assert status_of("overloaded") is HTTPStatus.SERVICE_UNAVAILABLE
    assert status_of("rate_limited") is HTTPStatus.TOO_MANY_REQUESTS
    assert status_of("upstream_failed") is HTTPStatus.BAD_GATEWAY
    assert status_of("internal") is HTTPStatus.INTERNAL_SERVER_ERROR
    assert orjson.loads(error_body(401, "no", "invalid_api_key"))["error"]["type"] == (
        "authentication_error"
    )


def done(reason: str = "stop") -> Done:
    return Done(
        id="r1",
        reason=reason,  # type: ignore[arg-type]
        usage=Usage(prompt_tokens=3, completion_tokens=4),
        timings=Timings(queued_ms=0, ttft_ms=1, total_ms=2, tokens_per_s=1),
    )


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_chunks_read_back_with_our_own_upstream_parser(kind: str) -> None:
    """What we emit is what the openai backend (our client side) reads."""
    reply = Reply(kind, "r1", "m", 123, include_usage=True)  # type: ignore[arg-type]
    data = reply.text_chunk("Hel") + reply.text_chunk("lo") + reply.final_chunks(done("length"))
    events = SSEParser().feed(data)
    assert events[-1] == "[DONE]"
    chunks = [parse_chunk(e) for e in events[:-1]]
    assert "".join(c.text for c in chunks) == "Hello"
    assert [c.finish for c in chunks] == [None, None, "length", None]
    assert (chunks[-1].prompt_tokens, chunks[-1].completion_tokens) == (3, 4)
    first = orjson.loads(events[0])
    assert first["id"] == ("chatcmpl-r1" if kind == "chat" else "cmpl-r1")
    assert first["usage"] is None
    if kind == "chat":
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
        assert orjson.loads(events[1])["choices"][0]["delta"] == {"content": "lo"}


def test_a_whole_body_has_the_text_and_usage() -> None:
    body = orjson.loads(Reply("chat", "r1", "m", 1, include_usage=False).body("hi", done()))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "hi"
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_several_choices_render_each_with_its_index_logprobs_and_end() -> None:
    """``n`` = 2, sans-I/O: each choice its role, its legacy ``text_offset``,
    its finish chunk; whole, sorted by index, each with its own end."""
    entry = TokenLogprob(token="ab", logprob=-0.5, bytes=b"ab")
    body = completion_body(n=2, logprobs=1)
    api = parse_request("completion", body, "r1", LIMITS)
    assert api.n == 2 and api.generate.choice_of == "r1"
    streamed = CompletionAnswer(dataclasses.replace(api, stream=True), "m", created=1)
    data = b"".join(
        streamed.chunk(Delta("r1", seq, text, logprobs=(entry,), choice=k))
        for seq, (k, text) in enumerate([(1, "ab"), (0, "ab"), (1, "ab")])
    )
    data += streamed.choice_done(done("length"), 1) + streamed.choice_done(done("stop"), 0)
    data += streamed.last(done())
    events = SSEParser().feed(data)
    assert events[-1] == "[DONE]"
    choices = [orjson.loads(e)["choices"][0] for e in events[:-1]]
    assert [(c["index"], c["finish_reason"]) for c in choices] == [
        (1, None),
        (0, None),
        (1, None),
        (1, "length"),
        (0, "stop"),
    ]
    # Each choice's offsets count its own text.
    assert [c["logprobs"]["text_offset"] for c in choices[:3]] == [[0], [0], [2]]
    whole = CompletionAnswer(api, "m", created=1)
    for k, text in [(1, "x"), (0, "y"), (1, "z")]:
        whole.gather(Delta("r1", 0, text, choice=k))
    assert whole.choice_done(done("length"), 1) == b""
    whole.choice_done(done("stop"), 0)
    out = orjson.loads(whole.body(done()))
    assert [(c["index"], c["text"], c["finish_reason"]) for c in out["choices"]] == [
        (0, "y", "stop"),
        (1, "xz", "length"),
    ]


def completion_body(**fields: Any) -> bytes:
    return orjson.dumps({"prompt": "hi", **fields})


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"POST /v1/chat/completions HTTP/1.1", True),
        (b"GET /v1/models?x=1 HTTP/1.1", True),
        (b"OPTIONS /v1 HTTP/1.1", True),
        (b"GET / HTTP/1.1", False),
        (b"GET /v10/models HTTP/1.1", False),
        (b"GET /healthz HTTP/1.1", False),
        (b"garbage", False),
        # The Responses API: POST and /{id} are HTTP, GET on the path itself is
        # the WebSocket mode's upgrade.
        (b"POST /v1/responses HTTP/1.1", True),
        (b"GET /v1/responses/resp_1 HTTP/1.1", True),
        (b"DELETE /v1/responses/resp_1 HTTP/1.1", True),
        (b"GET /v1/responses HTTP/1.1", False),
        (b"GET /v1/responses?x=1 HTTP/1.1", False),
        # Ollama's API.
        (b"POST /api/chat HTTP/1.1", True),
        (b"GET /api/tags HTTP/1.1", True),
        (b"HEAD /api/blobs/sha256:00 HTTP/1.1", True),
        (b"GET /api HTTP/1.1", True),
        (b"GET /apis HTTP/1.1", False),
    ],
)
def test_the_front_routes_by_the_request_target(line: bytes, expected: bool) -> None:
    assert is_api_target(line) is expected


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [
        ("completion", "echo", True),
        ("completion", "suffix", "}"),
        ("completion", "best_of", 3),
        ("chat", "modalities", ["text", "audio"]),
        ("chat", "audio", {"voice": "alloy", "format": "wav"}),
        ("chat", "prediction", {"type": "content", "content": "x"}),
        ("chat", "web_search_options", {}),
        ("chat", "reasoning_effort", "high"),
        ("chat", "verbosity", "low"),
        ("chat", "functions", [{"name": "f", "parameters": {}}]),
        ("chat", "function_call", "auto"),
    ],
)
def test_fields_that_would_change_the_answer_are_refused_by_name(
    kind: str, field: str, value: Any
) -> None:
    body: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
    )
    with pytest.raises(ApiError) as raised:
        parse_request(kind, orjson.dumps({**body, field: value}), "r", Limits())  # type: ignore[arg-type]
    assert raised.value.status == 400 and raised.value.code == "unsupported_option"
    assert f"'{field}'" in raised.value.message


def test_fields_that_change_nothing_or_ask_for_nothing_pass() -> None:
    body = {
        "prompt": "x",
        "user": "u",
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "echo": False,
        "best_of": 1,
    }
    assert parse_request("completion", orjson.dumps(body), "r", Limits()).generate.prompt == "x"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_keep_alive_reaches_the_generate_and_a_bad_one_is_named(kind: str) -> None:
    def body(**fields: Any) -> bytes:
        return chat(**fields) if kind == "chat" else orjson.dumps({"prompt": "p", **fields})

    for given, kept in ((0, 0.0), (30, 30.0), (-1, -1.0), (2.5, 2.5)):
        api = parse_request(kind, body(keep_alive=given), "r1", LIMITS)  # type: ignore[arg-type]
        assert api.generate.keep_alive == kept
    assert parse_request(kind, body(), "r1", LIMITS).generate.keep_alive is None  # type: ignore[arg-type]
    for bad in (-2, "5m", True, 1e12):
        error = refused(kind, body(keep_alive=bad))
        assert error.status == HTTPStatus.BAD_REQUEST and "'keep_alive'" in error.message
