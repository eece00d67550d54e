"""One WebSocket connection for both dialects: the WebSocket protocol and the
Responses API's WebSocket mode run on the same receive loop, frame rate,
sender, closing paths and memory count (aio/socket_connection.py). Each test
runs for both, on the wire."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import handlers_finished, running_server, timeout
from test_metrics import scrape
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from wsserver.aio import Server
from wsserver.aio.peer import PeerAwareConnection, memory_bound
from wsserver.aio.socket_connection import SocketConnection


@dataclass(frozen=True)
class Dialect:
    """How a test speaks one dialect."""

    path: str
    #: A request for a long answer (a million tokens).
    long_request: dict[str, Any]
    #: Whether a message is the first one of a running request (started / created).
    started: Callable[[dict[str, Any]], bool]
    #: A message that refers to nothing: refused with an ``error``.
    refused: dict[str, Any]
    #: The error code of an ``error`` message, ``None`` for any other message.
    error_code: Callable[[dict[str, Any]], str | None]
    #: Whether a message is the request's end as cancelled.
    cancelled: Callable[[dict[str, Any]], bool]


PROTOCOL = Dialect(
    path="/",
    long_request={"type": "generate", "id": "g", "prompt": "p", "max_tokens": 10**6},
    started=lambda m: m["type"] == "started",
    refused={"type": "cancel", "id": "nothing"},
    error_code=lambda m: m["code"] if m["type"] == "error" else None,
    cancelled=lambda m: m["type"] == "done" and m["reason"] == "cancelled",
)
RESPONSES = Dialect(
    path="/v1/responses",
    long_request={"type": "response.create", "input": "p", "max_output_tokens": 10**6},
    started=lambda m: m["type"] == "response.created",
    refused={"type": "response.cancel", "response_id": "resp_nothing"},
    error_code=lambda m: m["error"]["code"] if m["type"] == "error" else None,
    cancelled=lambda m: (
        m["type"] == "response.incomplete"
        and m["response"]["incomplete_details"]["reason"] == "cancelled"
    ),
)
DIALECTS = pytest.mark.parametrize("dialect", [PROTOCOL, RESPONSES], ids=["protocol", "responses"])


@contextlib.asynccontextmanager
async def client(
    server: Server, dialect: Dialect, *, slow: bool = False
) -> AsyncIterator[ClientConnection]:
    """A plain websockets client on the dialect's path (``slow``: a tiny
    receive buffer, so that a client that stops reading is felt at once)."""
    sock = socket.socket()
    if slow:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    url = f"ws://127.0.0.1:{server.port}{dialect.path}"
    async with ws_connect(url, sock=sock, max_queue=1 if slow else 16) as ws:
        if dialect is PROTOCOL:
            assert json.loads(await ws.recv())["type"] == "hello"
        yield ws


async def until(ws: ClientConnection, predicate: Callable[[dict[str, Any]], bool]) -> None:
    async with asyncio.timeout(timeout(30)):
        while not predicate(json.loads(await ws.recv())):
            pass


def the_connection(server: Server) -> SocketConnection:
    (connection,) = server.connections.values()
    return connection


def errors_counted(server: Server, code: str) -> float:
    value = server.metrics.registry.get_sample_value("wsserver_errors_total", {"code": code})
    return value or 0.0


@DIALECTS
async def test_over_the_frame_rate_an_error_counted_then_a_flood_is_closed_1008(
    dialect: Dialect,
) -> None:
    """The Responses mode aborted a flooding client without a word, and had no
    idle timeout: both are the connection's now, as the protocol had them."""
    async with running_server(
        limits__frames_per_s=20.0, limits__frames_burst=10, limits__flood_close_after=30
    ) as server:
        codes: list[str | None] = []
        async with client(server, dialect) as ws:

            async def read() -> None:
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        codes.append(dialect.error_code(json.loads(await ws.recv())))

            reader = asyncio.create_task(read())
            with contextlib.suppress(ConnectionClosed):
                for _ in range(10_000):
                    await ws.send(json.dumps(dialect.refused))
            await asyncio.wait_for(reader, timeout(10))
            assert ws.close_code == 1008
            assert ws.close_reason == "frame rate limit exceeded"
        assert codes.count("rate_limited") >= 1
        assert len([c for c in codes if c not in (None, "rate_limited")]) >= 10  # the burst
        assert errors_counted(server, "rate_limited") == codes.count("rate_limited")


@DIALECTS
async def test_an_idle_connection_is_closed_1000(dialect: Dialect) -> None:
    async with running_server(server__idle_timeout_s=timeout(0.2)) as server:
        async with client(server, dialect) as ws:
            async with asyncio.timeout(timeout(10)):
                await ws.wait_closed()
            assert (ws.close_code, ws.close_reason) == (1000, "idle timeout")
        await handlers_finished(server)


@DIALECTS
async def test_a_server_shutdown_ends_the_request_cancelled_and_closes_1001(
    dialect: Dialect,
) -> None:
    async with running_server(backend__fake__tokens_per_s=20.0) as server:
        async with client(server, dialect) as ws:
            await ws.send(json.dumps(dialect.long_request))
            await until(ws, dialect.started)
            await server.stop(grace=0)
            await until(ws, dialect.cancelled)
            async with asyncio.timeout(timeout(10)):
                await ws.wait_closed()
            assert ws.close_code == 1001
        assert server.producer_threads() == 0


@DIALECTS
async def test_a_client_that_reads_nothing_is_counted_the_same_way(dialect: Dialect) -> None:
    """What the connection holds, by part (``held_bytes``), within the bound
    for both dialects, and the same figure on /metrics: the channel and the
    write buffer (the Responses mode's was counted on its own before)."""
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        stream__queue_tokens=64,
        server__sndbuf=16384,
        server__write_limit=16384,
        server__ping_interval_s=0,
        server__send_timeout_s=timeout(60),
        stream__stall_timeout_s=0,
    ) as server:
        async with client(server, dialect, slow=True) as ws:
            await ws.send(json.dumps(dialect.long_request))
            await until(ws, dialect.started)
            ws.transport.pause_reading()  # from now on, read nothing
            connection = the_connection(server)
            assert isinstance(connection.ws, PeerAwareConnection)
            (generation,) = connection.generations.values()
            async with asyncio.timeout(timeout(30)):
                await connection.ws.writing_paused.wait()
            assert await asyncio.to_thread(generation.channel.blocked.wait, timeout(30))
            held = connection.held_bytes()
            bound = memory_bound(server.config)
            assert set(held) == set(bound)
            for part, size in held.items():
                assert size <= bound[part], (part, held, bound)
            assert 0 < held["send"] == connection.buffered_bytes()
            metrics = await scrape(server)
            assert metrics["wsserver_connection_buffered_bytes_max"] == held["send"]
            ws.transport.abort()
        await handlers_finished(server)
        assert server.producer_threads() == 0


@DIALECTS
async def test_closed_connections_are_freed_without_the_cyclic_gc(dialect: Dialect) -> None:
    gc.collect()
    gc.disable()
    try:
        async with running_server(backend__fake__tokens_per_s=200.0) as server:
            refs = []
            for n in range(4):
                async with client(server, dialect) as ws:
                    refs.append(weakref.ref(the_connection(server)))
                    await ws.send(json.dumps(dialect.long_request))
                    await until(ws, dialect.started)
                    if n % 2:  # ... half of them leave without a close frame
                        ws.transport.abort()
                await handlers_finished(server)
            alive = [ref() for ref in refs if ref() is not None]
            assert not alive, f"{len(alive)} of {len(refs)} closed connections still alive"
    finally:
        gc.enable()
