"""Function calls and reasoning items of the Responses API, end to end: the
fake engine streams a think block, some text and a tool call (the core splits
and parses them, wsserver/reasoning.py and wsserver/tool_calls.py); the
official ``openai`` SDK reads them over HTTP (``create``, ``create(stream=True)``,
the ``responses.stream`` helper) and in WebSocket mode (``responses.connect``),
and answers the call with a ``function_call_output`` via ``previous_response_id``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from conftest import FAKE_MODEL, running_server, timeout

from wsserver.aio import Server
from wsserver.aio.responses_socket import ResponsesDialect

THOUGHT = "The user wants 日本's weather 😀."
OUTPUT = (
    f"<think>{THOUGHT}</think>Checking. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Tōkyō"}}\n</tool_call>'
)
ARGUMENTS = '{"city": "Tōkyō"}'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
    "strict": False,
}
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture
def calling(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "call.txt"
    path.write_text(OUTPUT, encoding="utf-8")
    return str(path)


def fake(text_file: str, **overrides: Any) -> dict[str, Any]:
    return {
        "backend__fake__tokens_per_s": 0.0,
        "backend__fake__text_file": text_file,
        **overrides,
    }


@contextlib.asynccontextmanager
async def sdk(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=timeout(30),
    )
    try:
        yield client
    finally:
        await client.close()


def check_event_order(events: list[Any]) -> None:
    """Numbered from 0; each item added, filled and done before the next is added."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in TERMINAL
    open_index: int | None = None
    seen: list[int] = []
    for event in events[1:-1]:
        index = getattr(event, "output_index", None)
        if event.type == "response.output_item.added":
            assert open_index is None
            open_index = index
            seen.append(index)
        elif event.type == "response.output_item.done":
            assert index == open_index
            open_index = None
        elif index is not None:
            assert index == open_index, event
    assert open_index is None and seen == list(range(len(seen)))


