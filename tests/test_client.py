"""The bundled Python client and terminal chat against a real server."""

from __future__ import annotations

import asyncio
import contextlib
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
            [
                sys.executable,
                "-m",
                "wsserver_client.cli",
                url,
                "--max-tokens",
                "8",
                "--model",
                "fake",
            ],
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


class _Blackhole:
    """A TCP relay that can drop the client's side while keeping the server's:
    the client sees its connection lost, the server does not (yet) — a
    vanished peer, as after a Wi-Fi switch."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._server: asyncio.Server | None = None
        self.pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        #: Server-side connections kept open after their client side was dropped.
        self.held: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._port)
        self.pairs.append((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            if dst not in self.held:
                dst.close()  # pass the end on, as a TCP relay does

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def drop_client_side(self) -> asyncio.StreamWriter:
        """Reset the client's connection; return the server-side one, left open."""
        client_side, server_side = self.pairs[-1]
        self.held.add(server_side)
        client_side.transport.abort()
        return server_side

    async def close(self) -> None:
        assert self._server is not None
        for client_side, server_side in self.pairs:
            client_side.transport.abort()
            server_side.transport.abort()
        self._server.close()
        await self._server.wait_closed()


async def test_a_resume_refused_as_already_attached_is_retried_until_the_server_lets_go() -> None:
    from wsserver_client.client import Client as AsyncClient

    async with running_server(backend__fake__tokens_per_s=300.0) as server:
        refused = asyncio.Event()
        claim = server.resumes.claim

        def watching_claim(request_id: str, token: str) -> Any:
            try:
                return claim(request_id, token)
            except Exception as exc:
                if getattr(exc, "code", None) == "already_attached":
                    refused.set()
                raise

        server.resumes.claim = watching_claim  # type: ignore[method-assign]
        relay = _Blackhole(server.port)
        port = await relay.start()
        try:
            async with AsyncClient(f"ws://127.0.0.1:{port}/", resumable=True) as client:
                stream = client.generate("vanished", max_tokens=120, seed=6)
                pieces = []
                async for text in stream:
                    pieces.append(text)
                    if len(pieces) == 2:
                        server_side = relay.drop_client_side()
                        # The server still holds the request for the old
                        # connection: the resume is refused, and retried.
                        async with asyncio.timeout(timeout()):
                            await refused.wait()
                        server_side.transport.abort()  # now the server notices
                assert "".join(pieces) == expected_fake_text("vanished", 120, seed=6)
                assert stream.done is not None and stream.done.reason == "length"
                assert client.reconnects == 1
        finally:
            await relay.close()
