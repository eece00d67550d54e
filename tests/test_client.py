"""The bundled Python client and terminal chat against a real server."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from typing import Any

import pytest
from conftest import ROOT, expected_fake_text, running_server, timeout
from wsserver_client import Client, GenerationError
from wsserver_client.cli import Chat


async def test_generate_iterates_text_and_reports_done() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=0.0) as server,
        Client(server.url) as client,
    ):
        assert client.hello is not None and client.hello.model == "fake"
        stream = client.generate("hello there", max_tokens=40, seed=5)
        pieces = [text async for text in stream]
        assert "".join(pieces) == expected_fake_text("hello there", 40, seed=5)
        assert stream.done is not None and stream.done.reason == "length"
        assert stream.started


async def test_cancel_drops_late_text_and_returns_done() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=300.0) as server,
        Client(server.url) as client,
    ):
        stream = client.generate("long one", max_tokens=100000)
        seen = []
        async for text in stream:
            seen.append(text)
            if len(seen) == 2:
                done = await stream.cancel()
                assert done is not None and done.reason == "cancelled"
        # Nothing after the cancel reached the caller.
        assert len(seen) == 2
        result = await client.generate("after", max_tokens=5).result()
        assert result.text == expected_fake_text("after", 5)


async def test_restart_and_refusals() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=500.0) as server,
        Client(server.url) as client,
    ):
        first = client.generate("story", max_tokens=10000, seed=2)
        async for _ in first:
            break
        again = client.restart(first.id, max_tokens=20)
        result = await again.result()
        assert result.text == expected_fake_text("story", 20, seed=2)
        assert first.done is not None and first.done.reason == "cancelled"
        with pytest.raises(GenerationError) as info:
            await client.generate(messages=[{"role": "robot", "content": "x"}]).result()
        assert info.value.code == "bad_request"
        with pytest.raises(GenerationError) as info:
            await client.restart("never-was").result()
        assert info.value.code == "unknown_id"


async def test_queued_positions_are_visible() -> None:
    async with running_server(
        backend__fake__parallel=1, backend__fake__tokens_per_s=200.0
    ) as server:
        async with Client(server.url) as a, Client(server.url) as b:
            first = a.generate("a", max_tokens=30)
            async for _ in first:
                break
            second = await b.generate("b", max_tokens=3).result()
            await first.result()
        assert second.done.timings.queued_ms > 0  # timing-ok: it waited, no bound
        assert b.requests.live == {}


async def test_streams_fail_when_the_connection_drops() -> None:
    async with running_server(backend__fake__tokens_per_s=100.0) as server:
        client = Client(server.url)
        await client.connect()
        stream = client.generate("x", max_tokens=10000)
        async for _ in stream:
            break
        assert client.ws is not None
        client.ws.transport.abort()
        with pytest.raises(GenerationError) as info:
            await stream.result()
        assert info.value.code == "connection_lost"
        await client.close()


async def test_chat_streams_regenerates_and_cancels_in_band() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=0.0) as server,
        Client(server.url) as client,
    ):
        out = io.StringIO()
        chat = Chat(client, out=out, options={"max_tokens": 12})
        assert await chat.handle("/regen\n")
        assert "nothing to regenerate" in out.getvalue()
        assert await chat.handle("hi\n")
        assert expected_fake_text("hi", 12) in out.getvalue()
        assert "[length · 12 tokens" in out.getvalue()
        assert await chat.handle("/set max_tokens=3\n")
        assert await chat.handle("/regen\n")
        assert expected_fake_text("hi", 3) + "\n[length · 3 tokens" in out.getvalue()
        assert await chat.handle("/set bogus=1\n") and "unknown option" in out.getvalue()
        assert not await chat.handle("/quit\n")
        assert not chat.interrupt()  # nothing running


def test_chat_cli_end_to_end_in_a_terminal_process() -> None:
    """The console script against a real server process: prompt in, text out."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSSERVER_")}
    server = subprocess.Popen(
        [sys.executable, "-m", "wsserver", "serve", "--backend", "fake", "--port", "0"],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stderr is not None
        url = None
        for line in server.stderr:
            if "listening on " in line:
                url = line.split("listening on ")[1].split()[0]
                break
        assert url, "server did not report its URL"
        chat = subprocess.run(
            [sys.executable, "-m", "wsserver_client.cli", url, "--max-tokens", "8"],
            input="hello\n/quit\n",
            capture_output=True,
            text=True,
            timeout=timeout(30),
            env=env,
        )
        assert chat.returncode == 0, chat.stderr
        assert expected_fake_text("hello", 8) in chat.stdout
        assert "[length · 8 tokens" in chat.stdout
    finally:
        server.terminate()
        server.wait(timeout=timeout(15))
        if server.stderr is not None:
            server.stderr.close()


# ---------------------------------------------------------------- resuming


def _abort_server_side(server: Any) -> None:
    """Abort every connection from the server's side (a TCP reset)."""
    for connection in list(server.connections.values()):
        connection.ws.transport.abort()


async def test_a_resumable_stream_rides_over_a_server_side_abort() -> None:
    from wsserver_client.client import Client as AsyncClient

    reconnected: list[int] = []
    async with (
        running_server(backend__fake__tokens_per_s=400.0) as server,
        AsyncClient(
            server.url, resumable=True, on_reconnect=lambda c: reconnected.append(c.reconnects)
        ) as client,
    ):
        stream = client.generate("ride over", max_tokens=150, seed=4)
        pieces = []
        async for text in stream:
            pieces.append(text)
            if len(pieces) == 3:
                _abort_server_side(server)
        assert "".join(pieces) == expected_fake_text("ride over", 150, seed=4)
        assert stream.done is not None and stream.done.reason == "length"
        assert reconnected == [1]
        seqs = [d.seq for d in stream.deltas]
        assert seqs == list(range(len(seqs)))
        # The new connection serves new requests as usual.
        result = await client.generate("after", max_tokens=5).result()
        assert result.text == expected_fake_text("after", 5)


async def test_a_stream_that_is_not_resumable_still_fails_on_a_lost_connection() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=400.0) as server,
        Client(server.url) as client,
    ):
        stream = client.generate("no resume", max_tokens=100000)
        with pytest.raises(GenerationError) as info:
            async for _ in stream:
                _abort_server_side(server)
        assert info.value.code == "connection_lost"
        assert client.reconnects == 0
