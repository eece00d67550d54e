"""Tool calls and reasoning through the openai relay (a real fake upstream,
tests/fake_upstream.py): ``tools``, ``tool_choice``, ``parallel_tool_calls``
and the conversation's tool messages are forwarded; the upstream's streamed
``tool_calls`` and its reasoning (``reasoning_content`` or ``reasoning``)
reach WebSocket clients and our ``/v1`` with the same ids, names, arguments
and reasoning, kept apart from the content."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from conftest import timeout, wire
from fake_upstream import FakeUpstream
from test_openai_backend import relay
from test_openai_http import base_url

from wsserver.backends.openai_wire import ToolDelta, UpstreamError, parse_chunk
from wsserver.shaping.tool_calls import CallPart, ToolSplit, parser_for

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME: Any = {"type": "function", "function": {"name": "get_time"}}
HISTORY: list[Any] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_prev",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Lyon"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_prev", "content": "12 C"},
    {"role": "user", "content": "And Paris?"},
]
REASONING = ["The user wants ", "the weather ", "in Paris."]
CONTENT = ["Checking", " now."]
#: Two calls, the first one's arguments in fragments (as llama-server streams them).
CALLS: list[list[dict[str, Any]]] = [
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
    [
        {
            "index": 1,
            "id": "call_up_2",
            "type": "function",
            "function": {"name": "get_time", "arguments": "{}"},
        }
    ],
]


def scripted(up: FakeUpstream, *, key: str = "reasoning_content") -> None:
    up.reasoning = list(REASONING)
    up.reasoning_key = key
    up.pieces = list(CONTENT)
    up.tool_call_deltas = [list(parts) for parts in CALLS]


def test_the_chunk_parser_reads_reasoning_and_call_parts() -> None:
    for key in ("reasoning_content", "reasoning"):
        chunk = parse_chunk(json.dumps({"choices": [{"index": 0, "delta": {key: "hm"}}]}))
        assert chunk.reasoning == "hm" and chunk.text == ""
    chunk = parse_chunk(json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": CALLS[0]}}]}))
    assert chunk.tool_calls == (ToolDelta(0, "call_up_1", "get_weather", ""),)
    for bad in (
        {"tool_calls": {"index": 0}},
        {"tool_calls": [{"index": "0"}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": 3}}]},
        {"reasoning_content": 5},
    ):
        with pytest.raises(UpstreamError):
            parse_chunk(json.dumps({"choices": [{"index": 0, "delta": bad}]}))


def test_relayed_parts_are_released_as_they_come() -> None:
    """The ``relay`` syntax's parser: the engine's text is content as it
    came, each call part is released at once (the argument fragments too),
    with the upstream's ids and names, renumbered in the order the calls
    came; a call without arguments gets ``{}``."""
    parser = parser_for("relay", names=frozenset({"get_weather", "get_time"}))
    splits = [
        parser.feed("So: "),
        parser.part(CallPart(3, "", "call_a", "get_weather")),
        parser.part(CallPart(3, '{"city": ')),
        parser.feed(" and "),
        parser.part(CallPart(3, '"Tōkyō 😀"}')),
        parser.part(CallPart(7, "", None, "get_time")),
        parser.flush(),
    ]
    assert "".join(s.content for s in splits) == "So:  and "
    calls = [c for s in splits for c in s.calls]
    assert [(c.index, c.id, c.name, c.arguments) for c in calls[:3]] == [
        (0, "call_a", "get_weather", ""),
        (0, None, None, '{"city": '),
        (0, None, None, '"Tōkyō 😀"}'),
    ]
    assert (calls[3].index, calls[3].name, calls[3].arguments) == (1, "get_time", "")
    assert calls[3].id is not None and calls[3].id.startswith("call_")
    assert (calls[4].index, calls[4].arguments) == (1, "{}")
    assert not any(s.error for s in splits) and parser.calls_made == 2
    # Joined arguments that are not a JSON object are reported at the end
    # (unless the output was cut off: then they are as far as they got).
    for arguments, error in (('{"ci', "not valid JSON"), ("[1]", "not a JSON object")):
        parser = parser_for("relay", names=frozenset({"get_weather"}))
        parser.part(CallPart(0, arguments, "c", "get_weather"))
        assert error in (parser.flush().error or "")
        parser = parser_for("relay", names=frozenset({"get_weather"}))
        parser.part(CallPart(0, arguments, "c", "get_weather"))
        assert parser.flush(cut=True).error is None
    # A call without a name, or with one not in the tools, is refused.
    for name, error in (("", "names no function"), ("rm", "'rm', which is not")):
        parser = parser_for("relay", names=frozenset({"get_weather"}))
        split = parser.part(CallPart(0, "{}", "c", name))
        assert split.calls == () and error in (split.error or "")
        assert parser.feed("more") == ToolSplit()  # nothing more is read
    # Content with any model's syntax in it stays content: only parts are calls.
    parser = parser_for("relay", names=frozenset({"f"}))
    hermes = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parser.feed(hermes).content + parser.flush().content == hermes


async def test_a_relayed_calls_fragments_reach_the_client_as_they_arrive() -> None:
    """The upstream parks after its call's first argument fragment: that
    fragment reaches the client meanwhile (it is not gathered until the call
    ends), and the fragments join to the upstream's arguments."""
    async with FakeUpstream() as up, relay(up.url) as server:
        scripted(up)
        up.hold_calls_at = 2  # after '{"city": ', before '"Paris"}'
        async with wire(server) as client:
            await client.send(
                {"type": "generate", "id": "f", "messages": HISTORY, "tools": [WEATHER, TIME]}
            )

            def fragments() -> list[str]:
                return [
                    p["arguments"]
                    for f in client.frames
                    if f["type"] == "delta"
                    for p in f.get("tool_calls", ())
                    if p["index"] == 0 and p["arguments"]
                ]

            await client.until(lambda _: fragments() == ['{"city": '])
            assert up.calls_held.is_set()
            up.release_calls.set()
            _, frames = await client.done("f")
        assert fragments() == ['{"city": ', '"Paris"}']
        parts = [p for f in frames if f["type"] == "delta" for p in f.get("tool_calls", ())]
        joined = "".join(p["arguments"] for p in parts if p["index"] == 0)
        upstream = "".join(c[0]["function"]["arguments"] for c in CALLS if c[0]["index"] == 0)
        assert joined == upstream == '{"city": "Paris"}'
        assert frames[-1]["reason"] == "tool_calls"