def check_output(output: list[Any]) -> None:
    """A reasoning item, the text, the call: as the model wrote them."""
    assert [item.type for item in output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = output
    assert reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content is not None and reasoning.content[0].text == THOUGHT
    assert message.content[0].text.strip() == "Checking."
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert (call.name, call.status) == ("get_weather", "completed")
    assert json.loads(call.arguments) == json.loads(ARGUMENTS)


async def test_a_call_and_reasoning_over_http_streamed_whole_and_by_the_helper(
    calling: str,
) -> None:
    async with running_server(**fake(calling)) as server, sdk(server) as client:
        whole = await client.responses.create(model=FAKE_MODEL, input="weather?", tools=[WEATHER])
        assert whole.status == "completed"
        check_output(whole.output)
        assert whole.tools[0].name == "get_weather"  # type: ignore[union-attr]
        usage = whole.usage
        assert usage is not None
        reasoning_tokens = usage.output_tokens_details.reasoning_tokens
        assert 0 < reasoning_tokens < usage.output_tokens

        stream = await client.responses.create(
            model=FAKE_MODEL, input="weather?", tools=[WEATHER], stream=True
        )
        events = [event async for event in stream]
        check_event_order(events)
        kinds = [e.type for e in events]
        assert kinds.count("response.output_item.added") == 3
        for kind in (
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.output_text.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
        ):
            assert kind in kinds
        thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert thought == THOUGHT
        arguments = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert arguments == done.arguments and done.output_index == 2
        final = events[-1].response
        check_output(final.output)
        assert final.usage.output_tokens_details.reasoning_tokens == reasoning_tokens

        async with client.responses.stream(
            model=FAKE_MODEL, input="weather?", tools=[WEATHER]
        ) as helper:
            async for _ in helper:
                pass
            accumulated = await helper.get_final_response()
        check_output(accumulated.output)


async def test_a_function_call_output_answers_the_call_via_previous_response_id(
    calling: str,
) -> None:
    async with running_server(**fake(calling)) as server, sdk(server) as client:
        first = await client.responses.create(model=FAKE_MODEL, input="weather?", tools=[WEATHER])
        call = first.output[-1]
        assert call.type == "function_call"
        second = await client.responses.create(
            model=FAKE_MODEL,
            previous_response_id=first.id,
            tools=[WEATHER],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        )
        assert second.status == "completed"
        # What the engine saw, as the store keeps it for a third turn: the
        # call as the assistant's tool_calls, its output as a tool message.
        entry = server.responses.store.get(second.id, 0.0)
        assert entry is not None
        conversation = [dict(m) for m in entry.conversation]
        assert conversation[0] == {"role": "user", "content": "weather?"}
        assert conversation[1]["tool_calls"] == [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": call.arguments},
            }
        ]
        assert "Checking" in conversation[1]["content"]
        assert conversation[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}
        assert conversation[3]["role"] == "assistant"
        # The same conversation sent as items is accepted as it is.
        resent = await client.responses.create(
            model=FAKE_MODEL,
            tools=[WEATHER],
            input=[
                {"role": "user", "content": "weather?"},
                *[item.model_dump(exclude_none=True) for item in first.output],
                {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
            ],
        )
        assert resent.usage is not None and second.usage is not None
        assert resent.usage.input_tokens == second.usage.input_tokens


async def test_tool_fields_are_refused_by_name_or_reach_the_engine(calling: str) -> None:
    async with running_server(**fake(calling)) as server, sdk(server) as client:
        refusals: list[tuple[dict[str, Any], str]] = [
            ({"tools": [{"type": "web_search"}]}, "web_search"),
            ({"tools": [{**WEATHER, "strict": True}]}, "strict"),
            ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools[0].name"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "x"}}, "x"),
            (
                {"input": [{"type": "function_call_output", "call_id": "call_no", "output": "o"}]},
                "call_no",
            ),
        ]
        if "tool_choice" not in server.backend.honours:
            # Not enforceable by this engine: refused, never hoped for.
            refusals.append(({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"))
        for extra, named in refusals:
            body: dict[str, Any] = {"model": FAKE_MODEL, "input": "weather?", **extra}
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(**body)
            assert named in info.value.message, info.value.message
        # tool_choice "none": the tools are not shown, no call is parsed.
        plain = await client.responses.create(
            model=FAKE_MODEL, input="weather?", tools=[WEATHER], tool_choice="none"
        )
        assert [item.type for item in plain.output] == ["reasoning", "message"]
        assert "<tool_call>" in plain.output_text
        assert plain.tool_choice == "none"


async def test_a_call_in_websocket_mode_answered_on_the_same_socket(calling: str) -> None:
    async with running_server(**fake(calling)) as server, sdk(server) as client:
        async with client.responses.connect(max_retries=0) as connection:
            await connection.send(
                {"type": "response.create", "input": "weather?", "tools": [WEATHER]}
            )
            events = await until_terminal(connection)
            check_event_order(events)
            final = events[-1].response
            check_output(final.output)
            call = final.output[-1]
            deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
            assert deltas and all(e.item_id == call.id for e in deltas)
            await connection.send(
                {
                    "type": "response.create",
                    "previous_response_id": final.id,
                    "tools": [WEATHER],
                    "input": [
                        {"type": "function_call_output", "call_id": call.call_id, "output": "18"}
                    ],
                }
            )
            second = (await until_terminal(connection))[-1].response
            assert second.status == "completed"
            (socket,) = server.connections.values()
            assert isinstance(socket.dialect, ResponsesDialect)
            entry = socket.dialect.store.get(second.id, 0.0)
            assert entry is not None
            roles = [m["role"] for m in entry.conversation]
            assert roles == ["user", "assistant", "tool", "assistant"]
            assert entry.conversation[2]["tool_call_id"] == call.call_id


async def until_terminal(connection: Any) -> list[Any]:
    events = []
    async with asyncio.timeout(timeout(30)):
        async for event in connection:
            events.append(event)
            if event.type in (*TERMINAL, "error"):
                return events
    raise AssertionError("the socket closed before the response ended")
