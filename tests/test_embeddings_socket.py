"""The WebSocket protocol's ``embed`` request on the fake engine: one
``embed_done`` per accepted embed (every frame checked against the schema),
float or base64, ``cancel`` by id, ids shared with generations, refusals."""

from __future__ import annotations

import asyncio
import base64
import socket
from typing import Any

from conftest import FAKE_MODEL, running_server, wire

from wsserver.backends.base import CancelEvent
from wsserver.backends.embed_door import EmbedSubmission
from wsserver.backends.fake_embed import fake_vector
from wsserver.core.embedding import Embed, floats_of
from wsserver.core.protocol import EmbedDone, parse_server_frame, serialize


def ended(request_id: str) -> Any:
    return lambda f: f.get("id") == request_id and f["type"] in ("embed_done", "error")


async def test_an_embed_ends_with_one_embed_done_carrying_the_vectors() -> None:
    async with running_server() as server, wire(server) as ws:
        await ws.send({"type": "embed", "id": "e1", "input": ["hello", [1, 2]]})
        await ws.send({"type": "embed", "id": "e2", "input": "café", "encoding_format": "base64"})
        finished: set[str] = set()
        while finished != {"e1", "e2"}:
            frame = await ws.recv()
            if frame["type"] == "embed_done":
                finished.add(frame["id"])
    done = {f["id"]: f for f in ws.frames if f["type"] == "embed_done"}
    assert done["e1"]["reason"] == "complete"
    assert done["e1"]["model"] == FAKE_MODEL
    assert done["e1"]["encoding_format"] == "float"
    assert done["e1"]["data"] == [floats_of(fake_vector("hello")), floats_of(fake_vector((1, 2)))]
    assert done["e1"]["usage"] == {"prompt_tokens": 3}
    assert done["e2"]["encoding_format"] == "base64"
    assert [base64.b64decode(v) for v in done["e2"]["data"]] == [fake_vector("café")]
    assert [f["type"] for f in ws.frames if f.get("id") == "e1"] == ["embed_done"]


def test_embed_done_reads_back_as_it_was_written() -> None:
    vectors = (fake_vector("a"), fake_vector("b"))
    for encoding in ("float", "base64"):
        frame = EmbedDone(
            id="x",
            reason="complete",
            model="m",
            vectors=vectors,
            encoding=encoding,
            prompt_tokens=2,
        )
        assert parse_server_frame(serialize(frame)) == frame
    failed = EmbedDone(id="y", reason="error", error_code="bad_request", error_message="no")
    assert parse_server_frame(serialize(failed)) == failed


async def test_cancel_answers_at_once_and_the_engine_lets_go() -> None:
    async with running_server(
        backend__fake__parallel=1, backend__fake__prefill_ms_per_token=1000.0
    ) as server:
        backend = server.backend
        started = asyncio.Event()
        door = backend.embed_door
        real_start = door.start

        def start(request: Embed, *, cancel: CancelEvent) -> EmbedSubmission:
            started.set()
            return real_start(request, cancel=cancel)

        door.start = start  # type: ignore[method-assign]
        async with wire(server) as ws:
            await ws.send({"type": "embed", "id": "slow", "input": ["x" * 400] * 8})
            await asyncio.wait_for(started.wait(), 10)
            await ws.send({"type": "cancel", "id": "slow"})
            (done,) = [f for f in await ws.until(ended("slow")) if f.get("id") == "slow"]
            assert done == {"type": "embed_done", "id": "slow", "reason": "cancelled"}
            # The one slot is free again: the next embed runs (one simulated second).
            door.start = real_start  # type: ignore[method-assign]
            await ws.send({"type": "embed", "id": "next", "input": "abcd"})
            frames = await ws.until(ended("next"))
        assert frames[-1]["reason"] == "complete"


