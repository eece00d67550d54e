"""The model-slot FIFO (asyncio, no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from wsserver.errors import ProtocolError
from wsserver.scheduler import Scheduler


class Positions:
    """Records a waiter's positions; ``await changed()`` waits for the next one."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self._event = asyncio.Event()

    def __call__(self, position: int) -> None:
        self.seen.append(position)
        self._event.set()

    async def changed(self) -> None:
        async with asyncio.timeout(10):
            await self._event.wait()
        self._event.clear()


async def test_fifo_positions_and_handover() -> None:
    scheduler = Scheduler(1, 10)
    pb, pc = Positions(), Positions()
    first = await scheduler.acquire("a", lambda p: None)
    b = asyncio.create_task(scheduler.acquire("b", pb))
    await pb.changed()
    c = asyncio.create_task(scheduler.acquire("c", pc))
    await pc.changed()
    assert scheduler.waiting == 2
    scheduler.release(first)
    assert await b == first
    scheduler.release(first)
    assert await c == first
    assert (pb.seen, pc.seen) == ([1], [2, 1])


async def test_leaving_the_queue_moves_the_others_up() -> None:
    scheduler = Scheduler(1, 10)
    slot = await scheduler.acquire("a", lambda p: None)
    pb, pc = Positions(), Positions()
    b = asyncio.create_task(scheduler.acquire("b", pb))
    await pb.changed()
    c = asyncio.create_task(scheduler.acquire("c", pc))
    await pc.changed()
    b.cancel()
    with pytest.raises(asyncio.CancelledError):
        await b
    assert pc.seen == [2, 1]
    scheduler.release(slot)
    assert await c == slot


async def test_overload_and_not_ready() -> None:
    scheduler = Scheduler(1, 1, ready=False)
    pa = Positions()
    waiting = asyncio.create_task(scheduler.acquire("a", pa))
    await pa.changed()
    with pytest.raises(ProtocolError) as info:
        await scheduler.acquire("b", lambda p: None)
    assert info.value.code == "overloaded" and info.value.request_id == "b"
    scheduler.open()
    assert await waiting == 0
    assert scheduler.busy == 1


async def test_unlimited_slots_never_wait() -> None:
    scheduler = Scheduler(0, 0)
    slots = [await scheduler.acquire(str(n), lambda p: None) for n in range(5)]
    assert len(set(slots)) == 5
    for slot in slots:
        scheduler.release(slot)
    assert scheduler.busy == 0


async def test_cancel_racing_a_handover_returns_the_slot() -> None:
    scheduler = Scheduler(1, 10)
    slot = await scheduler.acquire("a", lambda p: None)
    pb = Positions()
    b = asyncio.create_task(scheduler.acquire("b", pb))
    await pb.changed()
    scheduler.release(slot)  # b's future now holds the slot ...
    b.cancel()  # ... but b is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await b
    assert scheduler.busy == 0
    assert await scheduler.acquire("c", lambda p: None) == slot
