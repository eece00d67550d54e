"""Tool calls through every wire: the fake engine streams a call, the
WebSocket protocol carries it in ``delta.tool_calls`` (paced, numbered,
replayed on resume) and ends with ``done`` reason ``tool_calls``; the
official ``openai`` SDK's streaming helper accumulates our chunks into the
same call as the non-streamed answer."""

from __future__ import annotations

import json
import pathlib

import openai
import pytest
from conftest import FAKE_MODEL, make_config, running_server, timeout, validate_server_frame, wire

from wsserver.core.pacing import Coalescer
from wsserver.core.protocol import (
    CallPart,
    Delta,
    Generate,
    Limits,
    parse_client_frame,
    parse_server_frame,
    serialize,
)
from wsserver.core.replay import ReplayTail
from wsserver.errors import ProtocolError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
OUTPUT = (
    "Checking 日本 😀. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>'
)
ARGUMENTS = '{"city": "Tōkyō"}'  # as the model wrote them
CHAT = [{"role": "user", "content": "weather?"}]


def fake_config(text_file: str, **overrides: object) -> object:
    values: dict[str, object] = {
        "backend__kind": "fake",
        "backend__fake__tokens_per_s": 0,
        "backend__fake__text_file": text_file,
    }
    values.update(overrides)
    return make_config(**values)


@pytest.fixture
def calling(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "call.txt"
    path.write_text(OUTPUT, encoding="utf-8")
    return str(path)


def test_a_delta_carries_call_parts() -> None:
    frame = Delta(
        id="a",
        seq=3,
        text="",
        tool_calls=(CallPart(0, '{"a":', "call_1", "add"), CallPart(0, "1}")),
    )
    data = serialize(frame)
    assert json.loads(data)["tool_calls"] == [
        {"index": 0, "id": "call_1", "name": "add", "arguments": '{"a":'},
        {"index": 0, "arguments": "1}"},
    ]
    validate_server_frame(data.decode())
    assert parse_server_frame(data) == frame


def test_the_coalescer_bounds_frames_of_calls() -> None:
    coalescer = Coalescer(flush_window=1.0, flush_tokens=100, max_chars=10)
    coalescer.add("hi", 1)
    coalescer.add_calls((CallPart(0, "x" * 8, "c", "f"), CallPart(0, "y" * 8)))
    assert coalescer.full and coalescer.due(0.0)
    assert coalescer.take_calls() == (CallPart(0, "x" * 8, "c", "f"),)
    assert coalescer.take(0.0) == ("hi", 1)
    assert coalescer.pending and not coalescer.due(0.5)  # the rest waits for its window
    assert coalescer.due(1.5)  # a window after it was first seen
    assert coalescer.take_calls() == (CallPart(0, "y" * 8),)
    assert coalescer.take(1.5) == ("", 0) and not coalescer.pending


async def test_websocket_deltas_carry_the_call(calling: str) -> None:
    async with running_server(fake_config(calling)) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "a", "messages": CHAT, "tools": TOOLS})
        text, frames = await client.done("a")
        for frame in frames:
            validate_server_frame(json.dumps(frame))
        deltas = [f for f in frames if f["type"] == "delta"]
        assert text == "Checking 日本 😀. "
        parts = [p for f in deltas for p in f.get("tool_calls", ())]
        assert parts[0]["name"] == "get_weather" and parts[0]["id"].startswith("call_")
        assert "".join(p["arguments"] for p in parts) == ARGUMENTS
        assert [f["seq"] for f in deltas] == list(range(len(deltas)))
        assert frames[-1]["reason"] == "tool_calls"
        # Without tools the same output is text, as the model wrote it.
        await client.send({"type": "generate", "id": "b", "messages": CHAT})
        text, frames = await client.done("b")
        assert text == OUTPUT and frames[-1]["reason"] == "stop"


async def test_a_malformed_call_ends_in_an_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text('<tool_call>{"name": "get_weather", "arguments": {city: 1}}</tool_call>')
    async with running_server(fake_config(str(path))) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "a", "messages": CHAT, "tools": TOOLS})
        text, frames = await client.done("a")
        done = frames[-1]
        assert text == "" and done["reason"] == "error"
        assert done["error"]["code"] == "invalid_tool_call"
        assert "not valid JSON" in done["error"]["message"]
        # The call went out as far as it was read (its name, and "{" if that
        # came in a token before "city"), and the error after it says it is not one.
        parts = [p for f in frames for p in f.get("tool_calls", ())]
        assert parts[0]["name"] == "get_weather"
        assert "".join(p["arguments"] for p in parts) in ("", "{")


def test_a_call_is_kept_for_a_resume_and_replayed_as_sent() -> None:
    # The replay tail keeps deltas as written, counted by their wire bytes:
    # a call's parts are replayed like text, and bounded with it.
    tail = ReplayTail(budget=10_000)
    first = Delta(id="a", seq=0, text="Checking ")
    call = Delta(id="a", seq=1, text="", tool_calls=(CallPart(0, ARGUMENTS, "call_x", "f"),))
    tail.add(first)
    tail.add(call)
    assert tail.after(0, 2, "a") == [call]
    assert tail.bytes == len(serialize(first)) + len(serialize(call))


