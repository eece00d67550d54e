"""The Responses API's WebSocket mode on the real llama.cpp engine (the tiny
GGUF): ``response.cancel`` mid-prefill frees the model at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

import openai
from conftest import make_config, running_server, timeout

from wsserver.backends.llama import LlamaBackend

pytestmark = pytest.mark.llama

#: ~7,000 prompt tokens: about a second of prefill for the tiny model.
LONG_PROMPT = "hello world " * 3500


async def test_response_cancel_mid_prefill_frees_the_model(tiny_gguf: Path) -> None:
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_threads=1,
        backend__llama__n_ctx=8192,
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
            async with client.responses.connect(max_retries=0) as socket:
                await socket.send(
                    {"type": "response.create", "input": LONG_PROMPT, "max_output_tokens": 50}
                )
                async with asyncio.timeout(timeout(10)):
                    created = await socket.recv()
                    assert created.type == "response.created"
                    long_id = created.response.id
                    assert await prefills.get() == long_id
                await socket.send({"type": "response.cancel", "response_id": long_id})
                async with asyncio.timeout(timeout(10)):
                    async for event in socket:
                        if event.type == "response.incomplete":
                            break
                # The next response gets the model as soon as the abort lands.
                await socket.send(
                    {"type": "response.create", "input": "Hello", "max_output_tokens": 3}
                )
                async with asyncio.timeout(timeout(30)):
                    async for event in socket:
                        if event.type in ("response.completed", "response.incomplete"):
                            break
                assert event.response.usage is not None
        finally:
            await client.close()
            backend.on_prefill = None
        stats = backend.request_stats(long_id)
        assert stats is not None and stats.decoded < stats.prompt_tokens, stats


async def test_function_items_reach_the_models_tools_template(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The Responses items of a call and its output are the prompt the GGUF's
    own tools template renders for OpenAI's chat shape (the Hermes/Qwen one of
    test_llama_template), on the real engine; a next turn via
    ``previous_response_id`` keeps them."""
    from test_llama_template import CONVERSATION, HERMES, WEATHER, reference_prompt
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path_factory.mktemp("hermes") / "hermes.gguf", chat_template=HERMES)
    weather = {"type": "function", **WEATHER["function"]}  # the Responses shape
    items: list[dict[str, object]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
    ]
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(path),
        backend__llama__n_threads=1,
        limits__max_tokens=8000,
    )
    async with running_server(config) as server:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        expected = reference_prompt(HERMES, CONVERSATION, tools=[WEATHER])
        prompt_tokens = len(backend.vocab.tokenize(expected, add_bos=False))
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            whole = await client.responses.create(
                model="hermes",
                instructions="You are terse.",
                tools=[weather],  # type: ignore[list-item]
                input=items,  # type: ignore[arg-type]
                max_output_tokens=2,
            )
            assert whole.usage is not None
            assert whole.usage.input_tokens == prompt_tokens
            # A next turn continues it: the call and its output kept in the chain.
            chained = await client.responses.create(
                model="hermes",
                instructions="You are terse.",
                tools=[weather],  # type: ignore[list-item]
                input="Thanks",
                previous_response_id=whole.id,
                max_output_tokens=2,
            )
        finally:
            await client.close()
        later = [
            *CONVERSATION,
            {"role": "assistant", "content": whole.output_text},
            {"role": "user", "content": "Thanks"},
        ]
        expected_chained = reference_prompt(HERMES, later, tools=[WEATHER])
        assert chained.usage is not None
        assert chained.usage.input_tokens == len(
            backend.vocab.tokenize(expected_chained, add_bos=False)
        )


async def test_a_think_block_the_template_opens_is_a_reasoning_item(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A template whose generation prompt opens ``<think>`` (test_llama_template's):
    everything the tiny model writes is reasoning, so the response is one
    ``reasoning`` item, streamed as ``response.reasoning_text.delta``, and all
    its output tokens are reasoning tokens."""
    from test_llama_template import THINKING
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(
        tmp_path_factory.mktemp("think") / "thinking.gguf", chat_template=THINKING
    )
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(path),
        backend__llama__n_threads=1,
        limits__max_tokens=8000,
    )
    async with running_server(config) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            stream = await client.responses.create(
                model="thinking", input="Hello", max_output_tokens=6, temperature=0, stream=True
            )
            events = [event async for event in stream]
        finally:
            await client.close()
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert final.status == "incomplete"
    assert [item.type for item in final.output] == ["reasoning"]
    (item,) = final.output
    assert item.status == "incomplete" and item.content[0].text == thought != ""
    assert final.output_text == ""
    assert final.usage.output_tokens_details.reasoning_tokens == final.usage.output_tokens == 6
