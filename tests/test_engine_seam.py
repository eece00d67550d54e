"""The engine seam (wsserver/backends/base.py) holds for an engine without threads.

The fake and llama backends are thread-per-request engines and are tested
everywhere else. Here a small *async* engine — one task per request on the
event loop, as a relay to an upstream server would be — runs behind the real
server, over real sockets: it never blocks, it waits for room instead
(``offer`` / ``when_room``), and cancel reaches its task at once. Also the
channel's side of the contract, directly: an end always fits, nothing gets
through after a cancel, and a waiter for room is woken by room or by cancel.
"""

from __future__ import annotations

import asyncio

from conftest import make_config, slow_wire, timeout, wire

from wsserver.aio import Server
from wsserver.aio.channel import Call, Channel, End, Piece, PromptDone
from wsserver.backends.base import (
    Backend,
    CancelEvent,
    GenerationRequest,
    Outcome,
    Sink,
    Submission,
)
from wsserver.core.call_parts import CallPart
from wsserver.errors import GenerationCancelled


class AsyncEngine(Backend):
    """Streams ``w0 w1 …`` from a task on the loop; waits for room, never blocks."""

    model_name = "async-engine"

    def __init__(self, slots: int = 2) -> None:
        self.slots = slots
        #: Times a request found its channel full and waited for room.
        self.waits = 0
        self.cancelled: set[str] = set()
        self.cancelled_event = asyncio.Event()

    def submit(
        self, request: GenerationRequest, *, slot: int, sink: Sink, cancel: CancelEvent
    ) -> Submission:
        loop = asyncio.get_running_loop()
        submission = Submission()
        task = loop.create_task(self._run(request, sink))
        cancel.add_callback(lambda: loop.call_soon_threadsafe(task.cancel))
        task.add_done_callback(lambda _: submission.complete())
        return submission

    async def _run(self, request: GenerationRequest, sink: Sink) -> None:
        loop = asyncio.get_running_loop()
        sink.prompt_processed(3)
        try:
            for n in range(request.max_tokens):
                while not sink.offer(f"w{n} ", 1):
                    # Full: stop reading "upstream" for this request alone.
                    self.waits += 1
                    room: asyncio.Future[None] = loop.create_future()
                    sink.when_room(lambda room=room: loop.call_soon_threadsafe(_resolve, room))
                    await room
            sink.end(Outcome("length", 3, request.max_tokens))
        except asyncio.CancelledError:
            self.cancelled.add(request.id)
            self.cancelled_event.set()
            raise


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def expected(n: int) -> str:
    return "".join(f"w{i} " for i in range(n))


async def _serve(engine: AsyncEngine, **overrides: object) -> Server:
    server = Server(make_config(**overrides), engine)
    await server.start()
    async with asyncio.timeout(timeout(20)):
        await server.wait_ready()
    return server


async def test_an_async_engine_streams_behind_the_seam() -> None:
    server = await _serve(AsyncEngine())
    try:
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "a", "prompt": "p", "max_tokens": 300})
            text, frames = await client.done("a")
        assert text == expected(300)
        done = frames[-1]
        assert done["reason"] == "length"
        assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 300, "cached_tokens": 0}
        assert client.hello is not None and client.hello["model"] == "async-engine"
    finally:
        await server.stop(grace=0)


async def test_a_full_channel_pauses_only_its_own_request() -> None:
    engine = AsyncEngine(slots=2)
    server = await _serve(engine, stream__queue_tokens=4)
    try:
        async with slow_wire(server) as slow, wire(server) as fast:
            await slow.send({"type": "generate", "id": "s", "prompt": "p", "max_tokens": 10**6})
            await slow.until(lambda f: f["type"] == "delta")
            slow.ws.transport.pause_reading()  # from now on, read nothing
            (connection,) = [c for c in server.connections.values() if "s" in c.generations]
            channel = connection.generations["s"].channel
            assert await asyncio.to_thread(channel.blocked.wait, timeout(20))
            assert engine.waits > 0  # the engine was told "full" and waited, on the loop
            # Until the kernel's and the transport's buffers are full too, room
            # reappears now and then. They are finite: soon the slow request
            # stays paused — no token for it — while another one, on the same
            # engine and loop, runs from start to end.
            for attempt in range(50):
                assert await asyncio.to_thread(channel.blocked.wait, timeout(20))
                before = channel.tokens
                request_id = f"f{attempt}"
                await fast.send(
                    {"type": "generate", "id": request_id, "prompt": "p", "max_tokens": 500}
                )
                text, _ = await fast.done(request_id)
                assert text == expected(500)
                if channel.tokens == before and channel.blocked.is_set():
                    break
            else:
                raise AssertionError("the slow request never stayed paused")
            assert channel.buffered_bytes() <= 4 * len("w999999 ")
            slow.ws.transport.abort()
    finally:
        await server.stop(grace=0)
    assert "s" in engine.cancelled


