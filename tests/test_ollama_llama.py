"""Ollama's API on the real llama.cpp engine (the tiny GGUF), with the official
``ollama`` client: streamed and whole agree and count what the engine counts;
a raw prompt is the completion's; a client that abandons a long prompt
mid-prefill frees the model at once; a prompt beyond the context is a 400."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

import aiohttp
import ollama
from conftest import TINY_MODEL, make_config, running_server, timeout, wire

from wsserver.backends.llama import LlamaBackend

pytestmark = pytest.mark.llama

#: ~7,000 prompt tokens: about a second of prefill for the tiny model.
LONG_PROMPT = "hello world " * 3500
GREEDY: dict[str, Any] = {"temperature": 0, "top_k": 1, "num_predict": 8}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello there"}]


def tiny(path: Path, **settings: Any) -> Any:
    return make_config(
        backend__kind="llama",
        backend__llama__model=str(path),
        backend__llama__n_threads=1,
        backend__llama__parallel=1,
        **settings,
    )


async def test_chat_and_generate_on_the_tiny_model(tiny_gguf: Path) -> None:
    async with running_server(tiny(tiny_gguf)) as server:
        async with wire(server) as ws:
            await ws.send(
                {
                    "type": "generate",
                    "id": "w",
                    "messages": CHAT,
                    "max_tokens": 8,
                    "temperature": 0,
                    "top_k": 1,
                }
            )
            expected, frames = await ws.done("w")
            await ws.send(
                {
                    "type": "generate",
                    "id": "r",
                    "prompt": "Hello",
                    "max_tokens": 8,
                    "temperature": 0,
                    "top_k": 1,
                }
            )
            raw_expected, _ = await ws.done("r")
        usage = frames[-1]["usage"]
        async with ollama.AsyncClient(
            host=f"http://127.0.0.1:{server.port}", timeout=timeout(60)
        ) as c:
            whole = await c.chat(model=TINY_MODEL, messages=CHAT, options=GREEDY)
            parts = [
                p
                async for p in await c.chat(
                    model=TINY_MODEL, messages=CHAT, options=GREEDY, stream=True
                )
            ]
            raw = await c.generate(model=TINY_MODEL, prompt="Hello", raw=True, options=GREEDY)
            templated = await c.generate(
                model=TINY_MODEL, prompt="Hello there", system="be brief", options=GREEDY
            )
        assert whole.message.content == expected == "".join(p.message.content or "" for p in parts)
        assert templated.response == expected
        assert raw.response == raw_expected
        last = parts[-1]
        assert whole.prompt_eval_count == last.prompt_eval_count == usage["prompt_tokens"]
        assert whole.eval_count == usage["completion_tokens"]
        assert whole.done_reason in ("stop", "length")
        for answer in (whole, last, raw):
            assert (
                answer.total_duration
                and answer.prompt_eval_duration
                and answer.eval_duration is not None
            )
            parts_sum = answer.load_duration + answer.prompt_eval_duration + answer.eval_duration
            # timing-ok: arithmetic, not speed — three parts of one measured whole, each
            # rounded to a nanosecond, add up to it within 3 ns on any machine.
            assert abs(parts_sum - answer.total_duration) <= 3  # timing-ok: ns rounding


async def test_abandoning_a_long_prompt_mid_prefill_frees_the_model_at_once(
    tiny_gguf: Path,
) -> None:
    config = tiny(tiny_gguf, backend__llama__n_ctx=8192, limits__max_tokens=8000)
    async with running_server(config) as server:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        loop = asyncio.get_running_loop()
        prefills: asyncio.Queue[str] = asyncio.Queue()
        backend.on_prefill = lambda request_id, n: loop.call_soon_threadsafe(
            prefills.put_nowait, request_id
        )
        url = f"http://127.0.0.1:{server.port}/api/generate"
        body = {
            "model": TINY_MODEL,
            "prompt": LONG_PROMPT,
            "raw": True,
            "options": {"num_predict": 50},
        }
        try:
            async with aiohttp.ClientSession() as session:
                # The head comes when the request gets the model, before its prefill.
                async with session.post(
                    url, json=body, headers={"X-Request-ID": "long"}
                ) as response:
                    assert response.status == 200
                    async with asyncio.timeout(timeout(10)):
                        assert await prefills.get() == "long"
            # The connection is closed: the next request gets the model as soon as the abort lands.
            async with ollama.AsyncClient(
                host=f"http://127.0.0.1:{server.port}", timeout=timeout(60)
            ) as c:
                reply = await c.generate(model=TINY_MODEL, prompt="Hello", raw=True, options=GREEDY)
            assert reply.done_reason in ("stop", "length")
        finally:
            backend.on_prefill = None
        # The prefill itself was cut short, not waited out.
        stats = backend.request_stats("long")
        assert stats is not None and stats.decoded < stats.prompt_tokens, stats
        cancelled = server.metrics.registry.get_sample_value(
            "wsserver_requests_total", {"reason": "cancelled"}
        )
        assert cancelled == 1


async def test_a_prompt_beyond_the_context_is_a_400_in_ollamas_shape(tiny_gguf: Path) -> None:
    async with running_server(tiny(tiny_gguf, backend__llama__n_ctx=64)) as server:
        async with ollama.AsyncClient(
            host=f"http://127.0.0.1:{server.port}", timeout=timeout(60)
        ) as c:
            for stream in (False, True):
                with pytest.raises(ollama.ResponseError) as raised:
                    answer = await c.chat(
                        model=TINY_MODEL,
                        messages=[{"role": "user", "content": "hello world " * 40}],
                        options={"num_predict": 5},
                        stream=stream,
                    )
                    if stream:
                        [p async for p in answer]  # type: ignore[union-attr]
                assert raised.value.status_code == 400
                assert "the context holds 64 tokens" in raised.value.error
            reply = await c.generate(model=TINY_MODEL, prompt="Hi", raw=True, options=GREEDY)
        assert reply.done is True


async def test_a_pydantic_format_with_bounds_holds_on_the_tiny_model(tiny_gguf: Path) -> None:
    """pydantic writes ``minimum``/``maximum`` for ``Field(ge=…, le=…)``: the
    llama engine enforces an integer's (they were refused before)."""
    import jsonschema
    import pydantic

    class Dice(pydantic.BaseModel):
        first: int = pydantic.Field(ge=1, le=6)
        second: int = pydantic.Field(gt=-3, lt=40)

    schema = Dice.model_json_schema()
    assert schema["properties"]["first"]["minimum"] == 1
    async with running_server(tiny(tiny_gguf)) as server:
        async with ollama.AsyncClient(
            host=f"http://127.0.0.1:{server.port}", timeout=timeout(60)
        ) as c:
            for seed in range(3):
                reply = await c.chat(
                    model=TINY_MODEL,
                    messages=[{"role": "user", "content": "Roll two dice."}],
                    format=schema,
                    options={"seed": seed, "temperature": 1.0, "num_predict": 200},
                )
                assert reply.done_reason == "stop", reply
                answer = json.loads(reply.message.content or "")
                jsonschema.validate(answer, schema)
                Dice.model_validate(answer)
