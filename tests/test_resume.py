"""Resumable streams over real sockets: a lost connection, then ``resume``.

The fake backend is deterministic, so "the concatenated text equals an
uninterrupted run's" is checked against :func:`conftest.expected_fake_text`.
Abrupt loss is the client's transport aborted (a TCP reset, no close frame).
Nothing sleeps: tests wait on the registry's ``parked_event``, on a channel's
``blocked`` event, or on frames.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import Wire, expected_fake_text, running_server, slow_wire, timeout, wire

from wsserver.aio import Server
from wsserver.aio.peer import PeerAwareConnection, detached_bound, resume_tail_bytes
from wsserver.aio.pipeline import Generation
from wsserver.core import pacing

PROMPT = "resume me"


def generate(request_id: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "type": "generate",
        "id": request_id,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "seed": 7,
        "resumable": True,
        **extra,
    }


async def started_token(client: Wire, request_id: str) -> str:
    frames = await client.until(lambda f: f["type"] == "started" and f["id"] == request_id)
    token = frames[-1]["resume_token"]
    assert isinstance(token, str) and len(token) >= 22  # >= 128 bits, base64
    return token


async def deltas_through(client: Wire, request_id: str, seq: int) -> list[dict[str, Any]]:
    """Read until the delta ``seq`` of ``request_id``; its deltas so far."""
    await client.until(lambda f: f["type"] == "delta" and f["id"] == request_id and f["seq"] >= seq)
    return [f for f in client.frames if f["type"] == "delta" and f["id"] == request_id]


async def parked(server: Server) -> None:
    """Wait until the server has detached a request from its lost connection."""
    async with asyncio.timeout(timeout()):
        await server.resumes.parked_event.wait()
    server.resumes.parked_event.clear()


async def socket_full(server: Server, request_id: str) -> Generation:
    """Wait until the client's socket is full: the server's sends wait."""
    (connection,) = server.connections.values()
    ws = connection.ws
    assert isinstance(ws, PeerAwareConnection)
    async with asyncio.timeout(timeout(20)):
        await ws.writing_paused.wait()
    return connection.generations[request_id]


async def until_done(client: Wire, request_id: str) -> None:
    """Read to the done (``Wire.done`` would check that seq starts at 0)."""
    await client.until(lambda f: f["type"] == "done" and f["id"] == request_id, units=30)


async def resume_to_done(
    server: Server, request_id: str, token: str, after_seq: int
) -> list[dict[str, Any]]:
    """Resume on a new connection; the frames of ``request_id`` up to its done."""
    async with wire(server) as client:
        await client.send(
            {"type": "resume", "id": request_id, "resume_token": token, "after_seq": after_seq}
        )
        await until_done(client, request_id)
        return [f for f in client.frames if f.get("id") == request_id]


def check_whole(
    before: list[dict[str, Any]], after: list[dict[str, Any]], max_tokens: int, after_seq: int
) -> None:
    """No gap, no duplicate, seq contiguous, the text of an uninterrupted run."""
    assert after[0] == {"type": "resumed", "id": after[0]["id"], "after_seq": after_seq}
    kept = [d for d in before if d["seq"] <= after_seq]
    replayed = [f for f in after if f["type"] == "delta"]
    seqs = [d["seq"] for d in kept + replayed]
    assert seqs == list(range(len(seqs)))
    text = "".join(d["text"] for d in kept + replayed)
    assert text == expected_fake_text(PROMPT, max_tokens, seed=7)
    dones = [f for f in after if f["type"] == "done"]
    assert len(dones) == 1 and after[-1] is dones[0]
    assert dones[0]["reason"] == "length"
    assert dones[0]["usage"]["completion_tokens"] == max_tokens


@pytest.mark.parametrize("loss", ["abort", "close"])
async def test_a_lost_connection_resumes_with_the_whole_text(loss: str) -> None:
    max_tokens = 120
    async with running_server(backend__fake__tokens_per_s=400.0) as server:
        async with wire(server) as client:
            await client.send(generate("r1", max_tokens))
            token = await started_token(client, "r1")
            before = await deltas_through(client, "r1", 3)
            if loss == "abort":
                client.ws.transport.abort()  # TCP reset: no close frame
            else:
                await client.ws.close()
        await parked(server)
        after_seq = before[-1]["seq"]
        after = await resume_to_done(server, "r1", token, after_seq)
        check_whole(before, after, max_tokens, after_seq)
        # An older after_seq than the client's last gets the overlap again:
        # the client decides what it saw.
        assert not server.resumes.detached()


async def test_resume_after_the_engine_paused_on_a_full_channel() -> None:
    max_tokens = 5000
    async with running_server(
        backend__fake__tokens_per_s=0.0, stream__queue_tokens=16, stream__resumable=True
    ) as server:
        async with wire(server) as client:
            # No "resumable" in the frame: the server's default says so.
            frame = generate("r2", max_tokens)
            del frame["resumable"]
            await client.send(frame)
            token = await started_token(client, "r2")
            before = await deltas_through(client, "r2", 0)
            client.ws.transport.abort()
        await parked(server)
        (generation,) = server.resumes.detached()
        blocked = await asyncio.to_thread(generation.channel.blocked.wait, timeout())
        assert blocked, "the engine did not pause on the detached request's full channel"
        # Paused, not running on: the channel is full and stays bounded.
        assert generation.channel.buffered_bytes() <= 16 * 256
        assert generation.alive()
        after = await resume_to_done(server, "r2", token, before[-1]["seq"])
        check_whole(before, after, max_tokens, before[-1]["seq"])


async def test_a_detached_request_holds_no_more_than_its_stated_bound() -> None:
    """Worst case: a client that read nothing, so everything sent is unconfirmed."""
    max_tokens = 10**6
    # Unpaced frames from a large channel: the socket fills in a moment.
    async with running_server(
        backend__fake__tokens_per_s=0.0, stream__queue_tokens=1024, stream__flush_ms=0.0
    ) as server:
        bound = detached_bound(server.config)
        async with slow_wire(server) as client:
            await client.send(generate("r3", max_tokens))
            token = await started_token(client, "r3")
            client.ws.transport.pause_reading()  # from now on, read nothing
            generation = await socket_full(server, "r3")
            client.ws.transport.abort()
        await parked(server)
        assert await asyncio.to_thread(generation.channel.blocked.wait, timeout())
        held = server.resumes.held_bytes()
        assert 0 < held <= bound, (held, bound)
        (record,) = server.resumes._all()
        assert record.parked is not None
        assert record.parked.held_bytes() <= resume_tail_bytes(server.config)
        sent = record.parked.next_seq
        # Everything sent is still kept: the tail covers a client that read nothing.
        async with wire(server) as again:
            await again.send({"type": "resume", "id": "r3", "resume_token": token, "after_seq": -1})
            await again.until(lambda f: f["type"] == "delta" and f["seq"] >= sent)
            await again.send({"type": "cancel", "id": "r3"})
            await until_done(again, "r3")
            deltas = [f for f in again.frames if f["type"] == "delta"]
            assert [d["seq"] for d in deltas] == list(range(len(deltas)))
            text = "".join(d["text"] for d in deltas)
        assert expected_fake_text(PROMPT, max_tokens // 5, seed=7).startswith(text)


async def test_an_after_seq_older_than_the_tail_is_refused_and_nothing_is_touched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A tail of 8 KiB, smaller than what the socket took: the oldest deltas are
    # gone. Frames are capped at 1,000 characters here (at most ~3 KiB) so the
    # tail always holds whole frames; flat out, one frame may otherwise carry
    # up to FRAME_TEXT_CHARS, more than this tiny budget (the default budget,
    # 288 KiB, is far above a maximal frame).
    monkeypatch.setattr(pacing, "FRAME_TEXT_CHARS", 1000)
    max_tokens = 10**6
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        stream__queue_tokens=1024,
        stream__flush_ms=0.0,
        stream__resume_tail_bytes=8192,
    ) as server:
        async with slow_wire(server) as client:
            await client.send(generate("r4", max_tokens))
            token = await started_token(client, "r4")
            client.ws.transport.pause_reading()
            generation = await socket_full(server, "r4")
            client.ws.transport.abort()
        await parked(server)
        (record,) = server.resumes._all()
        assert record.parked is not None
        assert 0 < record.parked.held_bytes() <= 8192
        async with wire(server) as other:
            for after_seq in (-1, 10**9):
                await other.send(
                    {"type": "resume", "id": "r4", "resume_token": token, "after_seq": after_seq}
                )
                error = await other.recv()
                assert error["type"] == "error" and error["code"] == "seq_out_of_range"
                assert error["id"] == "r4"
            # Still detached, still resumable from what the tail keeps.
            assert server.resumes.detached() == [generation]
            last = record.parked.next_seq - 1
            await other.send(
                {"type": "resume", "id": "r4", "resume_token": token, "after_seq": last}
            )
            await other.until(lambda f: f["type"] == "delta" and f["seq"] >= last + 5)
            await other.send({"type": "cancel", "id": "r4"})
            await until_done(other, "r4")
            frames = [f for f in other.frames if f.get("id") == "r4"]
            assert frames[2] == {"type": "resumed", "id": "r4", "after_seq": last}
            deltas = [f for f in frames if f["type"] == "delta"]
            assert [d["seq"] for d in deltas] == list(range(last + 1, last + 1 + len(deltas)))
            assert frames[-1]["type"] == "done" and frames[-1]["reason"] == "cancelled"


async def test_grace_expiry_cancels_and_frees_the_slot_for_the_next_request() -> None:
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        backend__fake__parallel=1,
        stream__queue_tokens=8,
        stream__resume_grace_s=0.05,
    ) as server:
        async with wire(server) as first:
            await first.send(generate("a", 100000))
            token = await started_token(first, "a")
            async with wire(server) as second:
                await second.send(generate("b", 10, resumable=False))
                queued = await second.recv()
                assert queued["type"] == "queued"  # "a" holds the only slot
                first.ws.transport.abort()
                # "a" waits detached, then its grace runs out: "b" starts.
                _, frames = await second.done("b")
                assert frames[1]["type"] == "started" and "resume_token" not in frames[1]
                assert frames[-1]["reason"] == "length"
        assert server.resumes.expired == 1
        assert not server.resumes.detached()
        async with wire(server) as late:
            await late.send({"type": "resume", "id": "a", "resume_token": token, "after_seq": -1})
            error = await late.recv()
            assert error["code"] == "unknown_id"


async def test_refused_resumes_unknown_wrong_token_attached_and_twice() -> None:
    async with running_server(backend__fake__tokens_per_s=200.0) as server:
        async with wire(server) as owner, wire(server) as other:
            await other.send({"type": "resume", "id": "x", "resume_token": "t", "after_seq": -1})
            assert (await other.recv())["code"] == "unknown_id"
            await owner.send(generate("r5", 100000))
            token = await started_token(owner, "r5")
            await other.send({"type": "resume", "id": "r5", "resume_token": "no", "after_seq": -1})
            assert (await other.recv())["code"] == "invalid_token"
            # Attached to its live connection: refused, and the stream goes on there.
            await other.send({"type": "resume", "id": "r5", "resume_token": token, "after_seq": -1})
            assert (await other.recv())["code"] == "already_attached"
            before = await deltas_through(owner, "r5", 2)
            owner.ws.transport.abort()
            await parked(server)
            after_seq = before[-1]["seq"]
            await other.send(
                {"type": "resume", "id": "r5", "resume_token": token, "after_seq": after_seq}
            )
            await other.until(lambda f: f["type"] == "resumed")
            async with wire(server) as third:
                # Twice: the first resume holds it now.
                await third.send(
                    {"type": "resume", "id": "r5", "resume_token": token, "after_seq": after_seq}
                )
                assert (await third.recv())["code"] == "already_attached"
                # Cancel by token while attached elsewhere is refused too.
                await third.send({"type": "cancel", "id": "r5", "resume_token": token})
                assert (await third.recv())["code"] == "already_attached"
            await other.send({"type": "cancel", "id": "r5"})
            await until_done(other, "r5")
            frames = [f for f in other.frames if f.get("id") == "r5"]
            assert frames[-1]["reason"] == "cancelled"
            seqs = [f["seq"] for f in frames if f["type"] == "delta"]
            assert seqs == list(range(after_seq + 1, after_seq + 1 + len(seqs)))


async def test_cancel_of_a_detached_request_from_another_connection() -> None:
    async with running_server(
        backend__fake__tokens_per_s=0.0, backend__fake__parallel=1, stream__queue_tokens=8
    ) as server:
        async with wire(server) as owner:
            await owner.send(generate("r6", 100000))
            token = await started_token(owner, "r6")
            owner.ws.transport.abort()
        await parked(server)
        async with wire(server) as other:
            await other.send({"type": "cancel", "id": "r6", "resume_token": "wrong"})
            assert (await other.recv())["code"] == "invalid_token"
            await other.send({"type": "cancel", "id": "r6"})
            assert (await other.recv())["code"] == "unknown_id"  # no token: not its request
            await other.send({"type": "cancel", "id": "r6", "resume_token": token})
            done = await other.recv()
            assert done["type"] == "done" and done["id"] == "r6"
            assert done["reason"] == "cancelled"
            # The slot is free: the next request runs.
            await other.send(generate("next", 5, resumable=False))
            _, frames = await other.done("next")
            assert frames[-1]["reason"] == "length"
        assert not server.resumes.detached()


async def test_a_request_that_is_not_resumable_gets_no_token_and_ends_with_its_connection() -> None:
    async with running_server(
        backend__fake__tokens_per_s=0.0, stream__queue_tokens=8, stream__resumable=True
    ) as server:
        async with wire(server) as client:
            await client.send(generate("plain", 100000, resumable=False))
            frames = await client.until(lambda f: f["type"] == "started")
            assert "resume_token" not in frames[-1]
            generation = server.connections[next(iter(server.connections))].generations["plain"]
            client.ws.transport.abort()
        assert generation.task is not None
        async with asyncio.timeout(timeout()):
            await generation.task
        assert generation.stopped and not server.resumes.detached()


async def test_a_detached_request_stalled_on_its_full_channel_gives_its_slot_up() -> None:
    """Issue 26, fault 6: a dropped resumable request held the only slot for
    its whole grace; detached is judged as slow, by the stall rule."""
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        backend__fake__parallel=1,
        stream__queue_tokens=8,
        stream__resume_grace_s=timeout(1000),
        stream__stall_timeout_s=0.2 * timeout(1),
    ) as server:
        async with wire(server) as first:
            await first.send(generate("a", 100000))
            token = await started_token(first, "a")
            first.ws.transport.abort()
            await parked(server)
        async with wire(server) as second:
            await second.send(generate("b", 10, resumable=False))
            _, frames = await second.done("b")
            assert frames[-1]["reason"] == "length"
        assert server.resumes.stalled == 1
        assert not server.resumes.detached()
        async with wire(server) as late:
            await late.send({"type": "resume", "id": "a", "resume_token": token, "after_seq": -1})
            assert (await late.recv())["code"] == "unknown_id"


@pytest.mark.parametrize("cap", ["stream__max_detached", "stream__max_detached_per_client"])
async def test_detached_requests_are_capped_in_total_and_per_client(cap: str) -> None:
    """Issue 26, fault 6: one request lost beyond the cap is cancelled at once."""
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        stream__queue_tokens=8,
        stream__resume_grace_s=timeout(1000),
        **{cap: 1},
    ) as server:
        for request_id in ("a", "b"):
            async with wire(server) as client:
                await client.send(generate(request_id, 100000))
                await started_token(client, request_id)
                (connection,) = server.connections.values()
                generation = connection.generations[request_id]
                client.ws.transport.abort()
                if request_id == "a":
                    await parked(server)
                else:
                    assert generation.task is not None
                    await asyncio.wait_for(asyncio.shield(generation.task), timeout())
        assert [g.request.id for g in server.resumes.detached()] == ["a"]