def sdk(server: object) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1",  # type: ignore[attr-defined]
        api_key="unused",
        max_retries=0,
        timeout=timeout(30),
    )


async def test_the_openai_sdk_gets_the_same_call_streamed_and_not(calling: str) -> None:
    async with running_server(fake_config(calling)) as server:
        api = sdk(server)
        try:
            reply = await api.chat.completions.create(
                model=FAKE_MODEL,
                messages=CHAT,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Checking 日本 😀. "
            (call,) = choice.message.tool_calls or []
            assert call.type == "function" and call.function.name == "get_weather"
            assert call.function.arguments == ARGUMENTS
            async with api.beta.chat.completions.stream(
                model=FAKE_MODEL,
                messages=CHAT,  # type: ignore[arg-type]
                tools=TOOLS,  # type: ignore[arg-type]
            ) as stream:
                async for _ in stream:
                    pass
                final = await stream.get_final_completion()
            streamed = final.choices[0]
            assert streamed.finish_reason == "tool_calls"
            assert streamed.message.content == choice.message.content
            (scall,) = streamed.message.tool_calls or []
            assert (scall.function.name, scall.function.arguments) == (
                call.function.name,
                call.function.arguments,
            )
            assert scall.id.startswith("call_")
        finally:
            await api.close()


def test_tool_choice_is_parsed_and_checked() -> None:
    limits = Limits()

    def generate(**fields: object) -> Generate:
        frame = {"type": "generate", "id": "a", "messages": CHAT, **fields}
        parsed = parse_client_frame(json.dumps(frame), limits)
        assert isinstance(parsed, Generate)
        return parsed

    named = {"type": "function", "function": {"name": "get_weather"}}
    frame = generate(tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
    assert (frame.tool_choice, frame.tool_name, frame.parallel_tool_calls) == (
        "required",
        "get_weather",
        False,
    )
    assert generate(tools=TOOLS, tool_choice="none").tool_choice == "none"
    for fields, message in [
        ({"tool_choice": "auto"}, "'tool_choice' needs 'tools'"),
        ({"parallel_tool_calls": True}, "'parallel_tool_calls' needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "any"}, "'tool_choice' must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
            "'rm', which is not one of 'tools'",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": 0}, "must be a boolean"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "JSON"),
    ]:
        with pytest.raises(ProtocolError, match=message) as caught:
            generate(**fields)
        assert caught.value.code == "bad_request"


async def test_tool_choice_none_and_one_call(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "two.txt"
    path.write_text(
        '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>'
    )
    async with running_server(fake_config(str(path))) as server, wire(server) as client:
        base = {"type": "generate", "messages": CHAT, "tools": TOOLS}
        await client.send({**base, "id": "a", "tool_choice": "none"})
        text, frames = await client.done("a")
        assert text == path.read_text() and frames[-1]["reason"] == "stop"
        await client.send({**base, "id": "b", "parallel_tool_calls": False})
        _, frames = await client.done("b")
        parts = [p for f in frames for p in f.get("tool_calls", ())]
        assert {p["index"] for p in parts} == {0}
        assert "".join(p["arguments"] for p in parts) == '{"city": "A"}'
        assert frames[-1]["reason"] == "tool_calls"
        await client.send({**base, "id": "c"})
        _, frames = await client.done("c")
        indexes = [p["index"] for f in frames for p in f.get("tool_calls", ())]
        heads = [p["index"] for f in frames for p in f.get("tool_calls", ()) if "name" in p]
        assert heads == [0, 1] and indexes == sorted(indexes)  # one call, then the next
        # The fake cannot force a call: refused by name, never ignored.
        await client.send({**base, "id": "d", "tool_choice": "required"})
        refused = await client.until(lambda f: f["type"] == "error")
        assert refused[-1]["code"] == "unsupported_option"
        assert "tool_choice" in refused[-1]["message"]


async def test_openai_bad_tool_input_is_a_400(calling: str) -> None:
    async with running_server(fake_config(calling)) as server:
        api = sdk(server)
        try:
            for extra in [
                {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"messages": [{"role": "tool", "content": "r"}]},
                {"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
            ]:
                body: dict[str, object] = {"model": FAKE_MODEL, "messages": CHAT, "tools": TOOLS}
                body.update(extra)
                with pytest.raises(openai.BadRequestError) as caught:
                    await api.chat.completions.create(**body)  # type: ignore[call-overload]
                assert caught.value.status_code == 400
            # Harmless values without tools are accepted.
            reply = await api.chat.completions.create(
                model=FAKE_MODEL,
                messages=CHAT,  # type: ignore[arg-type]
                tool_choice="none",
                parallel_tool_calls=True,
            )
            assert reply.choices[0].finish_reason == "stop"
        finally:
            await api.close()
