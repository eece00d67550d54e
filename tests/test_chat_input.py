"""Chat input on the wire (wsserver/chat_input.py): roles, tool calls, tools,
template variables — parsed strictly, refused with a clear ``bad_request``."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from wsserver.backends.base import GenerationRequest
from wsserver.backends.fake import FakeBackend
from wsserver.backends.openai_wire import request_body
from wsserver.core.protocol import Generate, Limits, Message, ToolCall, parse_client_frame
from wsserver.dialects.openai.api import ApiError, parse_request
from wsserver.errors import ProtocolError

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def generate(**fields: Any) -> Generate:
    frame = parse_client_frame(json.dumps({"type": "generate", "id": "g", **fields}), Limits())
    assert isinstance(frame, Generate)
    return frame


def refused(**fields: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        generate(**fields)
    assert caught.value.request_id == "g"
    return caught.value


def test_every_role_and_a_tool_round_trip() -> None:
    frame = generate(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather?", "name": "ann"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[TOOL],
        chat_template_kwargs={"enable_thinking": False},
    )
    assert frame.messages == (
        Message("developer", "Be brief."),
        Message("user", "Weather?", name="ann"),
        Message("assistant", "", (ToolCall("c1", "get_weather", "{}"),)),
        Message("tool", "sunny", tool_call_id="c1"),
    )
    assert frame.messages[2].to_openai() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [CALL],
    }
    assert json.loads(frame.tools or "") == [TOOL]
    assert frame.chat_template_kwargs == '{"enable_thinking":false}'


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "needs 'tool_call_id'"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "only a tool"),
        ({"messages": [{"role": "user", "content": None}]}, "null only beside"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]},
            "only an assistant",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "must be one of"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "must be an object"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]},
            "tool_calls[0] must be",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}],
                    }
                ]
            },
            "arguments must be a string",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "'tools' must be a list"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "code"}]},
            "tools[0] must be",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "a b"}}],
            },
            "function.name",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL, TOOL]},
            "named twice",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}],
            },
            "JSON Schema object",
        ),
        (
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
            },
            "describe an object",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": []},
            "must be an object",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": 1}},
            "set by the server",
        ),
        ({"prompt": "x", "tools": [TOOL]}, "needs 'messages'"),
    ],
)
def test_bad_chat_input_is_a_bad_request(fields: dict[str, Any], words: str) -> None:
    error = refused(**fields)
    assert error.code == "bad_request"
    assert words in str(error)


def test_tools_count_against_the_prompt_limit() -> None:
    big = {**TOOL, "function": {**TOOL["function"], "description": "x" * 100_000}}  # type: ignore[dict-item]
    error = refused(messages=[{"role": "user", "content": "x"}], tools=[big])
    assert error.code == "too_large"


def test_the_fake_takes_tools_and_refuses_template_variables_by_name() -> None:
    # The fake's scripted text is parsed for calls (tests/test_tool_call_wire.py).
    FakeBackend().check(generate(messages=[{"role": "user", "content": "x"}], tools=[TOOL]))
    with pytest.raises(ProtocolError, match="'chat_template_kwargs'"):
        FakeBackend().check(
            generate(messages=[{"role": "user", "content": "x"}], chat_template_kwargs={})
        )
    FakeBackend().check(generate(messages=[{"role": "tool", "content": "r", "tool_call_id": "c"}]))


def test_the_relay_forwards_tools_calls_and_template_variables() -> None:
    frame = generate(
        messages=[
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=[TOOL],
        chat_template_kwargs={"enable_thinking": True},
    )
    _, body = request_body(GenerationRequest.from_frame(frame, default_max_tokens=8), "m")
    sent = orjson.loads(body)
    assert sent["messages"] == [
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    assert sent["tools"] == [TOOL]
    assert sent["chat_template_kwargs"] == {"enable_thinking": True}


def openai_request(**body: Any) -> Generate:
    return parse_request("chat", orjson.dumps(body), "r", Limits()).generate


def test_the_openai_api_takes_tool_messages_and_tools() -> None:
    frame = openai_request(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": None},
        ],
        tools=[TOOL],
        tool_choice="auto",
        chat_template_kwargs={"enable_thinking": False},
    )
    assert frame.messages is not None and frame.messages[1].tool_calls[0].id == "c1"
    assert frame.messages[2] == Message("tool", "sunny", tool_call_id="c1")
    assert frame.tools is not None and frame.chat_template_kwargs is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, None),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}}, None),
        ({"tools": [TOOL], "parallel_tool_calls": "no"}, None),
        ({"messages": [{"role": "tool", "content": "r"}]}, None),
    ],
)
def test_the_openai_api_refuses_what_it_cannot_honour_by_name(
    body: dict[str, Any], param: str | None
) -> None:
    with pytest.raises(ApiError) as caught:
        openai_request(**{"messages": [{"role": "user", "content": "x"}], **body})
    assert caught.value.status == 400
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("parameters", "where"),
    [
        ({"type": "object", "properties": {"n": {"type": "integr"}}}, "properties.n.type"),
        ({"type": "object", "properties": {"n": 3}}, "properties.n must be a JSON Schema"),
        ({"type": "object", "properties": {"n": {"anyOf": {"type": "string"}}}}, "n.anyOf"),
        ({"type": "object", "properties": {"n": {"items": {"type": ["string", 1]}}}}, "items.type"),
        ({"type": "object", "properties": {"n": {"enum": "a"}}}, "n.enum must be a list"),
        ({"type": "object", "$defs": {"d": {"required": "x"}}}, "$defs.d.required"),
    ],
)
def test_tools_that_are_not_json_schema_are_refused_by_place(
    parameters: dict[str, Any], where: str
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    error = refused(messages=[{"role": "user", "content": "x"}], tools=[tool])
    assert error.code == "bad_request"
    assert error.message.startswith("tools[0].function.parameters")
    assert where in error.message
    # Valid schemas with the same keywords are taken.
    generate(
        messages=[{"role": "user", "content": "x"}],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "n": {"type": ["string", "null"], "enum": ["a", None]},
                            "m": {"anyOf": [{"type": "integer"}, True]},
                            "l": {"type": "array", "items": {"$ref": "#/$defs/d"}},
                        },
                        "$defs": {"d": {"type": "object", "required": ["x"]}},
                    },
                },
            }
        ],
    )
