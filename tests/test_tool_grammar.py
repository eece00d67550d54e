"""Forced tool calls in each call syntax, end to end on tiny random GGUFs
carrying their own chat templates (wsserver/backends/llama_tool_grammar.py).

A random model writes gibberish; held to the forced call's grammar it must
still write a call that the core's parser reads in the template's syntax —
Hermes ``<tool_call>``, Llama 3 JSON, and for a template that shows no tools
the generic JSON format with the tools described in a system message — for
every seed, with arguments that validate against the tool's schema. The
prompt is the template's own rendering (of the conversation with the tools,
or with the server's system note); tool messages are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

pytest.importorskip("llama_cpp")

from conftest import running_server, timeout, wire
from test_llama_backend import llama_config, loaded, request
from test_llama_template import (
    CONVERSATION,
    HERMES,
    LLAMA3,
    WEATHER,
    frame,
    reference_prompt,
)
from test_openai_http import sdk
from tiny_gguf import write_tiny_gguf

from wsserver.backends.llama_chat import generic_tools_note
from wsserver.backends.llama_tool_grammar import forced_call_grammar
from wsserver.errors import BackendError

pytestmark = pytest.mark.llama

#: A template that knows no tools (it renders the same with or without them).
PLAIN = """{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>
{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"""

#: A Mistral-style template: the tools in [AVAILABLE_TOOLS], calls after [TOOL_CALLS].
MISTRAL = """{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]
{%- endif %}{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}
{%- else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"""

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer"},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]
ASK: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]


def tiny(tmp_path: Path, template: str) -> Path:
    return write_tiny_gguf(tmp_path / "tools.gguf", chat_template=template)


def test_bad_tools_are_refused_by_name() -> None:
    unknown = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(BackendError, match="'tools'") as caught:
        forced_call_grammar("generic", json.dumps(unknown), name=None, parallel=False)
    assert caught.value.code == "bad_request"
    ranged = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"n": {"minimum": 1}}},
            },
        }
    ]
    with pytest.raises(BackendError, match="'minimum'") as caught:
        forced_call_grammar("hermes", json.dumps(ranged), name=None, parallel=False)
    assert caught.value.code == "unsupported_option"


def test_a_schema_with_local_refs_compiles(tmp_path: Path) -> None:
    referring = {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/place"}},
        "required": ["place"],
        "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": referring}}]
    gbnf = forced_call_grammar("generic", json.dumps(tools), name=None, parallel=True)
    with loaded(tiny(tmp_path, PLAIN)) as backend:
        assert backend.engine is not None
        assert backend.engine.grammars.compile(grammar=gbnf, json_schema=None)


def test_a_template_without_tools_gets_the_servers_note(tmp_path: Path) -> None:
    """The prompt is the template's own rendering of the conversation with the
    server's system note in front (merged into a system message if any)."""
    generate = frame(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    note = generic_tools_note(generate.tools or "", parallel=False)
    assert '"tool_call"' in note and "get_weather" in note
    with loaded(tiny(tmp_path, PLAIN)) as backend:
        req = request(
            None,
            messages=generate.messages,
            tools=generate.tools,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        expected = reference_prompt(PLAIN, [{"role": "system", "content": note}, *ASK])
        assert backend.tokenize_prompt(req) == backend.vocab.tokenize(expected, add_bos=False)
        assert backend.output_format(req).tool_syntax == "generic"
        with_system = [{"role": "system", "content": "Be brief."}, *ASK]
        generate = frame(messages=with_system, tools=TOOLS, tool_choice="required")
        req = request(
            None, messages=generate.messages, tools=generate.tools, tool_choice="required"
        )
        note = generic_tools_note(generate.tools or "", parallel=None)
        merged = reference_prompt(
            PLAIN, [{"role": "system", "content": f"Be brief.\n\n{note}"}, *ASK]
        )
        assert backend.tokenize_prompt(req) == backend.vocab.tokenize(merged, add_bos=False)


@pytest.mark.parametrize(
    ("template", "syntax"),
    [
        (HERMES, "hermes"),
        # Llama 3.1's own template names the ipython role: that is how it is told.
        (LLAMA3.replace("Tools: ", "Tools (ipython): "), "llama3"),
        (MISTRAL, "mistral"),
        (PLAIN, "generic"),
    ],
    ids=["hermes", "llama3", "mistral", "generic"],
)
async def test_every_seed_makes_a_valid_forced_call(
    tmp_path: Path, template: str, syntax: str
) -> None:
    path = tiny(tmp_path, template)
    async with running_server(llama_config(path)) as server:
        assert (
            server.backend.output_format(
                request(
                    None,
                    messages=frame(messages=ASK).messages,
                    tools=json.dumps(TOOLS),
                    tool_choice="required",
                )
            ).tool_syntax
            == syntax
        )
        async with wire(server) as ws:
            for seed in range(6):
                named = seed % 2 == 0
                choice: Any = (
                    {"type": "function", "function": {"name": "get_weather"}}
                    if named
                    else "required"
                )
                await ws.send(
                    {
                        "type": "generate",
                        "id": f"s{seed}",
                        "messages": ASK,
                        "tools": TOOLS,
                        "tool_choice": choice,
                        "parallel_tool_calls": False,
                        "max_tokens": 120,
                        "temperature": 1.0,
                        "seed": seed,
                    }
                )
                text, frames = await ws.done(f"s{seed}", units=60)
                assert frames[-1]["reason"] == "tool_calls", (seed, frames[-1], text)
                assert text == ""
                parts = [p for f in frames if f["type"] == "delta" for p in f.get("tool_calls", ())]
                assert {p["index"] for p in parts} == {0}
                name = parts[0]["name"]
                arguments = json.loads("".join(p["arguments"] for p in parts))
                if named or name == "get_weather":
                    assert name == "get_weather"
                    jsonschema.Draft202012Validator(SCHEMA).validate(arguments)
                else:
                    assert (name, arguments) == ("get_time", {})

        # A tool conversation goes on through the OpenAI API: the call and
        # its result are accepted and answered.
        async with sdk(server) as client:
            answer = await client.with_options(timeout=timeout(60)).chat.completions.create(
                model="tools",
                messages=CONVERSATION,
                tools=[WEATHER, *TOOLS[1:]],
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                # A random model would go on calling as long as the grammar lets it.
                parallel_tool_calls=False,
                max_tokens=80,
                seed=1,
            )
            assert answer.choices[0].finish_reason == "tool_calls"
            calls = answer.choices[0].message.tool_calls
            assert calls and all(c.function.name == "get_time" for c in calls)
            assert all(json.loads(c.function.arguments) == {} for c in calls)
