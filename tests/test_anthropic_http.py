"""Anthropic's Messages API end to end: a real server, the official ``anthropic``
SDK as the client (``client.messages``), streamed and not, on the fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
from conftest import FAKE_MODEL, running_server, timeout, wire

from wsserver.aio import Server

USER = [{"role": "user", "content": "tell me"}]


@contextlib.asynccontextmanager
async def sdk(server: Server, **kwargs: Any) -> AsyncIterator[anthropic.AsyncAnthropic]:
    kwargs.setdefault("api_key", "unused")
    client = anthropic.AsyncAnthropic(
        base_url=f"http://127.0.0.1:{server.port}", max_retries=0, timeout=timeout(30), **kwargs
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


async def post(server: Server, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{server.port}{path}"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, headers=headers) as response:
            return response.status, json.loads(await response.read())


async def test_create_whole_and_streamed_give_the_websocket_text() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, sdk(server) as client:
        expected = await ws_text(
            server,
            max_tokens=20,
            messages=[{"role": "system", "content": "be kind"}, *USER],
        )
        system = [{"type": "text", "text": "be "}, {"type": "text", "text": "kind"}]
        whole = await client.messages.create(
            model=FAKE_MODEL,
            system=system,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": [{"type": "text", "text": "tell me"}]}],
            max_tokens=20,
            metadata={"user_id": "u1"},
            # Sampling fields older SDKs send (the current one has dropped them).
            extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 10},
        )
        assert whole.type == "message" and whole.role == "assistant" and whole.model == "fake"
        assert whole.id.startswith("msg_")
        assert [block.type for block in whole.content] == ["text"]
        assert whole.content[0].text == expected  # type: ignore[union-attr]
        assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
        assert whole.usage.output_tokens == 20 and whole.usage.input_tokens > 0
        async with client.messages.stream(
            model=FAKE_MODEL,
            system="be kind",
            messages=USER,
            max_tokens=20,  # type: ignore[arg-type]
        ) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_message()
        kinds = [event.type for event in events]
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert kinds[1] == "content_block_start" and kinds[-3:-1] == [
            "content_block_stop",
            "message_delta",
        ]
        deltas = [e.delta.text for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
        assert "".join(deltas) == expected
        assert final.content[0].text == expected  # type: ignore[union-attr]
        assert final.stop_reason == "max_tokens"
        assert final.usage.input_tokens == whole.usage.input_tokens
        assert final.usage.output_tokens == 20


async def test_raw_sse_has_anthropics_event_names_in_order() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        url = f"http://127.0.0.1:{server.port}/v1/messages"
        body = {"model": FAKE_MODEL, "messages": USER, "max_tokens": 3, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url, json=body, headers={"anthropic-version": "2023-06-01"}
            ) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                lines = (await r.read()).decode().splitlines()
        names = [line[len("event: ") :] for line in lines if line.startswith("event: ")]
        datas = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: ")]
        assert [d["type"] for d in datas] == names
        assert names[0] == "message_start" and names[1] == "content_block_start"
        assert set(names[2:-3]) == {"content_block_delta"}
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
        assert datas[-2]["usage"]["output_tokens"] == 3


async def test_a_stop_sequence_ends_the_message_and_is_named(tmp_path: Path) -> None:
    answer = tmp_path / "answer.txt"
    answer.write_text("one two. three four. five", encoding="utf-8")
    async with (
        running_server(
            backend__fake__tokens_per_s=0.0, backend__fake__text_file=str(answer)
        ) as server,
        sdk(server) as client,
    ):
        whole = await client.messages.create(
            model=FAKE_MODEL,
            messages=USER,
            max_tokens=50,
            stop_sequences=["zz", ". t"],  # type: ignore[arg-type]
        )
        assert whole.content[0].text == "one two"  # type: ignore[union-attr]
        assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == ". t"
        async with client.messages.stream(
            model=FAKE_MODEL,
            messages=USER,
            max_tokens=50,
            stop_sequences=[". t"],  # type: ignore[arg-type]
        ) as stream:
            final = await stream.get_final_message()
        assert final.stop_reason == "stop_sequence" and final.stop_sequence == ". t"
        ended = await client.messages.create(model=FAKE_MODEL, messages=USER, max_tokens=50)  # type: ignore[arg-type]
        assert ended.stop_reason == "end_turn" and ended.stop_sequence is None
        assert ended.content[0].text == "one two. three four. five"  # type: ignore[union-attr]


async def test_count_tokens_is_what_the_message_reports() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, sdk(server) as client:
        messages = [{"role": "user", "content": "count these words for me please"}]
        counted = await client.messages.count_tokens(
            model=FAKE_MODEL,
            system="be brief",
            messages=messages,  # type: ignore[arg-type]
        )
        reply = await client.messages.create(
            model=FAKE_MODEL,
            system="be brief",
            messages=messages,
            max_tokens=2,  # type: ignore[arg-type]
        )
        assert counted.input_tokens == reply.usage.input_tokens > 0
        # A stream says it from its first event on, as Anthropic clients show it.
        async with client.messages.stream(
            model=FAKE_MODEL,
            system="be brief",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=2,
        ) as stream:
            first = await anext(aiter(stream))
        assert first.type == "message_start"
        assert first.message.usage.input_tokens == counted.input_tokens
        with pytest.raises(anthropic.BadRequestError, match=r"tools\.0\.input_schema\.type"):
            await client.messages.count_tokens(
                model=FAKE_MODEL,
                messages=messages,  # type: ignore[arg-type]
                tools=[{"name": "f", "input_schema": {"type": "string"}}],
            )


async def test_bad_input_is_a_clear_400_naming_the_field() -> None:
    async with running_server() as server, sdk(server) as client:
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": "x"},
        }
        cases: list[tuple[dict[str, Any], str]] = [
            ({"max_tokens": None}, "max_tokens"),
            (
                {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
                "tools.0.input_schema.type: must be 'object'",
            ),
            ({"tool_choice": {"type": "any"}}, "tool_choice: 'any' needs tools"),
            (
                {"thinking": {"type": "enabled", "budget_tokens": 1024}},
                "thinking.budget_tokens: must be less than max_tokens",
            ),
            ({"extra_body": {"temperature": 1.5}}, "temperature"),
            ({"speed": "fast"}, "speed"),
            ({"stop_sequences": [""]}, "stop_sequences"),
            (
                {"messages": [{"role": "user", "content": [image]}]},
                "image 0 (messages.0.content.0.source): not valid base64",
            ),
            (
                {
                    "messages": [
                        {"role": "user", "content": "a"},
                        {"role": "assistant", "content": "b"},
                    ]
                },
                "prefill",
            ),
            ({"messages": [{"role": "system", "content": "a"}]}, "messages.0.role"),
            (
                {"extra_body": {"mcp_servers": [{"type": "url", "url": "u", "name": "x"}]}},
                "mcp_servers",
            ),
            ({"extra_body": {"nonsense": 1}}, "nonsense"),
        ]
        for extra, named in cases:
            kwargs: dict[str, Any] = {
                "model": FAKE_MODEL,
                "messages": USER,
                "max_tokens": 3,
                **extra,
            }
            if kwargs["max_tokens"] is None:
                del kwargs["max_tokens"]
                status, body = await post(server, "/v1/messages", kwargs)
                assert status == 400 and named in body["error"]["message"], body
                assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
                continue
            with pytest.raises(anthropic.BadRequestError) as info:
                await client.messages.create(**kwargs)
            assert named in info.value.message, info.value.message
            assert info.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        # Harmless values are accepted: no tools, tool_choice none, thinking disabled.
        ok = await client.messages.create(
            model=FAKE_MODEL,
            messages=USER,  # type: ignore[arg-type]
            max_tokens=3,
            tools=[],
            tool_choice={"type": "none"},
            thinking={"type": "disabled"},
        )
        assert ok.stop_reason == "max_tokens"


async def test_a_wrong_key_is_401_in_anthropics_shape_and_x_api_key_works() -> None:
    async with running_server(security__auth_token="s3cret") as server:
        async with sdk(server, api_key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as info:
                await client.messages.create(model=FAKE_MODEL, messages=USER, max_tokens=2)  # type: ignore[arg-type]
        assert info.value.status_code == 401
        assert info.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "missing or wrong token"},
        }
        async with sdk(server, api_key="s3cret") as client:  # sent as x-api-key
            reply = await client.messages.create(model=FAKE_MODEL, messages=USER, max_tokens=2)  # type: ignore[arg-type]
            assert reply.stop_reason == "max_tokens"
        async with sdk(server, api_key=None, auth_token="s3cret") as client:  # as a Bearer
            reply = await client.messages.create(model=FAKE_MODEL, messages=USER, max_tokens=2)  # type: ignore[arg-type]
            assert reply.stop_reason == "max_tokens"
        status, body = await post(server, "/v1/messages/nowhere", {}, **{"x-api-key": "s3cret"})
        assert status == 404 and body["error"]["type"] == "not_found_error"


async def test_a_full_queue_is_529_overloaded() -> None:
    async with (
        running_server(
            backend__fake__tokens_per_s=20.0,
            backend__fake__parallel=1,
            backend__fake__max_waiting=0,
        ) as server,
        sdk(server) as client,
    ):
        async with client.messages.stream(
            model=FAKE_MODEL, messages=USER, max_tokens=100_000
        ) as first:  # type: ignore[arg-type]
            async for event in first:
                if event.type == "content_block_delta":
                    break
            with pytest.raises(anthropic.APIStatusError) as info:
                await client.messages.create(model=FAKE_MODEL, messages=USER, max_tokens=5)  # type: ignore[arg-type]
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert info.value.response.headers["retry-after"] == "1"


async def test_disconnect_mid_prompt_frees_the_model() -> None:
    # One slot, and a prompt whose prefill would take hours: only a cancel frees it.
    long_prompt = [{"role": "user", "content": "x" * 4000}]
    async with (
        running_server(
            backend__fake__tokens_per_s=0.0,
            backend__fake__parallel=1,
            backend__fake__prefill_ms_per_token=10_000.0,
        ) as server,
        sdk(server) as client,
    ):
        # The head comes when the engine is ours (message_start waits for the
        # prompt's count, after hours here): the stream opens, and is dropped.
        async with client.messages.stream(model=FAKE_MODEL, messages=long_prompt, max_tokens=10):  # type: ignore[arg-type]
            pass
        backend: Any = server.backend
        backend.prefill_ms_per_token = 0.0  # the next request's own prompt is instant
        reply = await asyncio.wait_for(
            client.messages.create(model=FAKE_MODEL, messages=USER, max_tokens=3),  # type: ignore[arg-type]
            timeout(30),
        )
        assert reply.stop_reason == "max_tokens"
        assert requests_ended(server, "cancelled") == 1
        assert server.producer_threads() == 0


async def test_a_queued_stream_gets_pings_then_its_message() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=20.0, backend__fake__parallel=1) as server,
        sdk(server) as client,
    ):
        async with client.messages.stream(
            model=FAKE_MODEL, messages=USER, max_tokens=100_000
        ) as first:  # type: ignore[arg-type]
            async for event in first:
                if event.type == "content_block_delta":
                    break
            url = f"http://127.0.0.1:{server.port}/v1/messages"
            body = {"model": FAKE_MODEL, "messages": USER, "max_tokens": 3, "stream": True}
            async with aiohttp.ClientSession() as session, session.post(url, json=body) as second:
                assert second.status == 200
                assert await second.content.readline() == b"event: ping\n"
                assert await second.content.readline() == b'data: {"type":"ping"}\n'
                assert server.scheduler.waiting == 1
                await first.close()  # frees the model: the queued one starts
                rest = (await second.content.read()).decode().splitlines()
        names = [line[len("event: ") :] for line in rest if line.startswith("event: ")]
        assert names[0] == "message_start" and names[-1] == "message_stop"


async def test_a_client_that_never_reads_holds_bounded_memory_and_its_close_is_a_cancel() -> None:
    """The channel (queue_tokens pieces) + the write buffer (write_limit) + one
    merged event, under 64 KiB; the engine waits on the full channel."""
    max_tokens = 60000
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        backend__fake__parallel=1,
        stream__queue_tokens=64,
        server__sndbuf=16384,
        server__write_limit=16384,
        stream__stall_timeout_s=60.0,
    ) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        body = json.dumps(
            {"model": FAKE_MODEL, "messages": USER, "max_tokens": max_tokens, "stream": True}
        ).encode()
        writer.write(
            b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout(20))
        assert head.startswith(b"HTTP/1.1 200 OK")
        (connection,) = server.api.live.values()
        ((generation,),) = [c.generations.values() for c in server.api.live.values()]
        await asyncio.wait_for(connection.out.writing_paused.wait(), timeout(20))
        assert await asyncio.to_thread(generation.channel.blocked.wait, timeout(20))
        held = connection.buffered_bytes()
        assert held < 64 * 1024, f"{held} bytes held for one slow client"
        assert generation.channel.tokens < max_tokens
        writer.close()  # gone without reading: the request is cancelled, the engine freed
        assert generation.task is not None
        await asyncio.wait_for(generation.task, timeout(10))
        assert requests_ended(server, "cancelled") == 1
        async with sdk(server) as client:
            reply = await client.messages.create(model=FAKE_MODEL, messages=USER, max_tokens=2)  # type: ignore[arg-type]
        assert reply.stop_reason == "max_tokens"