async def test_refusals_are_error_frames_and_ids_are_shared() -> None:
    async with running_server() as server, wire(server) as ws:
        await ws.send({"type": "embed", "id": "a", "input": ""})
        (empty,) = await ws.until(ended("a"))
        assert empty["type"] == "error" and "empty string" in empty["message"]
        await ws.send({"type": "embed", "id": "b", "input": "x", "model": "nope"})
        (unknown,) = await ws.until(ended("b"))
        assert unknown["type"] == "error" and unknown["code"] == "model_not_found"
        await ws.send({"type": "embed", "id": "c", "input": [[1, 100_000]]})
        (outside,) = await ws.until(ended("c"))
        assert outside["reason"] == "error" and outside["error"]["code"] == "bad_request"
        await ws.send({"type": "embed", "id": "c", "input": "again"})
        (again,) = await ws.until(ended("c"))
        assert again["type"] == "error" and again["code"] == "duplicate_id"
        await ws.send({"type": "generate", "id": "c", "prompt": "hi", "max_tokens": 1})
        (generate,) = await ws.until(lambda f: f.get("id") == "c")
        assert generate["type"] == "error" and generate["code"] == "duplicate_id"
        await ws.send({"type": "embed", "id": "d", "input": "x", "dimensions": 3})
        (unknown_field,) = await ws.until(ended("d"))
        assert unknown_field["type"] == "error"


async def test_the_async_clients_embed() -> None:
    from wsserver_client import Client, GenerationError

    async with running_server() as server, Client(server.url) as client:
        result = await client.embed(["hello", [1, 2]])
        assert result.vectors == [floats_of(fake_vector("hello")), floats_of(fake_vector((1, 2)))]
        assert result.model == FAKE_MODEL
        assert result.prompt_tokens == 3
        try:
            await client.embed("x", model="nope")
        except GenerationError as exc:
            assert exc.code == "model_not_found"
        else:
            raise AssertionError("an unknown model must be refused")
        assert not client.requests.embeds


async def test_the_sync_clients_embed() -> None:
    from wsserver_client.sync import Client

    async with running_server() as server:

        def embed() -> list[list[float]]:
            with Client(server.url) as client:
                return client.embed("café", timeout=10).vectors

        assert await asyncio.to_thread(embed) == [floats_of(fake_vector("café"))]


async def test_a_fifth_embed_at_once_is_refused_busy() -> None:
    async with (
        running_server(
            backend__fake__parallel=1, backend__fake__prefill_ms_per_token=1000.0
        ) as server,
        wire(server) as ws,
    ):
        for n in range(4):  # one runs (for minutes), three wait for the one slot
            await ws.send({"type": "embed", "id": f"e{n}", "input": ["x" * 400] * 8})
        await ws.send({"type": "embed", "id": "e4", "input": "y"})
        (busy,) = await ws.until(ended("e4"))
        assert busy["type"] == "error" and busy["code"] == "busy"
        for n in range(4):
            await ws.send({"type": "cancel", "id": f"e{n}"})
        for n in range(4):
            done = [f for f in await ws.until(ended(f"e{n}")) if f.get("id") == f"e{n}"]
            assert done[-1]["reason"] == "cancelled"
        # All four let go of the queue and the slot: the next one runs (one token, 1 s).
        await ws.send({"type": "embed", "id": "next", "input": "abcd"})
        frames = await ws.until(ended("next"))
        assert frames[-1]["reason"] == "complete"


async def test_a_large_embed_done_has_room_for_two_segments_and_a_streams_frames_do_not() -> None:
    """A message larger than ``server.sndbuf`` (a 2,000-input ``embed_done``)
    is written with room for two TCP segments — below that, on loopback,
    each send waits for the client's delayed ACK (WholeAnswerBuffer) — and
    the next message, a stream's, restores the configured size before it is
    written: a resumable stream's replay tail counts on it."""
    with socket.socket() as scratch:  # what Linux makes of the configured size
        scratch.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        configured = scratch.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    inputs = [f"input number {i}" for i in range(2000)]
    async with running_server(server__sndbuf=16384) as server, wire(server) as ws:
        await ws.send({"type": "embed", "id": "big", "input": inputs})
        (done,) = [f for f in await ws.until(ended("big")) if f.get("id") == "big"]
        assert done["reason"] == "complete"
        assert done["data"][1999] == floats_of(fake_vector(inputs[1999]))
        (connection,) = server.connections.values()
        sock = connection.ws.transport.get_extra_info("socket")
        segment = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
        assert 2 * segment > 16384, "loopback's segments are larger than the buffer"
        assert connection.sender.send_buffer.widened
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * segment
        await ws.send({"type": "generate", "id": "g", "prompt": "hi", "max_tokens": 3})
        text, frames = await ws.done("g")
        assert text and frames[-1]["type"] == "done"
        assert not connection.sender.send_buffer.widened
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == configured
