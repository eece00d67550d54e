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
from conftest import make_config, running_server, timeout, validate_server_frame, wire

from wsserver.pacing import Coalescer
from wsserver.protocol import CallPart, Delta, parse_server_frame, serialize
from wsserver.replay import ReplayTail

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
ARGUMENTS = '{"city":"Tōkyō"}'
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
        assert not any("tool_calls" in f for f in frames)


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
                model="m",
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
                model="m",
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
