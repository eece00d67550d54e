"""The Responses API over HTTP end to end: a real server, the official ``openai``
SDK as the client (``client.responses``), sync and async, streamed and not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from conftest import FAKE_MODEL, running_server, timeout, wire
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseCreatedEvent,
    ResponseTextDeltaEvent,
)

from wsserver.aio import Server


def base_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}/v1"


@contextlib.asynccontextmanager
async def sdk(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=base_url(server), api_key="unused", max_retries=0, timeout=timeout(30)
    )
    try:
        yield client
    finally:
        await client.close()


def requests_ended(server: Server, reason: str) -> float:
    value = server.metrics.registry.get_sample_value("wsserver_requests_total", {"reason": reason})
    return value or 0.0


async def ws_text(server: Server, **fields: Any) -> str:
    async with wire(server) as client:
        await client.send({"type": "generate", "id": "w", **fields})
        text, _ = await client.done("w")
        return text


INPUT = [{"role": "user", "content": [{"type": "input_text", "text": "tell me"}]}]
SAME_AS_WS = {
    "messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "tell me"}]
}


async def test_async_create_whole_and_streamed_give_the_websocket_text() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, sdk(server) as client:
        expected = await ws_text(server, max_tokens=20, **SAME_AS_WS)
        whole = await client.responses.create(
            model=FAKE_MODEL,
            input=INPUT,
            instructions="be kind",
            max_output_tokens=20,
            metadata={"a": "b"},
        )
        assert whole.object == "response" and whole.model == "fake"
        assert whole.output_text == expected
        assert whole.status == "incomplete"
        assert whole.incomplete_details is not None
        assert whole.incomplete_details.reason == "max_output_tokens"
        assert whole.usage is not None and whole.usage.output_tokens == 20
        assert whole.metadata == {"a": "b"}
        stream = await client.responses.create(
            model=FAKE_MODEL, input=INPUT, instructions="be kind", max_output_tokens=20, stream=True
        )
        events = [event async for event in stream]
        assert isinstance(events[0], ResponseCreatedEvent)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)) == expected
        assert events[-1].type == "response.incomplete"


async def test_a_response_that_ends_by_itself_is_completed_last() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=0.0, backend__fake__echo=True) as server,
        sdk(server) as client,
    ):
        async with client.responses.stream(
            model=FAKE_MODEL, input="hi", max_output_tokens=50
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
        assert isinstance(events[-1], ResponseCompletedEvent)
        assert final.status == "completed" and final.output_text


async def test_sync_client_create_whole_and_streamed() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        client = openai.OpenAI(
            base_url=base_url(server), api_key="x", max_retries=0, timeout=timeout(30)
        )

        def ask() -> tuple[str, list[str]]:
            whole = client.responses.create(model=FAKE_MODEL, input="hi", max_output_tokens=6)
            with client.responses.create(
                model=FAKE_MODEL, input="hi", max_output_tokens=6, stream=True
            ) as stream:
                kinds = [event.type for event in stream]
            return whole.output_text, kinds

        try:
            text, kinds = await asyncio.wait_for(asyncio.to_thread(ask), timeout(30))
        finally:
            client.close()
        assert text
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.incomplete"


async def test_bad_input_is_a_clear_400_and_the_server_stays_usable() -> None:
    async with running_server() as server, sdk(server) as client:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"tools": [{"type": "web_search"}]}, "tools"),
            ({"reasoning": {"effort": "high"}}, "reasoning"),
            ({"text": {"verbosity": "low"}}, "text.verbosity"),
            ({"extra_body": {"nonsense": 1}}, "nonsense"),
            (
                {"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]},
                "no function_call before it",
            ),
        ]
        for extra, named in cases:
            kwargs: dict[str, Any] = {
                "model": FAKE_MODEL,
                "input": "hi",
                "max_output_tokens": 3,
                **extra,
            }
            with pytest.raises(openai.BadRequestError) as info:
                await client.responses.create(**kwargs)
            assert named in info.value.message, info.value.message
        with pytest.raises(openai.APIStatusError) as too_large:
            await client.responses.create(model=FAKE_MODEL, input="x" * 200_000)
        assert too_large.value.status_code == 413 and "'input'" in too_large.value.message
        ok = await client.responses.create(model=FAKE_MODEL, input="hi", max_output_tokens=3)
        assert ok.output_text


async def test_previous_response_id_continues_and_get_delete_find_it() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, sdk(server) as client:
        first = await client.responses.create(model=FAKE_MODEL, input="one", max_output_tokens=5)
        second = await client.responses.create(
            model=FAKE_MODEL, input="two", previous_response_id=first.id, max_output_tokens=5
        )
        # The second turn saw the whole conversation: the same as sending it all.
        expected = await ws_text(
            server,
            max_tokens=5,
            messages=[
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "two"},
            ],
        )
        assert second.output_text == expected
        assert second.previous_response_id == first.id
        got = await client.responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(
                model=FAKE_MODEL, input="x", previous_response_id=first.id
            )
        assert info.value.code == "previous_response_not_found"
        unstored = await client.responses.create(
            model=FAKE_MODEL, input="x", store=False, max_output_tokens=2
        )
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)


async def test_the_store_is_bounded_by_its_bytes() -> None:
    async with (
        running_server(
            backend__fake__tokens_per_s=0.0, limits__responses_store_bytes=4096
        ) as server,
        sdk(server) as client,
    ):
        ids = [
            (
                await client.responses.create(
                    model=FAKE_MODEL, input="x" * 500, max_output_tokens=5
                )
            ).id
            for _ in range(8)
        ]
        store = server.responses.store
        assert store.bytes <= 4096
        assert store.get(ids[-1], 0.0) is not None and store.get(ids[0], 0.0) is None


async def test_breaking_out_of_a_stream_cancels_it_and_frees_the_engine() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=20.0, backend__fake__parallel=1) as server,
        sdk(server) as client,
    ):
        stream = await client.responses.create(
            model=FAKE_MODEL, input="hi", max_output_tokens=100_000, stream=True
        )
        async for event in stream:
            if event.type == "response.output_text.delta":
                break
        await stream.close()
        # The next request gets the one slot: the abandoned one was cancelled.
        reply = await client.responses.create(model=FAKE_MODEL, input="hi", max_output_tokens=2)
        assert reply.status == "incomplete"
        assert requests_ended(server, "cancelled") == 1
        assert server.producer_threads() == 0
