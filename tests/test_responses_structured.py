"""Structured output on the Responses API (``text.format``), on the real
llama.cpp engine (the tiny GGUF: gibberish, so whatever parses is the
grammar's doing), through the official ``openai`` SDK — over HTTP, streamed
and not, with ``responses.parse``, and in WebSocket mode."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import pytest

pytest.importorskip("llama_cpp")

import openai
import pydantic
from conftest import make_config, running_server
from test_openai_http import sdk

pytestmark = pytest.mark.llama

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["n", "ok", "tag"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "name": "item", "schema": SCHEMA, "strict": True}


class Item(pydantic.BaseModel):
    n: int
    ok: bool
    tag: Literal["red", "green", "blue"]


@pytest.fixture
async def client(tiny_gguf: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_threads=1,
        backend__llama__parallel=2,
    )
    async with running_server(config) as server, sdk(server) as client:
        yield client


async def test_json_schema_output_validates_streamed_and_not_and_is_echoed(
    client: openai.AsyncOpenAI,
) -> None:
    for _ in range(3):
        response = await client.responses.create(
            model="tiny", input="An item:", text={"format": FORMAT}, max_output_tokens=120
        )
        assert response.status == "completed", response
        jsonschema.validate(json.loads(response.output_text), SCHEMA)
        assert response.text is not None and response.text.format is not None
        assert response.text.format.type == "json_schema"
        deltas: list[str] = []
        stream = await client.responses.create(
            model="tiny",
            input="An item:",
            text={"format": FORMAT},
            max_output_tokens=120,
            stream=True,
        )
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                final = event.response
        # How many deltas depends on the pace (a fast model's tokens merge
        # while the sender is busy): what counts is that they add up.
        assert deltas
        jsonschema.validate(json.loads("".join(deltas)), SCHEMA)
        assert final.output_text == "".join(deltas)


async def test_responses_parse_gives_the_pydantic_object_and_json_object_gives_an_object(
    client: openai.AsyncOpenAI,
) -> None:
    parsed = await client.responses.parse(
        model="tiny", input="An item:", text_format=Item, max_output_tokens=120
    )
    assert isinstance(parsed.output_parsed, Item)
    response = await client.responses.create(
        model="tiny",
        input="Anything:",
        text={"format": {"type": "json_object"}},
        max_output_tokens=200,
    )
    if response.status == "completed":  # an open object may run past the limit
        assert isinstance(json.loads(response.output_text), dict)
    else:
        assert response.output_text.startswith("{")


async def test_websocket_mode_honours_text_format(client: openai.AsyncOpenAI) -> None:
    async with client.responses.connect(max_retries=0) as socket:
        await socket.send(
            {
                "type": "response.create",
                "input": "An item:",
                "text": {"format": FORMAT},
                "max_output_tokens": 120,
            }
        )
        async for event in socket:
            if event.type == "response.completed":
                jsonschema.validate(json.loads(event.response.output_text), SCHEMA)
                break
            assert event.type != "error", event


@pytest.mark.parametrize(
    ("text", "param"),
    [
        ({"format": {"type": "json_schema", "schema": SCHEMA}}, "text.format.name"),
        ({"format": {"type": "json_schema", "name": "x", "schema": []}}, "text.format.schema"),
        ({"format": {"type": "yaml"}}, "text.format.type"),
        ({"verbosity": "low"}, "text.verbosity"),
        (
            {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}},
            "text.format",
        ),
    ],
)
async def test_a_format_that_cannot_be_honoured_is_a_400_naming_it(
    client: openai.AsyncOpenAI, text: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="tiny", input="x", text=text)  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    assert param in (body.get("param") or "") + body.get("message", ""), body


async def test_a_forced_function_call_on_the_responses_api_validates(tmp_path: Path) -> None:
    # tool_choice "required" and a named function map onto the core's forced
    # call: a tiny model with a Hermes template is held to a valid call.
    from test_llama_template import HERMES
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "hermes.gguf", chat_template=HERMES)
    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tools: list[Any] = [
        {"type": "function", "name": "get_weather", "parameters": parameters},
        {
            "type": "function",
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    ]
    config = make_config(
        backend__kind="llama", backend__llama__model=str(path), backend__llama__n_threads=1
    )
    async with running_server(config) as server, sdk(server) as client:
        for choice in ("required", {"type": "function", "name": "get_weather"}):
            response = await client.responses.create(
                model="hermes",
                input="Weather in Paris?",
                tools=tools,
                tool_choice=choice,  # type: ignore[arg-type]
                # Room for the longest call the schemas allow.
                max_output_tokens=200,
            )
            calls = [item for item in response.output if item.type == "function_call"]
            assert len(calls) == 1, response.output
            call = calls[0]
            if choice != "required":
                assert call.name == "get_weather"
            if call.name == "get_weather":
                jsonschema.validate(json.loads(call.arguments), parameters)
            else:
                assert json.loads(call.arguments) == {}
