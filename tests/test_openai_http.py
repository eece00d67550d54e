"""The OpenAI HTTP API end to end: a real server on real sockets, the official
``openai`` SDK (and aiohttp, curl, raw sockets) as clients.

The fake backend is deterministic, so every text is checked against what the
WebSocket path (or the fake's own oracle) gives for the same request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import h11
import openai
import pytest
from conftest import FAKE_MODEL, expected_fake_text, running_server, timeout, wire

from wsserver.aio import Server
from wsserver.aio.openai_http import HttpConnection
from wsserver.backends.openai_wire import parse_chunk
from wsserver.sse import SSEParser

MESSAGES = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "tell me"}]


def base_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}/v1"


@contextlib.asynccontextmanager
async def sdk(
    server: Server, api_key: str = "unused", **kwargs: Any
) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=base_url(server), api_key=api_key, max_retries=0, timeout=timeout(30), **kwargs
    )
    try:
        yield client
    finally:
        await client.close()


def sync_sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=base_url(server), api_key="unused", max_retries=0, timeout=timeout(30)
    )


def requests_ended(server: Server, reason: str) -> float:
    value = server.metrics.registry.get_sample_value("wsserver_requests_total", {"reason": reason})
    return value or 0.0


def only_http(server: Server) -> HttpConnection:
    (connection,) = server.api.live.values()
    return connection


async def ws_text(server: Server, **fields: Any) -> str:
    async with wire(server) as client:
        await client.send({"type": "generate", "id": "w", **fields})
        text, _ = await client.done("w")
        return text


# ---------------------------------------------------------------- text, streams, usage


async def test_chat_streamed_and_whole_give_the_websocket_text() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, sdk(server) as client:
        expected = await ws_text(server, messages=MESSAGES, max_tokens=40, seed=5)
        whole = await client.chat.completions.create(
            model=FAKE_MODEL,
            messages=MESSAGES,
            max_tokens=40,
            seed=5,  # type: ignore[arg-type]
        )
        assert whole.model == "fake"
        assert whole.choices[0].message.content == expected
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None and whole.usage.completion_tokens == 40
        stream = await client.chat.completions.create(
            model=FAKE_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=40,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        # The usage chunk: last, no choices, the request's counts.
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None
        assert (chunks[-1].usage.completion_tokens, chunks[-1].usage.total_tokens) == (
            40,
            40 + chunks[-1].usage.prompt_tokens,
        )
        assert all(c.usage is None for c in chunks[:-1])


async def test_completion_streamed_and_whole_give_the_fake_models_text() -> None:
    expected = expected_fake_text("Once upon", 30, seed=9)
    async with running_server(backend__fake__tokens_per_s=0.0) as server, sdk(server) as client:
        whole = await client.completions.create(
            model=FAKE_MODEL, prompt="Once upon", max_tokens=30, seed=9
        )
        assert whole.choices[0].text == expected
        stream = await client.completions.create(
            model=FAKE_MODEL, prompt="Once upon", max_tokens=30, seed=9, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "length"
        assert chunks[-1].usage is None  # not asked for
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake"]
        assert (await client.models.retrieve("fake")).id == "fake"


# ---------------------------------------------------------------- disconnect is cancel


async def test_breaking_out_of_a_stream_cancels_it_and_the_next_request_starts_at_once() -> None:
    # One slot at 20 tokens/s: the abandoned request would hold it for hours.
    async with running_server(
        backend__fake__tokens_per_s=20.0, backend__fake__parallel=1
    ) as server:
        client = sync_sdk(server)

        def abandon_then_ask() -> str | None:
            with client.chat.completions.create(
                model=FAKE_MODEL,
                messages=MESSAGES,
                max_tokens=100_000,
                stream=True,  # type: ignore[arg-type]
            ) as stream:
                for _chunk in stream:
                    break
            reply = client.chat.completions.create(
                model=FAKE_MODEL,
                messages=MESSAGES,
                max_tokens=3,  # type: ignore[arg-type]
            )
            return reply.choices[0].finish_reason

        try:
            reason = await asyncio.wait_for(asyncio.to_thread(abandon_then_ask), timeout(30))
        finally:
            client.close()
        assert reason == "length"
        assert requests_ended(server, "cancelled") == 1
        assert requests_ended(server, "length") == 1
        assert server.producer_threads() == 0


async def test_a_client_gone_while_queued_leaves_the_queue() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=20.0, backend__fake__parallel=1) as server,
        sdk(server) as client,
    ):
        first = await client.completions.create(
            model=FAKE_MODEL, prompt="a", max_tokens=100_000, stream=True
        )
        await first.__anext__()
        async with aiohttp.ClientSession() as raw:
            body = {"prompt": "b", "max_tokens": 5, "stream": True}
            async with raw.post(base_url(server) + "/completions", json=body) as second:
                # Queued: the headers, then a keep-alive comment while it waits.
                assert second.status == 200
                assert await second.content.readline() == b": keep-alive\n"
                assert server.scheduler.waiting == 1
                waiting = [
                    g
                    for c in server.api.live.values()
                    for g in c.generations.values()
                    if g.slot is None
                ]
        (generation,) = waiting
        assert generation.task is not None
        await asyncio.wait_for(generation.task, timeout(10))
        assert server.scheduler.waiting == 0
        await first.close()


async def test_a_queued_stream_gets_keep_alives_then_its_text() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=20.0, backend__fake__parallel=1) as server,
        sdk(server) as client,
    ):
        first = await client.completions.create(
            model=FAKE_MODEL, prompt="a", max_tokens=100_000, stream=True
        )
        await first.__anext__()
        async with aiohttp.ClientSession() as raw:
            body = {"prompt": "b", "max_tokens": 5, "seed": 1, "stream": True}
            async with raw.post(base_url(server) + "/completions", json=body) as second:
                assert await second.content.readline() == b": keep-alive\n"
                await first.close()  # frees the model: the queued one starts
                rest = (await second.content.read()).decode().splitlines()
        events = [line[len("data: ") :] for line in rest if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(parse_chunk(e).text for e in events[:-1]) == expected_fake_text("b", 5, 1)


async def test_shutdown_ends_a_running_stream_with_an_error_event_and_closes() -> None:
    async with running_server(backend__fake__tokens_per_s=20.0) as server, sdk(server) as client:
        stream = await client.completions.create(
            model=FAKE_MODEL, prompt="a", max_tokens=100_000, stream=True
        )
        await stream.__anext__()
        stopping = asyncio.create_task(server.stop(grace=0))
        with pytest.raises(openai.APIError, match="the server is shutting down"):
            async for _chunk in stream:
                pass
        await asyncio.wait_for(stopping, timeout(10))
        assert not server.api.live
        assert requests_ended(server, "cancelled") == 1


# ---------------------------------------------------------------- errors, auth, limits


async def test_errors_come_as_the_sdks_exceptions_with_our_messages() -> None:
    async with running_server(server__max_frame_bytes=4096) as server, sdk(server) as client:
        with pytest.raises(openai.BadRequestError, match="'n' must be an integer from 1 to 128"):
            await client.chat.completions.create(model=FAKE_MODEL, messages=MESSAGES, n=500)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="'temperature' must be between 0 and 100"):
            await client.completions.create(model=FAKE_MODEL, prompt="x", temperature=500)
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            await client.models.retrieve("gpt-17")
        with pytest.raises(openai.APIStatusError, match="exceeds 4096 bytes") as info:
            await client.completions.create(model=FAKE_MODEL, prompt="x" * 5000)
        assert info.value.status_code == 413
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "too_large"
        async with aiohttp.ClientSession() as raw:
            async with raw.get(base_url(server) + "/audio/speech") as missing:
                assert missing.status == 404
                assert (await missing.json())["error"]["type"] == "not_found_error"
            async with raw.get(base_url(server) + "/chat/completions") as wrong:
                assert wrong.status == 405


async def test_a_full_queue_is_503_and_a_fast_client_429() -> None:
    async with (
        running_server(
            backend__fake__tokens_per_s=20.0,
            backend__fake__parallel=1,
            backend__fake__max_waiting=0,
        ) as server,
        sdk(server) as client,
    ):
        first = await client.completions.create(
            model=FAKE_MODEL, prompt="a", max_tokens=1000, stream=True
        )
        await first.__anext__()
        with pytest.raises(openai.InternalServerError, match="already waiting") as info:
            await client.completions.create(model=FAKE_MODEL, prompt="b", max_tokens=5)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        await first.close()
    async with running_server(limits__frames_per_s=0.001, limits__frames_burst=2) as server:
        async with sdk(server) as client:
            await client.models.list()
            await client.models.list()
            with pytest.raises(openai.RateLimitError, match="too many requests"):
                await client.models.list()


async def test_the_token_is_required_as_a_bearer() -> None:
    async with running_server(security__auth_token="s3cret") as server:
        async with sdk(server, api_key="wrong") as client:
            with pytest.raises(openai.AuthenticationError, match="missing or wrong token") as info:
                await client.completions.create(model=FAKE_MODEL, prompt="a", max_tokens=2)
            assert info.value.code == "invalid_api_key"
        async with sdk(server, api_key="s3cret") as client:
            reply = await client.completions.create(model=FAKE_MODEL, prompt="a", max_tokens=2)
            assert reply.choices[0].finish_reason == "length"
        refused = server.metrics.registry.get_sample_value(
            "wsserver_handshakes_refused_total", {"reason": "auth"}
        )
        assert refused == 1


async def fetch(
    method: str, url: str, *, headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, Any, Any]:
    """One plain HTTP request: status, headers and the JSON body (or None)."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, headers=headers, json=body) as response:
            data = await response.read()
            return response.status, response.headers, json.loads(data) if data else None


