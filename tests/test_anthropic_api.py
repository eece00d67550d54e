"""The Messages API's bodies, errors and events, without a server (sans-I/O)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
import pytest

from wsserver.anthropic_api import error_body, parse_body, parse_json, to_generate
from wsserver.anthropic_render import MessageRender, sse
from wsserver.api_errors import ApiError
from wsserver.protocol import MAX_STOP_STRINGS, Done, Limits, Message, Timings, Usage

LIMITS = Limits(max_tokens=100, max_prompt_chars=50)


def body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def refusal(obj: dict[str, Any], **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        to_generate(parse_body(obj, **kwargs), "r", LIMITS)
    return info.value


def test_a_conversation_becomes_one_generate() -> None:
    request = parse_body(
        body(
            system=[
                {"type": "text", "text": "be ", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "kind"},
            ],
            messages=[
                {"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "d"},
            ],
            stop_sequences=["##"],
            top_k=3,
            metadata={"user_id": "u"},
        )
    )
    generate = to_generate(request, "r", LIMITS)
    assert generate.messages == (
        Message("system", "be kind"),
        Message("user", "a\n\nb"),  # consecutive turns of one role are one turn
        Message("assistant", "c"),
        Message("user", "d"),
    )
    assert generate.max_tokens == 5 and generate.stop == ("##",) and generate.top_k == 3


def test_refusals_name_the_field() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (body(max_tokens=None), "max_tokens: field required"),
        (body(max_tokens=0), "max_tokens"),
        (body(messages=[]), "messages"),
        (body(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), "'tool_result'"),
        (
            body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
            "messages.0.content.0.text",
        ),
        (body(system=[{"type": "image"}]), "system.0.type: images"),
        (body(metadata={"tags": "x"}), "metadata.tags"),
        (body(top_p=-1), "top_p"),
        (body(top_k=1.5), "top_k"),
        (body(stream="yes"), "stream"),
        (body(thinking={"type": "enabled", "budget_tokens": 2000}), "thinking: not supported"),
        (body(container="c"), "container"),
        (body(frequency=1), "frequency: unknown field"),
        (body(max_tokens=101), "max_tokens: 'max_tokens' exceeds the limit of 100"),
        (body(stop_sequences=["s"] * (MAX_STOP_STRINGS + 1)), "stop_sequences:"),
    ]
    for obj, named in cases:
        assert named in refusal(obj).message
    too_long = refusal(body(messages=[{"role": "user", "content": "x" * 51}]))
    assert too_long.status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE and "messages" in too_long.message


def test_counting_needs_no_max_tokens() -> None:
    assert parse_body(body(max_tokens=None), counting=True).max_tokens is None
    with pytest.raises(ApiError):
        parse_json(b"[1]")


def test_errors_have_anthropics_shape_and_status() -> None:
    overloaded = ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "busy", "overloaded")
    assert error_body(overloaded) == (
        529,
        orjson.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
    )
    for status, kind in [
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
    ]:
        status_out, data = error_body(ApiError(HTTPStatus(status), "m", "x"))
        assert status_out == status and orjson.loads(data)["error"]["type"] == kind


def done(reason: str, stop: str | None = None) -> Done:
    return Done("r", reason, Usage(7, 2), Timings(0, None, 1, 1), stop_sequence=stop)  # type: ignore[arg-type]


def test_the_events_come_in_anthropics_order() -> None:
    render = MessageRender(parse_body(body()), message_id="msg_1", model="fake")
    events = render.begin() + render.begin() + render.delta("He") + render.delta("llo")
    events += render.end(done("stop", "##"))
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "##"}
    assert events[-2]["usage"] == {"input_tokens": 7, "output_tokens": 2}
    message = render.message()
    assert message["content"] == [{"type": "text", "text": "Hello"}]
    assert message["stop_reason"] == "stop_sequence"
    assert sse(events[0]).startswith(b"event: message_start\ndata: {")


def test_a_message_without_text_has_no_block() -> None:
    render = MessageRender(parse_body(body()), message_id="msg_1", model="fake")
    events = render.end(done("length"))
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    assert render.message()["content"] == [] and render.message()["stop_reason"] == "max_tokens"
    ended = MessageRender(parse_body(body()), message_id="msg_2", model="fake")
    ended.delta("x")
    ended.end(done("stop"))
    assert ended.message()["stop_reason"] == "end_turn"
