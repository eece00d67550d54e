"""Anthropic's Messages API through the openai relay: a ``/v1/messages`` request
reaches an OpenAI-compatible upstream as a chat completion (text), so the
dialect works on every engine; ``count_tokens`` is refused there by name."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from fake_upstream import PIECES, FakeUpstream
from test_anthropic_http import sdk
from test_openai_backend import relay

TEXT = "".join(PIECES)


async def test_a_message_goes_upstream_as_a_chat_and_comes_back_whole_and_streamed() -> None:
    async with FakeUpstream() as up, relay(up.url, model="m1") as server, sdk(server) as client:
        whole = await client.messages.create(
            model="m1",
            system="be kind",
            messages=[{"role": "user", "content": "u"}],
            max_tokens=50,
            stop_sequences=["zz"],
        )
        assert whole.content[0].text == TEXT  # type: ignore[union-attr]
        assert whole.stop_reason == "end_turn" and whole.model == server.backend.model_name
        stream_request = up.streams[0]
        assert stream_request.path == "/v1/chat/completions"
        assert stream_request.body["messages"] == [
            {"role": "system", "content": "be kind"},
            {"role": "user", "content": "u"},
        ]
        assert stream_request.body["max_tokens"] == 50 and stream_request.body["stop"] == ["zz"]
        async with client.messages.stream(
            model="m1", messages=[{"role": "user", "content": "u"}], max_tokens=50
        ) as stream:
            deltas = [e.delta.text async for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
            final = await stream.get_final_message()
        assert "".join(deltas) == TEXT == final.content[0].text  # type: ignore[union-attr]


async def test_a_stop_sequence_the_relay_cut_is_named() -> None:
    async with FakeUpstream() as up, relay(up.url) as server, sdk(server) as client:
        up.mode = "endless"
        whole = await client.messages.create(
            model=up.model,
            messages=[{"role": "user", "content": "u"}],
            max_tokens=50,
            stop_sequences=["ld —"],
        )
        assert whole.content[0].text == "Hello, wor"  # type: ignore[union-attr]
        assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == "ld —"


async def test_count_tokens_is_refused_by_name_on_the_relay() -> None:
    async with FakeUpstream() as up, relay(up.url) as server, sdk(server) as client:
        with pytest.raises(anthropic.BadRequestError, match="count_tokens is not available"):
            await client.messages.count_tokens(
                model=up.model, messages=[{"role": "user", "content": "u"}]
            )
        assert not up.streams


async def test_a_think_block_upstream_is_a_thinking_block_and_tools_are_refused_by_name() -> None:
    async with FakeUpstream() as up, relay(up.url) as server, sdk(server) as client:
        up.pieces = ["<thi", "nk>Let me ", "see.</th", "ink>\n\n", "Hel", "lo"]
        kwargs: Any = {"model": up.model, "messages": [{"role": "user", "content": "u"}]}
        whole = await client.messages.create(
            **kwargs, max_tokens=50, thinking={"type": "enabled", "budget_tokens": 20}
        )
        assert [
            (b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in whole.content
        ] == [
            ("thinking", "Let me see."),
            ("text", "Hello"),
        ]
        # The budget goes upstream in llama-server's per-request field.
        assert up.streams[0].body["reasoning_budget_tokens"] == 20
        async with client.messages.stream(**kwargs, max_tokens=50) as stream:
            kinds = [e.delta.type async for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
            final = await stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
        assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
        assert "signature_delta" in kinds


async def test_an_upstreams_reasoning_and_tool_calls_are_thinking_and_tool_use_blocks() -> None:
    async with FakeUpstream() as up, relay(up.url) as server, sdk(server) as client:
        up.pieces = ["Checking."]
        up.reasoning = ["The user wants ", "the weather."]
        up.tool_call_deltas = [
            [
                {
                    "index": 0,
                    "id": "call_up_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ],
            [{"index": 0, "function": {"arguments": '{"city": '}}],
            [{"index": 0, "function": {"arguments": '"Paris"}'}}],
        ]
        weather = {
            "name": "get_weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
        kwargs: Any = {
            "model": up.model,
            "max_tokens": 50,
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [weather],
            "tool_choice": {"type": "tool", "name": "get_weather"},
        }
        whole = await client.messages.create(**kwargs)
        thinking, text, call = whole.content
        assert thinking.type == "thinking" and thinking.thinking == "The user wants the weather."
        assert text.type == "text" and text.text == "Checking."
        assert call.type == "tool_use" and call.name == "get_weather"
        assert call.id == "toolu_up_1" and call.input == {"city": "Paris"}
        assert whole.stop_reason == "tool_use"
        body = up.streams[0].body
        assert body["tools"][0]["function"]["name"] == "get_weather"
        assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
        async with client.messages.stream(**kwargs) as stream:
            kinds = [e.delta.type async for e in stream if e.type == "content_block_delta"]  # type: ignore[union-attr]
            final = await stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
        assert "thinking_delta" in kinds and "input_json_delta" in kinds


async def test_the_tool_use_loops_thinking_goes_upstream_as_reasoning_content() -> None:
    """llama-server hands an assistant message's ``reasoning_content`` to its
    chat template: the thinking of the loop in progress reaches it so, an
    earlier turn's does not."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "main.py"}
    tools = [{"name": "ls", "input_schema": {"type": "object"}}]
    async with FakeUpstream() as up, relay(up.url) as server, sdk(server) as client:
        loop: list[dict[str, Any]] = [
            {"role": "user", "content": "Fix the bug"},
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "Look first.", "signature": ""}, call],
            },
            {"role": "user", "content": [result]},
        ]
        for messages in (
            loop,
            [
                *loop,
                {"role": "assistant", "content": "Done."},
                {"role": "user", "content": "Next?"},
            ],
        ):
            await client.messages.create(
                model=up.model,
                messages=messages,  # type: ignore[arg-type]
                tools=tools,  # type: ignore[list-item]
                max_tokens=50,
            )
        in_loop, later = (stream.body["messages"][1] for stream in up.streams)
        assert in_loop["reasoning_content"] == "Look first." and in_loop["content"] is None
        assert in_loop["tool_calls"][0]["id"] == "toolu_1"
        assert "reasoning_content" not in later
