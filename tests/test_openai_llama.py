"""The OpenAI API on the real llama.cpp engine (the tiny GGUF): a client that
abandons a long prompt mid-prefill frees the model at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

import openai
from conftest import make_config, running_server, timeout, wire

from wsserver.backends.llama import LlamaBackend

pytestmark = pytest.mark.llama

#: ~7,000 prompt tokens: about a second of prefill for the tiny model.
LONG_PROMPT = "hello world " * 3500


async def test_abandoning_a_long_prompt_mid_prefill_frees_the_model_at_once(
    tiny_gguf: Path,
) -> None:
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_threads=1,
        backend__llama__n_ctx=8192,
        # One sequence: the next request can only run once the abandoned one is gone.
        backend__llama__parallel=1,
        limits__max_tokens=8000,
    )
    async with running_server(config) as server:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        loop = asyncio.get_running_loop()
        prefills: asyncio.Queue[str] = asyncio.Queue()
        backend.on_prefill = lambda request_id, n: loop.call_soon_threadsafe(
            prefills.put_nowait, request_id
        )
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            # The headers come when the request gets the model, before its
            # prefill: create() returns and the client can walk away.
            stream = await client.completions.create(
                model="tiny",
                prompt=LONG_PROMPT,
                max_tokens=50,
                stream=True,
                extra_headers={"X-Request-ID": "long"},
            )
            async with asyncio.timeout(timeout(10)):
                assert await prefills.get() == "long"
            await stream.close()
            # The next request gets the model as soon as the abort lands.
            reply = await client.completions.create(
                model="tiny", prompt="Hello", max_tokens=3, temperature=0
            )
            assert reply.choices[0].finish_reason == "length"
        finally:
            await client.close()
            backend.on_prefill = None
        # The prefill itself was cut short, not waited out: the engine decoded
        # only part of the prompt for it.
        stats = backend.request_stats("long")
        assert stats is not None and stats.decoded < stats.prompt_tokens, stats
        cancelled = server.metrics.registry.get_sample_value(
            "wsserver_requests_total", {"reason": "cancelled"}
        )
        assert cancelled == 1


async def test_a_prompt_beyond_the_context_is_a_400_before_any_head(tiny_gguf: Path) -> None:
    """Hardening III: it was a 413, and with ``stream`` a 200 then an error event."""
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_threads=1,
        backend__llama__n_ctx=64,
    )
    async with running_server(config) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as raised:
                    await client.chat.completions.create(
                        model="tiny",
                        messages=[{"role": "user", "content": "hello world " * 40}],
                        max_tokens=5,
                        stream=stream,
                    )
                error = raised.value
                assert error.status_code == 400 and error.code == "context_length_exceeded"
                assert "the context holds 64 tokens" in error.message
            # One that fits is served as before.
            reply = await client.completions.create(
                model="tiny", prompt="Hello", max_tokens=3, temperature=0
            )
            assert reply.choices[0].finish_reason == "length"
        finally:
            await client.close()
        # The WebSocket protocol keeps its code, as a refusal before anything started.
        async with wire(server) as ws:
            await ws.send(
                {"type": "generate", "id": "big", "prompt": "hello world " * 40, "max_tokens": 5}
            )
            (refused,) = await ws.until(lambda f: f["type"] in ("error", "started"))
            assert refused["type"] == "error" and refused["code"] == "too_large"