async def test_host_origin_and_cors_preflight() -> None:
    async with running_server(security__allowed_origins=["https://app.example"]) as server:
        url = base_url(server) + "/chat/completions"
        status, _, error = await fetch(
            "GET", base_url(server) + "/models", headers={"Host": "evil.example"}
        )
        assert status == 403 and error["error"]["code"] == "host"
        preflight = {
            "Origin": "https://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        status, headers, _ = await fetch("OPTIONS", url, headers=preflight)
        assert status == 204
        assert headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in headers["access-control-allow-methods"]
        assert headers["access-control-allow-headers"] == "authorization, content-type"
        status, headers, _ = await fetch(
            "OPTIONS", url, headers={**preflight, "Origin": "https://evil.example"}
        )
        assert status == 403 and "access-control-allow-origin" not in headers
        body = {"messages": MESSAGES, "max_tokens": 2}
        status, headers, _ = await fetch(
            "POST", url, headers={"Origin": "https://app.example"}, body=body
        )
        assert status == 200
        assert headers["access-control-allow-origin"] == "https://app.example"
        assert headers["access-control-expose-headers"] == "X-Request-ID"
        status, _, _ = await fetch(
            "POST", url, headers={"Origin": "https://evil.example"}, body=body
        )
        assert status == 403


async def test_x_request_id_is_echoed_or_generated_and_names_the_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="wsserver")
    async with running_server() as server, sdk(server) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=FAKE_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=2,
            extra_headers={"X-Request-ID": "mine-1"},
        )
        assert raw.headers["x-request-id"] == "mine-1"
        assert raw.parse().id == "chatcmpl-mine-1"
        other = await client.completions.with_raw_response.create(
            model=FAKE_MODEL, prompt="a", max_tokens=2, extra_headers={"X-Request-ID": "not valid!"}
        )
        generated = other.headers["x-request-id"]
        assert generated != "not valid!" and len(generated) == 16
    done_lines = [r.getMessage() for r in caplog.records if " done reason=" in r.getMessage()]
    assert any("id=mine-1 done reason=length" in line for line in done_lines)
    assert any(f"id={generated} done" in line for line in done_lines)