async def test_websocket_gets_the_upstreams_reasoning_and_calls() -> None:
    async with FakeUpstream() as up, relay(up.url) as server:
        scripted(up)
        async with wire(server) as client:
            await client.send(
                {
                    "type": "generate",
                    "id": "t",
                    "messages": HISTORY,
                    "tools": [WEATHER, TIME],
                    "tool_choice": "required",
                    "parallel_tool_calls": True,
                }
            )
            text, frames = await client.done("t")
        deltas = [f for f in frames if f["type"] == "delta"]
        assert "".join(f.get("reasoning", "") for f in deltas) == "".join(REASONING)
        assert text == "".join(CONTENT)
        parts = [p for f in deltas for p in f.get("tool_calls", ())]
        assert [(p["index"], p.get("id"), p.get("name")) for p in parts if "name" in p] == [
            (0, "call_up_1", "get_weather"),
            (1, "call_up_2", "get_time"),
        ]
        # The fragments came as the upstream sent them.
        assert [p["arguments"] for p in parts if p["index"] == 0] == ["", '{"city": ', '"Paris"}']
        assert "".join(p["arguments"] for p in parts if p["index"] == 1) == "{}"
        assert frames[-1]["reason"] == "tool_calls"
        assert frames[-1]["usage"]["reasoning_tokens"] == len(REASONING)
        # What the upstream was asked: the tools, the choice and the history.
        body = up.streams[0].body
        assert body["tools"][0] == WEATHER
        assert [t["function"]["name"] for t in body["tools"]] == ["get_weather", "get_time"]
        assert (body["tool_choice"], body["parallel_tool_calls"]) == ("required", True)
        assert body["messages"][1]["tool_calls"] == HISTORY[1]["tool_calls"]
        assert body["messages"][1]["content"] is None
        assert body["messages"][2] == HISTORY[2]

        # A named function goes as OpenAI's object; "none" hides the tools.
        async with wire(server) as client:
            named = {"type": "function", "function": {"name": "get_time"}}
            await client.send(
                {
                    "type": "generate",
                    "id": "n",
                    "messages": HISTORY,
                    "tools": [WEATHER, TIME],
                    "tool_choice": named,
                    "parallel_tool_calls": False,
                }
            )
            await client.done("n")
            up.tool_call_deltas = []
            await client.send(
                {
                    "type": "generate",
                    "id": "o",
                    "messages": HISTORY,
                    "tools": [WEATHER],
                    "tool_choice": "none",
                }
            )
            text, frames = await client.done("o")
        assert up.streams[1].body["tool_choice"] == named
        assert up.streams[1].body["parallel_tool_calls"] is False
        assert "tools" not in up.streams[2].body and "tool_choice" not in up.streams[2].body
        assert frames[-1]["reason"] == "stop"


