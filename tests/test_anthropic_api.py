"""The Messages API's bodies, errors and events, without a server (sans-I/O)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import orjson
import pytest

from wsserver.core.protocol import (
    MAX_STOP_STRINGS,
    CallPart,
    Done,
    Limits,
    Message,
    Timings,
    ToolCall,
    Usage,
)
from wsserver.dialects.anthropic.api import error_body, parse_body, to_generate
from wsserver.dialects.anthropic.render import MessageRender, sse
from wsserver.dialects.api_errors import ApiError, parse_json

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
        (
            body(messages=[{"role": "user", "content": [{"type": "image"}]}]),
            "image 0 (messages.0.content.0.source): give a base64 source",
        ),
        (
            body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
            "messages.0.content.0.text",
        ),
        (body(system=[{"type": "image"}]), "system.0.type: images"),
        (body(metadata={"tags": "x"}), "metadata.tags"),
        (body(top_p=-1), "top_p"),
        (body(top_k=1.5), "top_k"),
        (body(stream="yes"), "stream"),
        (
            body(thinking={"type": "enabled", "budget_tokens": 2000}),
            "thinking.budget_tokens: must be less than max_tokens",
        ),
        (body(thinking={"type": "enabled"}), "thinking.budget_tokens: must be an integer"),
        (body(thinking={"type": "adaptive"}), "thinking: must be"),
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
    render = MessageRender(
        parse_body(body(stop_sequences=["##"])), message_id="msg_1", model="fake"
    )
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
    assert events[-2]["usage"] == {
        "input_tokens": 7,
        "cache_read_input_tokens": 0,
        "output_tokens": 2,
    }
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


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "weather?"},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": ""},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_2",
                "content": [{"type": "text", "text": "no data"}],
                "is_error": True,
            },
            {"type": "text", "text": "and?"},
        ],
    },
]


def test_tool_use_and_results_become_the_cores_calls_and_tool_messages() -> None:
    request = parse_body(
        body(
            tools=[WEATHER],
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            messages=TOOL_TURNS,
            max_tokens=50,
            thinking={"type": "enabled", "budget_tokens": 20},
        )
    )
    generate = to_generate(request, "r", Limits())
    assert generate.messages == (
        Message("user", "weather?"),
        Message(
            "assistant",
            "Looking.",  # the thinking block is left out, as Anthropic leaves it out
            (
                ToolCall("toolu_1", "get_weather", '{"city":"Oslo"}'),
                ToolCall("toolu_2", "get_weather", '{"city":"Rome"}'),
            ),
        ),
        Message("tool", "4 C", tool_call_id="toolu_1"),
        Message("tool", "Error: no data", tool_call_id="toolu_2"),
        Message("user", "and?"),
    )
    assert generate.tools is not None
    assert orjson.loads(generate.tools) == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city.",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    assert generate.tool_choice == "auto" and generate.parallel_tool_calls is False
    assert generate.reasoning_format == "auto"


def test_tool_choice_and_thinking_map_onto_the_cores_fields() -> None:
    def generate(**fields: Any) -> Any:
        return to_generate(parse_body(body(**fields)), "r", Limits())

    forced = generate(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert (forced.tool_choice, forced.tool_name) == ("required", "get_weather")
    assert generate(tools=[WEATHER], tool_choice={"type": "any"}).tool_choice == "required"
    assert generate(tools=[WEATHER], tool_choice={"type": "none"}).tool_choice == "none"
    # Without tools, "auto" and "none" change nothing.
    plain = generate(tool_choice={"type": "none"}, tools=[])
    assert plain.tools is None and plain.tool_choice is None
    assert generate(thinking={"type": "disabled"}).reasoning_format == "none"
    assert generate().reasoning_format is None  # the server's default


def test_bad_tools_and_results_are_400s_naming_the_block() -> None:
    result = {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}
    turns = [*TOOL_TURNS[:2], {"role": "user", "content": [result]}]
    cases: list[tuple[dict[str, Any], str]] = [
        (body(messages=turns), "messages.2.content.0.tool_use_id: 'toolu_9' answers no tool_use"),
        (
            body(messages=[{"role": "user", "content": [{**result, "tool_use_id": "toolu_1"}]}]),
            "messages.0.content.0.tool_use_id",
        ),
        (
            body(messages=[TOOL_TURNS[0], {**TOOL_TURNS[1], "role": "user"}]),
            "messages.1.content.0.type: a 'thinking' block does not belong in a user message",
        ),
        (
            body(tools=[{**WEATHER, "input_schema": {"type": "string"}}]),
            "tools.0.input_schema.type",
        ),
        (body(tools=[{**WEATHER, "input_schema": "{}"}]), "tools.0.input_schema: must be"),
        (
            body(tools=[{**WEATHER, "input_schema": {"type": "object", "required": "city"}}]),
            "tools.0.input_schema.required",
        ),
        (body(tools=[{"type": "web_search_20250305", "name": "s"}]), "tools.0.type: server tools"),
        (body(tools=[WEATHER, WEATHER]), "tools.1.name: 'get_weather' is named twice"),
        (body(tools=[{**WEATHER, "name": "a b"}]), "tools.0.name"),
        (body(tools=[WEATHER], tool_choice={"type": "tool", "name": "x"}), "tool_choice.name"),
        (body(tool_choice={"type": "any"}), "tool_choice: 'any' needs tools"),
        (body(tools=[WEATHER], tool_choice="auto"), "tool_choice: must be"),
    ]
    for obj, named in cases:
        error = refusal(obj)
        assert error.status == HTTPStatus.BAD_REQUEST
        assert named in error.message, error.message


def test_thinking_text_and_calls_are_blocks_in_order() -> None:
    render = MessageRender(parse_body(body()), message_id="msg_1", model="fake")
    events = render.delta("", reasoning="Let me ")
    events += render.delta("", reasoning="see.")
    events += render.delta("Sure.")
    call = CallPart(0, '{"city":', "call_abc", "get_weather")
    events += render.delta("", tool_calls=(call, CallPart(0, '"Oslo"}')))
    events += render.delta("", tool_calls=(CallPart(1, "{}", "call_def", "get_weather"),))
    events += render.end(done("tool_calls"))
    shape = [
        (e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
        for e in events
    ]
    assert shape == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[9]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_abc",
        "name": "get_weather",
        "input": {},
    }
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert render.message()["content"] == [
        {"type": "thinking", "thinking": "Let me see.", "signature": ""},
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "toolu_def", "name": "get_weather", "input": {}},
    ]


def test_the_prompts_cached_part_is_counted_apart_as_anthropic_does() -> None:
    render = MessageRender(parse_body(body()), message_id="msg_1", model="fake")
    ended = Done("r", "stop", Usage(7, 2, cached_tokens=5), Timings(0, None, 1, 1))
    events = render.end(ended)
    usage = {"input_tokens": 2, "cache_read_input_tokens": 5, "output_tokens": 2}
    assert events[-2]["usage"] == usage == render.message()["usage"]


def test_a_stop_string_the_request_did_not_give_is_the_end_of_the_turn() -> None:
    # The llama engine's prompt format without a chat template stops at "\nUser:".
    render = MessageRender(parse_body(body()), message_id="msg_1", model="fake")
    events = render.end(done("stop", "\nUser:"))
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_keep_alive_reaches_the_generate_and_a_bad_one_is_named() -> None:
    assert to_generate(parse_body(body(keep_alive=0)), "r", LIMITS).keep_alive == 0.0
    assert to_generate(parse_body(body(keep_alive=-1)), "r", LIMITS).keep_alive == -1.0
    assert to_generate(parse_body(body()), "r", LIMITS).keep_alive is None
    for bad in (-2, "5m", True):
        error = refusal(body(keep_alive=bad))
        assert error.status == HTTPStatus.BAD_REQUEST and error.param == "keep_alive"
        assert error.message.startswith("keep_alive: "), error.message


def test_message_start_carries_the_engines_count_of_the_prompt() -> None:
    render = MessageRender(parse_body(body()), message_id="msg_1", model="fake")
    render.prompt_counted(7, 5)
    start = render.delta("Hi")[0]
    assert start["type"] == "message_start"
    assert start["message"]["usage"] == {
        "input_tokens": 2,
        "cache_read_input_tokens": 5,
        "output_tokens": 0,
    }