# ---------------------------------------------------------------- other clients


async def test_curl_streams_it() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        body = json.dumps({"prompt": "curl", "max_tokens": 50, "seed": 3, "stream": True})
        process = await asyncio.create_subprocess_exec(
            "curl", "-N", "-sS", "-H", "Content-Type: application/json", "-d", body,
            base_url(server) + "/completions",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, _ = await asyncio.wait_for(process.communicate(), timeout(30))
        assert process.returncode == 0
        events = SSEParser().feed(stdout)
        assert events[-1] == "[DONE]"
        assert "".join(parse_chunk(e).text for e in events[:-1]) == expected_fake_text(
            "curl", 50, 3
        )


async def test_the_front_reads_a_request_line_in_pieces_and_websockets_keeps_the_rest() -> None:
    async with running_server() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for piece in (
            b"GET /v",
            b"1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n",
            b"Connection: close\r\n\r\n",
        ):
            writer.write(piece)
            await writer.drain()
        response = await asyncio.wait_for(reader.read(), timeout(10))
        writer.close()
        assert response.startswith(b"HTTP/1.1 200 ")
        assert b'"id":"fake"' in response
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{server.port}/healthz") as health:
                assert (health.status, await health.text()) == (200, "ok\n")
        assert await ws_text(server, prompt="p", max_tokens=3, seed=1) == expected_fake_text(
            "p", 3, 1
        )


async def test_pipelined_requests_are_answered_in_order_and_bad_http_is_a_400() -> None:
    async with running_server() as server:
        head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-ID: "
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(head + b"one\r\n\r\n" + head + b"two\r\nConnection: close\r\n\r\n")
        response = await asyncio.wait_for(reader.read(), timeout(10))
        writer.close()
        assert response.count(b"HTTP/1.1 200 OK") == 2
        assert response.index(b"X-Request-ID: one") < response.index(b"X-Request-ID: two")
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nbad header\r\n\r\n")
        response = await asyncio.wait_for(reader.read(), timeout(10))
        writer.close()
        assert response.startswith(b"HTTP/1.1 400 Bad Request")
        assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "bad_request"


# ---------------------------------------------------------------- a slow reader


async def test_a_slow_sse_reader_pauses_its_request_with_bounded_memory_and_gets_every_word() -> (
    None
):
    """The client stops reading; the model runs flat out. Held for the client:
    the channel (queue_tokens pieces) + the write buffer (write_limit) + one
    merged chunk, under 64 KiB; the kernel's buffers (SO_SNDBUF) on top."""
    bound = 64 * 1024
    max_tokens = 60000
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        stream__queue_tokens=64,
        server__sndbuf=16384,
        server__write_limit=16384,
        stream__stall_timeout_s=60.0,
    ) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        body = json.dumps({"prompt": "slow", "max_tokens": max_tokens, "stream": True}).encode()
        client = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method="POST",
            target="/v1/completions",
            headers=[
                ("Host", "127.0.0.1"),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Connection", "close"),
            ],
        )
        writer.write(client.send(request) + client.send(h11.Data(data=body)))
        writer.write(client.send(h11.EndOfMessage()))
        await writer.drain()
        # The head comes at "started", once the request is submitted to the engine;
        # then read nothing until the engine is paused on its full channel.
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout(20))
        client.receive_data(head)
        ((generation,),) = [c.generations.values() for c in server.api.live.values()]
        connection = only_http(server)
        await asyncio.wait_for(connection.out.writing_paused.wait(), timeout(20))
        assert await asyncio.to_thread(generation.channel.blocked.wait, timeout(20))
        # Watch it for a second: paused, the engine makes no progress and the
        # buffers stay where they are (without backpressure it would run on).
        tokens = generation.channel.tokens
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await asyncio.Event().wait()
        held = connection.buffered_bytes()
        assert held < bound, f"{held} bytes held for one slow client"
        assert generation.channel.tokens == tokens < max_tokens, "the engine ran on regardless"
        # Read on: everything arrives, complete and in order.
        parser = SSEParser()
        events: list[str] = []
        async with asyncio.timeout(timeout(120)):
            while True:
                event = client.next_event()
                if event is h11.NEED_DATA:
                    client.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    assert event.status_code == 200
                elif isinstance(event, h11.Data):
                    events += parser.feed(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
        writer.close()
        # At every write, not only when sampled: the write buffer never held
        # more than its high-water mark and one chunk.
        assert connection.out.peak_write_buffer < 32 * 1024, connection.out.peak_write_buffer
        assert events[-1] == "[DONE]"
        chunks = [parse_chunk(e) for e in events[:-1]]
        assert "".join(c.text for c in chunks) == expected_fake_text("slow", max_tokens)
        assert chunks[-1].finish == "length"


# ---------------------------------------------------------------- hardening III (issue 26)


async def raw_connection(
    server: Server, rcvbuf: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    return await asyncio.open_connection(sock=sock, limit=4096)


def completion_request(body: dict[str, Any], *, close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(data)
    )
    return head + (b"Connection: close\r\n" if close else b"") + b"\r\n" + data


async def test_partial_requests_count_against_the_connection_limits_and_time_out() -> None:
    """Fault 1 and 9: a head without its body, or half a head, holds a
    connection; it counts from the start and is dropped after request_timeout_s."""
    async with running_server(
        limits__max_connections=2, server__request_timeout_s=timeout(1)
    ) as server:
        partial_body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"
        partial_head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        held = []
        for data in (partial_body, partial_head):
            server.api.opened.clear()
            reader, writer = await raw_connection(server)
            writer.write(data)
            await asyncio.wait_for(server.api.opened.wait(), timeout(10))
            held.append((reader, writer))
        status, _, body = await fetch("GET", base_url(server) + "/models")
        assert status == 503, body
        assert body["error"]["code"] == "connections"
        # Both are dropped within the request timeout (not idle_timeout_s, 600 s).
        answers = [await asyncio.wait_for(r.read(), timeout(10)) for r, _ in held]
        assert answers[0].startswith(b"HTTP/1.1 408 "), answers[0]
        assert answers[1] == b""
        for _, writer in held:
            writer.close()
        status, _, _ = await fetch("GET", base_url(server) + "/models")
        assert status == 200


async def test_a_client_that_pipelines_and_never_reads_is_not_answered_ahead() -> None:
    """Fault 5 (and 4): the next pipelined request waits until the previous
    response drained; a client that never reads is aborted after
    send_timeout_s and its place in the connection limits is freed."""
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        server__sndbuf=16384,
        server__write_limit=16384,
        server__send_timeout_s=timeout(1),
        limits__max_connections=1,
    ) as server:
        server.api.opened.clear()
        _, writer = await raw_connection(server, rcvbuf=8192)
        request = {"prompt": "p", "max_tokens": 4000}
        writer.write(completion_request(request) * 40)
        await asyncio.wait_for(server.api.opened.wait(), timeout(10))
        (connection,) = server.api.live.values()
        await asyncio.wait_for(connection.draining.wait(), timeout(20))
        served = requests_ended(server, "length")
        assert served < 10, f"{served} responses written to a client that reads nothing"
        peak = connection.out.peak_write_buffer
        assert peak < 16384 + 64 * 1024, peak
        await asyncio.wait_for(connection.closed.wait(), timeout(20))
        assert requests_ended(server, "length") == served
        writer.close()
        status, _, _ = await fetch("GET", base_url(server) + "/models")
        assert status == 200


async def test_a_closed_connection_whose_client_never_reads_is_aborted() -> None:
    """Fault 4: ``Connection: close`` after a response the client never reads."""
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        server__sndbuf=16384,
        server__send_timeout_s=timeout(1),
        limits__max_connections=1,
    ) as server:
        server.api.opened.clear()
        _, writer = await raw_connection(server, rcvbuf=8192)
        writer.write(completion_request({"prompt": "p", "max_tokens": 40000}, close=True))
        await asyncio.wait_for(server.api.opened.wait(), timeout(10))
        (connection,) = server.api.live.values()
        await asyncio.wait_for(connection.closed.wait(), timeout(20))
        writer.close()
        status, _, _ = await fetch("GET", base_url(server) + "/models")
        assert status == 200