async def test_cancel_reaches_an_async_engine_at_once() -> None:
    engine = AsyncEngine(slots=1)
    server = await _serve(engine, stream__queue_tokens=4)
    try:
        async with slow_wire(server) as client:
            await client.send({"type": "generate", "id": "a", "prompt": "p", "max_tokens": 10**6})
            await client.until(lambda f: f["type"] == "delta")
            await client.send({"type": "cancel", "id": "a"})
            await client.until(lambda f: f["type"] == "done" and f["id"] == "a")
            async with asyncio.timeout(timeout()):
                await engine.cancelled_event.wait()
            # Its slot is free again: the next request on a 1-slot engine runs.
            await client.send({"type": "generate", "id": "b", "prompt": "p", "max_tokens": 5})
            text, frames = await client.done("b")
            assert text == expected(5)
            assert frames[-1]["reason"] == "length"
    finally:
        await server.stop(grace=0)
    assert engine.cancelled == {"a"}


# ---------------------------------------------------------------- the channel's contract


async def test_offer_says_full_and_when_room_wakes_on_room() -> None:
    channel = Channel(2)
    assert channel.offer("a") and channel.offer("b")
    assert not channel.offer("c")  # full: nothing taken
    assert channel.blocked.is_set()
    woken: list[str] = []
    channel.when_room(lambda: woken.append("room"))
    assert woken == []
    assert await channel.get() == Piece("a", 1)
    assert woken == ["room"] and not channel.blocked.is_set()
    channel.when_room(lambda: woken.append("at once"))  # there is room: called now
    assert woken == ["room", "at once"]
    assert channel.tokens == 2 and channel.blocked_seconds >= 0.0


async def test_a_call_part_takes_its_place_after_the_text_and_counts_toward_the_bound() -> None:
    """``offer_call`` (a call the engine parsed itself) is ``offer``'s twin:
    in order with the text, counted in pieces and in characters (its
    arguments'), refused when full or cancelled."""
    channel = Channel(2)
    part = CallPart(0, '{"a": 1}', "call_x", "add")
    assert channel.offer("Checking") and channel.offer_call(part, 2)
    assert not channel.offer_call(CallPart(0, "}"))  # full: nothing taken
    assert channel.buffered_bytes() == len("Checking") + len(part.arguments)
    assert [await channel.get(), await channel.get()] == [Piece("Checking", 1), Call(part, 2)]
    assert channel.tokens == 3 and channel.offer_call(CallPart(0, "}"))
    wide = Channel(4)
    assert wide.offer_call(CallPart(0, "x" * (wide.max_chars + 1)))  # the one that found room
    assert not wide.offer("a")  # ... and the bound in characters holds after it
    channel.close()
    assert not channel.offer_call(part)


async def test_an_end_always_fits_and_nothing_passes_a_cancel() -> None:
    channel = Channel(1)
    assert channel.offer("a")
    channel.prompt_processed(7)
    channel.end(Outcome("length", 7, 1))  # the channel is full, and it still fits
    channel.end(Outcome("stop"))  # one end per request: a second one is dropped
    assert [await channel.get() for _ in range(3)] == [
        Piece("a", 1),
        PromptDone(7),
        End(Outcome("length", 7, 1)),
    ]
    assert channel.get_nowait() is None

    cancelled = Channel(1)
    woken: list[str] = []
    assert cancelled.offer("x")
    cancelled.when_room(lambda: woken.append("cancel"))
    cancelled.close()
    assert woken == ["cancel"]  # a waiter for room is woken by the cancel too
    assert not cancelled.offer("late")
    cancelled.end(Outcome("length"))
    try:
        cancelled.emit("late")
    except GenerationCancelled:
        pass
    else:
        raise AssertionError("emit after a cancel must raise")
    assert await cancelled.get() is None  # closed: what was queued is discarded


async def test_a_blocked_emit_wakes_on_room_and_on_cancel() -> None:
    channel = Channel(1)
    channel.emit("a")
    emitted = asyncio.create_task(asyncio.to_thread(channel.emit, "b"))
    assert await asyncio.to_thread(channel.blocked.wait, timeout())
    assert await channel.get() == Piece("a", 1)
    await asyncio.wait_for(emitted, timeout())
    assert await channel.get() == Piece("b", 1)

    channel.emit("c")
    stuck = asyncio.create_task(asyncio.to_thread(channel.emit, "d"))
    assert await asyncio.to_thread(channel.blocked.wait, timeout())
    channel.close()
    try:
        await asyncio.wait_for(stuck, timeout())
    except GenerationCancelled:
        pass
    else:
        raise AssertionError("a blocked emit must raise on cancel")
