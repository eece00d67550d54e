"""``cached_tokens``: what the engine's prefix cache saved, in ``done.usage`` and
OpenAI's ``usage.prompt_tokens_details`` — from the llama engine (tiny GGUF),
and passed through by the relay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import running_server, timeout, validate_server_frame, wire
from fake_upstream import FakeUpstream
from test_openai_backend import gen, relay

from wsserver.core.protocol import Done, Timings, Usage, parse_server_frame, serialize


def test_done_usage_carries_cached_tokens_and_reads_older_frames() -> None:
    done = Done("a", "stop", Usage(10, 2, cached_tokens=7), Timings(0.0, None, 1.0, 0.0))
    wire_text = serialize(done).decode()
    assert validate_server_frame(wire_text)["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "cached_tokens": 7,
    }
    assert parse_server_frame(wire_text) == done
    # A server before it: no member, read as 0; a later one's extra members are dropped.
    older = wire_text.replace(',"cached_tokens":7', "")
    assert parse_server_frame(older).usage == Usage(10, 2, cached_tokens=0)  # type: ignore[union-attr]
    newer = wire_text.replace('"cached_tokens":7', '"cached_tokens":7,"other":1')
    assert parse_server_frame(newer).usage == Usage(10, 2, cached_tokens=7)  # type: ignore[union-attr]


async def test_the_fake_engine_caches_nothing() -> None:
    async with running_server(backend__fake__tokens_per_s=0) as server, wire(server) as ws:
        await ws.send({"type": "generate", "id": "a", "prompt": "x", "max_tokens": 3})
        _, frames = await ws.done("a")
    assert frames[-1]["usage"]["cached_tokens"] == 0


async def test_the_relay_passes_the_upstreams_cached_tokens_through() -> None:
    async with FakeUpstream() as up, relay(up.url) as server, wire(server) as client:
        up.cached_tokens = 5
        await client.send(gen("a"))
        _, frames = await client.done("a")
        assert frames[-1]["usage"]["cached_tokens"] == 5
        # llama-server without a usage detail: its timings' cache_n.
        up.cached_tokens = None
        up.timings = {"cache_n": 3, "prompt_n": 4}
        await client.send(gen("b"))
        _, frames = await client.done("b")
        assert frames[-1]["usage"]["cached_tokens"] == 3


@pytest.mark.llama
async def test_a_second_request_sharing_a_prefix_reports_its_cached_tokens(
    tiny_gguf: Path,
) -> None:
    pytest.importorskip("llama_cpp")
    from test_llama_sampling import llama_config

    prompt = "Once upon a time there was a small model that streamed tokens"
    async with running_server(llama_config(tiny_gguf)) as server:
        backend: Any = server.backend
        async with wire(server) as ws:
            base = {"type": "generate", "max_tokens": 4, "temperature": 0}
            await ws.send({**base, "id": "first", "prompt": prompt})
            _, first = await ws.done("first", units=30)
            await ws.send({**base, "id": "second", "prompt": prompt + " to every client"})
            _, second = await ws.done("second", units=30)
        assert first[-1]["usage"]["cached_tokens"] == 0
        cached = second[-1]["usage"]["cached_tokens"]
        assert cached == backend.request_stats("second").reused
        assert 0 < cached < second[-1]["usage"]["prompt_tokens"]
        # The first request's prompt, all but its last token (whose logits start the completion).
        assert cached >= first[-1]["usage"]["prompt_tokens"] - 1

        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0}
            again = await client.completions.create(prompt=prompt + " to every client", **kwargs)
            assert again.usage is not None and again.usage.prompt_tokens_details is not None
            assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
            streamed = await client.completions.create(
                prompt=prompt + " to every",
                stream=True,
                stream_options={"include_usage": True},
                **kwargs,
            )
            usage = None
            async for chunk in streamed:
                usage = chunk.usage or usage
            assert usage is not None and usage.prompt_tokens_details is not None
            assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        finally:
            await client.close()