async def test_the_openai_api_gets_them_unchanged_in_meaning() -> None:
    async with FakeUpstream() as up, relay(up.url) as server:
        scripted(up, key="reasoning")  # vLLM's and Ollama's name
        client = openai.AsyncOpenAI(
            base_url=base_url(server), api_key="x", max_retries=0, timeout=timeout(30)
        )
        try:
            common: Any = dict(model=up.model, messages=HISTORY, tools=[WEATHER, TIME])
            whole = await client.chat.completions.create(**common)
            message = whole.choices[0].message
            assert whole.choices[0].finish_reason == "tool_calls"
            assert getattr(message, "reasoning_content", None) == "".join(REASONING)
            assert message.content == "".join(CONTENT)
            assert message.tool_calls is not None
            assert [
                (c.id, c.function.name, json.loads(c.function.arguments))
                for c in message.tool_calls
            ] == [
                ("call_up_1", "get_weather", {"city": "Paris"}),
                ("call_up_2", "get_time", {}),
            ]
            fragments: list[str] = []
            async with client.chat.completions.stream(**common) as stream:
                async for event in stream:
                    if event.type == "tool_calls.function.arguments.delta" and event.index == 0:
                        fragments.append(event.arguments_delta)
                streamed = await stream.get_final_completion()
            # The upstream's fragments, as it sent them (not gathered into one).
            assert [f for f in fragments if f] == ['{"city": ', '"Paris"}']
            calls = streamed.choices[0].message.tool_calls
            assert calls is not None
            assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
                (c.id, c.function.name, c.function.arguments) for c in message.tool_calls
            ]
            assert streamed.choices[0].finish_reason == "tool_calls"

            # reasoning_format "none": the think block stays in the answer, as
            # llama-server's "none" shows it.
            up.tool_call_deltas = []
            plain = await client.chat.completions.create(
                model=up.model, messages=HISTORY, extra_body={"reasoning_format": "none"}
            )
            assert plain.choices[0].message.content == (
                "<think>" + "".join(REASONING) + "</think>" + "".join(CONTENT)
            )
        finally:
            await client.close()


async def test_an_upstream_call_that_is_not_json_is_reported() -> None:
    async with FakeUpstream() as up, relay(up.url) as server:
        up.pieces = []
        up.tool_call_deltas = [
            [{"index": 0, "id": "c", "function": {"name": "get_weather", "arguments": '{"ci'}}]
        ]
        async with wire(server) as client:
            await client.send(
                {"type": "generate", "id": "b", "messages": HISTORY, "tools": [WEATHER]}
            )
            _, frames = await client.done("b")
        # Its parts went as they came; at its end the request says the call is
        # not JSON, rather than letting it pass as a call.
        assert frames[-1]["reason"] == "error"
        assert frames[-1]["error"]["code"] == "invalid_tool_call"
        assert "not valid JSON" in frames[-1]["error"]["message"]
        parts = [p for f in frames if f["type"] == "delta" for p in f.get("tool_calls", ())]
        assert "".join(p["arguments"] for p in parts) == '{"ci'