async def test_echoed_input_is_clipped_and_guessing_tokens_is_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fault 10."""
    async with running_server(
        security__auth_token="s3cret", limits__frames_per_s=0.001, limits__frames_burst=3
    ) as server:
        auth = {"Authorization": "Bearer s3cret"}
        caplog.set_level(logging.INFO, logger="wsserver")
        status, _, body = await fetch(
            "GET", base_url(server) + "/models/" + "m" * 60000, headers=auth
        )
        assert status == 404
        assert len(body["error"]["message"]) < 200
        assert max(len(r.getMessage()) for r in caplog.records) < 1000
        statuses = [
            (
                await fetch(
                    "GET", base_url(server) + "/models", headers={"Authorization": "Bearer x"}
                )
            )[0]
            for _ in range(4)
        ]
        assert statuses == [401, 401, 429, 429]


async def test_head_on_a_v1_route_gets_headers_only() -> None:
    """Fault 11: h11 refuses a body after a HEAD; the connection stays usable."""
    async with running_server() as server:
        reader, writer = await raw_connection(server)
        head = b"HEAD /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        get = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        writer.write(head + get)
        response = await asyncio.wait_for(reader.read(), timeout(10))
        writer.close()
        first, second = response.split(b"HTTP/1.1 200 OK")[1:]
        assert first.endswith(b"\r\n\r\n")  # headers only
        length = int(first.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        assert length == len(second.split(b"\r\n\r\n", 1)[1]) > 0


def _get_on_one_connection(port: int, paths: list[str]) -> list[tuple[int, str, bytes, int]]:
    """GET each path in turn over one kept-alive HTTP/1.1 connection:
    (status, content type, body, the socket's file number) each."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout(10))
    out = []
    try:
        for path in paths:
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
            assert conn.sock is not None
            out.append(
                (response.status, response.getheader("Content-Type", ""), body, conn.sock.fileno())
            )
    finally:
        conn.close()
    return out


async def test_a_connection_kept_alive_by_v1_still_gets_the_plain_routes() -> None:
    # After a /v1 answer the OpenAI handler keeps the connection; the probes,
    # /metrics and the page asked on it next are answered as on a new one.
    async with running_server() as server:
        answers = await asyncio.to_thread(
            _get_on_one_connection,
            server.port,
            ["/v1/models", "/metrics", "/healthz", "/readyz", "/", "/v1/models", "/nope"],
        )
    models, metrics, health, ready, page, again, missing = answers
    assert len({a[3] for a in answers}) == 1  # one connection throughout
    assert models[0] == 200 and json.loads(models[2])["object"] == "list"
    assert metrics[0] == 200 and b"wsserver_requests_total" in metrics[2]
    assert metrics[1].startswith("text/plain")
    assert (health[0], health[2]) == (200, b"ok\n") and (ready[0], ready[2]) == (200, b"ready\n")
    assert page[0] == 200 and page[1].startswith("text/html") and b"<html" in page[2].lower()
    assert again[0] == 200
    assert missing[0] == 404


@pytest.mark.parametrize("path", ["/", "/v1/responses"])
async def test_a_websocket_upgrade_on_a_kept_alive_connection_is_a_websocket(path: str) -> None:
    """Issue 34: aiohttp reuses the connection a ``GET /v1/models`` kept alive
    (as HTTP/1.1 allows) for its next ``ws_connect``; the upgrade on it was
    answered 200 by the HTTP handler ("Invalid response status 200"). Every
    request on a kept-alive connection is routed like the first one: the
    upgrade goes to websockets, with the handshake's checks, and the socket
    serves as on a new connection."""
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        url = f"http://127.0.0.1:{server.port}"
        opened: list[str] = []
        trace = aiohttp.TraceConfig()

        async def created(*_: Any) -> None:
            opened.append("new")

        async def reused(*_: Any) -> None:
            opened.append("reused")

        trace.on_connection_create_end.append(created)
        trace.on_connection_reuseconn.append(reused)
        async with aiohttp.ClientSession(trace_configs=[trace]) as session:
            async with session.get(url + "/v1/models") as response:
                assert response.status == 200
                await response.read()
            async with session.ws_connect(url + path) as ws:
                # The same TCP connection: the one the GET kept alive.
                assert opened == ["new", "reused"]
                async with asyncio.timeout(timeout(30)):
                    if path == "/":
                        assert (await ws.receive_json())["type"] == "hello"
                        await ws.send_json(
                            {"type": "generate", "id": "a", "prompt": "p", "max_tokens": 3}
                        )
                        while (frame := await ws.receive_json())["type"] != "done":
                            pass
                        assert frame["reason"] == "length"
                    else:
                        await ws.send_json(
                            {"type": "response.create", "input": "p", "max_output_tokens": 3}
                        )
                        while (event := await ws.receive_json())["type"] not in (
                            "response.completed",
                            "response.incomplete",
                            "response.failed",
                            "error",
                        ):
                            pass
                        assert event["type"] == "response.incomplete", event
