"""The Responses API without I/O: bodies in (responses_api), events and objects
out (responses_render), and the bounded store (responses_store)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from wsserver.core.protocol import Done, Limits, Timings, Usage
from wsserver.dialects.api_errors import ApiError
from wsserver.dialects.responses.api import ResponsesRequest, parse_body, parse_json, to_generate
from wsserver.dialects.responses.render import ResponseRender, sse
from wsserver.dialects.responses.store import ResponseStore, StoredResponse
from wsserver.shaping.tool_calls import CallPart

LIMITS = Limits(
    max_frame_bytes=1 << 20,
    max_prompt_chars=1000,
    max_messages=8,
    max_tokens=100,
    default_max_tokens=10,
)


def refused(body: dict[str, Any], **kwargs: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_body(body, **kwargs)
    return info.value


def done(reason: str = "stop", **kwargs: Any) -> Done:
    return Done(
        id="r",
        reason=reason,  # type: ignore[arg-type]
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        timings=Timings(queued_ms=0.0, ttft_ms=1.0, total_ms=2.0, tokens_per_s=1.0),
        **kwargs,
    )


# ---------------------------------------------------------------- bodies


def test_a_string_input_is_one_user_message_with_the_instructions_first() -> None:
    request = parse_body(
        {"model": "m", "input": "hi", "instructions": "be kind", "max_output_tokens": 7}
    )
    generate = to_generate(request, (), "resp_1", LIMITS)
    assert [(m.role, m.content) for m in generate.messages or ()] == [
        ("system", "be kind"),
        ("user", "hi"),
    ]
    assert generate.max_tokens == 7


def test_message_items_with_text_parts_and_history() -> None:
    request = parse_body(
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_text", "text": "b"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "c"}],
                    "id": "msg_1",
                    "status": "completed",
                },
            ],
            "temperature": 0.5,
            "top_p": 0.9,
            "metadata": {"k": "v"},
            "store": False,
            "tools": [],
            "user": "u",
        }
    )
    assert request.store is False and request.metadata == {"k": "v"}
    history = ({"role": "user", "content": "earlier"},)
    generate = to_generate(request, history, "resp_1", LIMITS)
    assert [(m.role, m.content) for m in generate.messages or ()] == [
        ("user", "earlier"),
        ("system", "rules"),
        ("user", "ab"),
        ("assistant", "c"),
    ]
    assert (generate.temperature, generate.top_p) == (0.5, 0.9)


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            {"input": "x", "tools": [{"type": "function", "name": "f", "strict": True}]},
            "tools",
            "unsupported_parameter",
        ),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools", "unsupported_parameter"),
        (
            {"input": "x", "tool_choice": {"type": "web_search_preview"}},
            "tool_choice",
            "unsupported_parameter",
        ),
        ({"input": "x", "parallel_tool_calls": 1}, "parallel_tool_calls", "bad_request"),
        ({"input": "x", "reasoning": {"summary": "auto"}}, "reasoning", "unsupported_parameter"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "unsupported_parameter"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning", "unsupported_parameter"),
        ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity", "unsupported_parameter"),
        ({"input": "x", "background": True}, "background", "unsupported_parameter"),
        ({"input": "x", "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"input": "x", "stream": "yes"}, "stream", "bad_request"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata", "bad_request"),
        ({}, "input", "bad_request"),
    ],
)
def test_fields_not_honoured_are_refused_by_name(
    body: dict[str, Any], param: str, code: str
) -> None:
    error = refused(body)
    assert (error.status, error.param, error.code) == (400, param, code)
    assert param in error.message


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ({"type": "item_reference", "id": "fc_1"}, "item_reference"),
        ({"type": "function_call_output", "call_id": "c", "output": 3}, "output"),
        ({"type": "function_call", "call_id": "c", "name": "f"}, "arguments"),
        ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "x": 1}, "'x'"),
        ({"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}, "data: URL"),
        ({"role": "system", "content": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
        ({"role": "tool", "content": "x"}, "role"),
    ],
)
def test_unsupported_items_and_parts_are_refused_naming_them(
    item: dict[str, Any], named: str
) -> None:
    error = refused({"input": [item]})
    assert error.status == 400 and named in error.message


def test_the_protocols_limits_apply() -> None:
    request = parse_body({"input": "x" * 2000})
    with pytest.raises(ApiError) as info:
        to_generate(request, (), "resp_1", LIMITS)
    assert info.value.code == "too_large"
    with pytest.raises(ApiError) as info:
        to_generate(parse_body({"input": "x", "max_output_tokens": 10**6}), (), "r", LIMITS)
    assert info.value.status == 400


def test_websocket_mode_takes_stream_id_and_implies_stream() -> None:
    request = parse_body(
        {"type": "response.create", "input": "x", "stream_id": "a"}, websocket=True
    )
    assert request.stream and request.stream_id == "a"
    assert refused({"input": "x", "stream_id": "a"}).param == "stream_id"
    assert (
        refused({"type": "response.create", "input": "x", "stream": False}, websocket=True).param
        == "stream"
    )


def test_bad_json_is_refused() -> None:
    with pytest.raises(ApiError) as info:
        parse_json(b"{nope")
    assert info.value.code == "bad_json"
    with pytest.raises(ApiError):
        parse_json(b"[]")


# ---------------------------------------------------------------- events


def test_a_streamed_response_has_its_events_in_order_numbered_from_zero() -> None:
    render = ResponseRender(
        ResponsesRequest(input=()), response_id="resp_x", model="m", created_at=1
    )
    events = render.begin() + render.delta("he") + render.delta("llo") + render.end(done())
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "hello"
    assert final["usage"]["total_tokens"] == 5
    assert sse(events[0]).startswith(b"event: response.created\ndata: {")


def test_max_tokens_and_cancel_are_incomplete_errors_failed() -> None:
    request = ResponsesRequest(input=({"role": "user", "content": "q"},), stream_id="lane")
    render = ResponseRender(request, response_id="resp_x", model="m")
    events = render.delta("a") + render.end(done("length"))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert all(e["stream_id"] == "lane" for e in events)
    assert render.conversation(()) == (
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    )
    cancelled = ResponseRender(request, response_id="resp_y", model="m")
    events = cancelled.begin() + cancelled.end(done("cancelled"))
    assert [e["type"] for e in events][-1] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "cancelled"}
    assert events[-1]["response"]["output"] == []
    failed = ResponseRender(request, response_id="resp_z", model="m")
    events = failed.end(done("error", error_code="internal", error_message="boom"))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    assert events[-1]["response"]["error"] == {"code": "internal", "message": "boom"}


# ---------------------------------------------------------------- the store


def entry(response_id: str, text: str, expires: float | None = None) -> StoredResponse:
    conversation = ({"role": "assistant", "content": text},)
    return StoredResponse.of({"id": response_id}, conversation, expires=expires)


def test_the_store_is_bounded_by_bytes_oldest_forgotten_first() -> None:
    one = entry("a", "x" * 100)
    store = ResponseStore(max_bytes=one.size * 2 + 10)
    assert store.put(one, 0.0) and store.put(entry("b", "y" * 100), 0.0)
    assert store.put(entry("c", "z" * 100), 0.0)
    assert store.get("a", 0.0) is None and store.get("c", 0.0) is not None
    assert store.bytes <= store.max_bytes and len(store) == 2
    assert not store.put(entry("huge", "h" * 1000), 0.0)
    assert store.delete("b") and not store.delete("b")
    assert store.bytes == store.get("c", 0.0).size  # type: ignore[union-attr]


def test_the_store_forgets_after_its_ttl() -> None:
    store = ResponseStore(max_bytes=1 << 20, ttl_s=10.0)
    store.put(entry("a", "x", expires=store.expiry(0.0)), 0.0)
    assert store.get("a", 9.9) is not None
    assert store.get("a", 10.0) is None and store.bytes == 0
    assert orjson.loads(entry("a", "x").body) == {"id": "a"}


# ---------------------------------------------------------------- tools and reasoning


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_function_items_become_the_cores_tool_calls_and_tool_messages() -> None:
    request = parse_body(
        {
            "input": [
                {"role": "user", "content": "weather in Paris and Rome?"},
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": []},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": "call_1",
                    "name": "get_weather",
                    "arguments": '{"city":"Paris"}',
                    "status": "completed",
                },
                {
                    "type": "function_call",
                    "call_id": "call_2",
                    "name": "get_weather",
                    "arguments": '{"city":"Rome"}',
                },
                {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
                {
                    "type": "function_call_output",
                    "call_id": "call_2",
                    "output": [{"type": "input_text", "text": "21 C"}],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
        }
    )
    generate = to_generate(request, (), "resp_1", LIMITS)
    messages = generate.messages or ()
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assistant = messages[1]
    assert assistant.content == "Checking."
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", '{"city":"Paris"}'),
        ("call_2", "get_weather", '{"city":"Rome"}'),
    ]
    assert [(m.tool_call_id, m.content) for m in messages[2:]] == [
        ("call_1", "18 C"),
        ("call_2", "21 C"),
    ]
    (tool,) = orjson.loads(generate.tools or "[]")
    assert tool["function"]["name"] == "get_weather"
    assert tool["function"]["parameters"] == WEATHER["parameters"]
    # A named function is the core's forced call (the engine refuses it if it cannot).
    assert (generate.tool_choice, generate.tool_name) == ("required", "get_weather")
    assert generate.parallel_tool_calls is False


def test_without_tools_the_harmless_choices_are_dropped() -> None:
    request = parse_body({"input": "x", "tool_choice": "none", "parallel_tool_calls": True})
    generate = to_generate(request, (), "r", LIMITS)
    assert (generate.tools, generate.tool_choice, generate.parallel_tool_calls) == (
        None,
        None,
        None,
    )
    with pytest.raises(ApiError) as info:
        to_generate(parse_body({"input": "x", "tool_choice": "required"}), (), "r", LIMITS)
    assert info.value.param == "tool_choice"


def test_reasoning_text_and_two_calls_are_items_in_order() -> None:
    request = ResponsesRequest(input=({"role": "user", "content": "q"},), tools=(WEATHER,))
    render = ResponseRender(request, response_id="resp_x", model="m", created_at=1)
    events = (
        render.delta("", reasoning="hm")
        + render.delta("", reasoning="m")
        + render.delta("Checking.")
        + render.delta(
            "",
            tool_calls=(
                CallPart(0, '{"city":', "call_a", "get_weather"),
                CallPart(0, '"Paris"}'),
                CallPart(1, '{"city":"Rome"}', "call_b", "get_weather"),
            ),
        )
        + render.end(
            Done(
                id="r",
                reason="tool_calls",
                usage=Usage(prompt_tokens=3, completion_tokens=9, reasoning_tokens=2),
                timings=Timings(queued_ms=0.0, ttft_ms=1.0, total_ms=2.0, tokens_per_s=1.0),
            )
        )
    )
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.output_item.added", 3),
        ("response.function_call_arguments.delta", 3),
        ("response.function_call_arguments.done", 3),
        ("response.output_item.done", 3),
        ("response.completed", None),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    reasoning, message, first, second = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "Checking."
    assert (first["call_id"], first["arguments"]) == ("call_a", '{"city":"Paris"}')
    assert (second["call_id"], second["name"]) == ("call_b", "get_weather")
    assert len({item["id"] for item in final["output"]}) == 4
    assert first["id"].startswith("fc_") and reasoning["id"].startswith("rs_")
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    assert final["tools"] == [WEATHER]
    # The next turn continues with the text and both calls as one assistant
    # message, and its reasoning: the tool-use loop goes on.
    assert render.conversation(()) == (
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning": "hmm",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                },
            ],
        },
    )


def test_the_item_open_when_a_response_is_cut_ends_incomplete() -> None:
    render = ResponseRender(ResponsesRequest(input=()), response_id="resp_x", model="m")
    events = render.delta("", reasoning="thinking") + render.end(done("length"))
    assert [e["type"] for e in events][-4:] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    (item,) = events[-1]["response"]["output"]
    assert (item["type"], item["status"]) == ("reasoning", "incomplete")


def test_a_call_cut_by_a_cancel_is_incomplete_and_not_carried_over() -> None:
    request = ResponsesRequest(input=({"role": "user", "content": "q"},), tools=(WEATHER,))
    render = ResponseRender(request, response_id="resp_x", model="m")
    events = render.delta("", tool_calls=(CallPart(0, '{"city":', "call_a", "get_weather"),))
    events += render.end(done("cancelled"))
    (call,) = events[-1]["response"]["output"]
    assert (call["type"], call["status"], call["arguments"]) == (
        "function_call",
        "incomplete",
        '{"city":',
    )
    assert render.conversation(()) == (
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": ""},
    )


def test_keep_alive_reaches_the_generate_and_a_bad_one_is_named() -> None:
    for websocket in (False, True):
        request = parse_body({"input": "hi", "keep_alive": 0}, websocket=websocket)
        assert to_generate(request, (), "r", LIMITS).keep_alive == 0.0
    request = parse_body({"input": "hi", "keep_alive": -1})
    assert to_generate(request, (), "r", LIMITS).keep_alive == -1.0
    assert to_generate(parse_body({"input": "hi"}), (), "r", LIMITS).keep_alive is None
    for bad in (-2, "5m", True):
        with pytest.raises(ApiError) as info:
            to_generate(parse_body({"input": "hi", "keep_alive": bad}), (), "r", LIMITS)
        assert info.value.status == 400 and "'keep_alive'" in info.value.message
