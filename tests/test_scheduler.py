"""The model-slot FIFO (asyncio, no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from wsserver.aio.scheduler import Scheduler
from wsserver.errors import ProtocolError


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


async def test_cancel_before_a_release_skips_the_cancelled_waiter() -> None:
    """The wedge found by attacking 0.1.0: B is cancelled, and before B's task
    resumes to leave the queue, A's release runs. B must not get the slot."""
    scheduler = Scheduler(1, 10)
    slot = await scheduler.acquire("a", lambda p: None)
    pb = Positions()
    b = asyncio.create_task(scheduler.acquire("b", pb))
    await pb.changed()
    b.cancel()  # B's future is cancelled now; its task runs its cleanup later
    scheduler.release(slot)  # must skip B, not hand it the slot
    with pytest.raises(asyncio.CancelledError):
        await b
    assert (scheduler.busy, scheduler.free, scheduler.waiting) == (0, 1, 0)
    assert await scheduler.acquire("c", lambda p: None) == slot


async def test_cancel_before_release_with_a_live_waiter_behind() -> None:
    scheduler = Scheduler(1, 10)
    slot = await scheduler.acquire("a", lambda p: None)
    pb, pc = Positions(), Positions()
    b = asyncio.create_task(scheduler.acquire("b", pb))
    await pb.changed()
    c = asyncio.create_task(scheduler.acquire("c", pc))
    await pc.changed()
    b.cancel()
    scheduler.release(slot)  # skips B, serves C
    assert await c == slot
    with pytest.raises(asyncio.CancelledError):
        await b
    assert (scheduler.busy, scheduler.free, scheduler.waiting) == (1, 0, 0)


async def test_releasing_a_slot_twice_is_refused() -> None:
    scheduler = Scheduler(2, 10)
    slot = await scheduler.acquire("a", lambda p: None)
    scheduler.release(slot)
    with pytest.raises(ValueError):
        scheduler.release(slot)
    assert scheduler.free == 2


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_every_interleaving_of_two_waiters_keeps_the_books(capacity: int) -> None:
    """All orders of: cancel B, release a held slot, one loop turn — exhaustively."""
    import itertools

    actions = ["cancel_b", "cancel_c", "release", "turn", "turn"]
    for order in set(itertools.permutations(actions)):
        run_interleaving(capacity, order)


def run_interleaving(capacity: int, order: tuple[str, ...]) -> None:
    loop = asyncio.new_event_loop()
    try:
        scheduler = Scheduler(capacity, 10)
        held = [
            loop.run_until_complete(scheduler.acquire(f"h{n}", lambda p: None))
            for n in range(capacity)
        ]
        b = loop.create_task(scheduler.acquire("b", lambda p: None))
        c = loop.create_task(scheduler.acquire("c", lambda p: None))
        one_turn(loop)
        for action in order:
            if action == "cancel_b":
                b.cancel()
            elif action == "cancel_c":
                c.cancel()
            elif action == "release" and held:
                scheduler.release(held.pop())
            else:
                one_turn(loop)
        finish(loop, scheduler, held, [b, c], capacity, order)
    finally:
        loop.close()


def one_turn(loop: asyncio.AbstractEventLoop) -> None:
    """Run exactly the callbacks that are ready now: one turn of the loop."""
    loop.call_soon(loop.stop)
    loop.run_forever()


def finish(
    loop: asyncio.AbstractEventLoop,
    scheduler: Scheduler,
    held: list[int],
    tasks: list[asyncio.Task[int]],
    capacity: int,
    context: object,
) -> None:
    """Settle every task, release what was granted, and check the books."""
    for _ in range(5):
        one_turn(loop)
    served = [t.result() for t in tasks if t.done() and not t.cancelled()]
    pending = [t for t in tasks if not t.done()]
    assert scheduler.free + scheduler.busy == capacity, context
    assert set(served) | set(held) == scheduler.held(), context
    assert len(served) + len(held) == scheduler.busy, context
    for task in pending:
        task.cancel()
    for _ in range(3):
        one_turn(loop)
    assert all(t.done() for t in tasks), context
    for slot in held + served + [t.result() for t in pending if not t.cancelled()]:
        scheduler.release(slot)
    assert (scheduler.free, scheduler.busy, scheduler.waiting) == (capacity, 0, 0), context


async def test_a_free_slot_goes_to_the_owner_holding_the_fewest() -> None:
    """Fair by owner (issue 34): one connection's many requests (a Responses
    WebSocket's lanes) do not all go ahead of a client that came after; it
    gets a slot in turn. Between owners holding as many, first come first."""
    scheduler = Scheduler(1, 10)
    slot = await scheduler.acquire("x0", lambda p: None, "x")
    positions = {name: Positions() for name in ("x1", "x2", "x3", "y1", "z1")}
    tasks = {}
    for name in ("x1", "x2", "x3", "y1", "z1"):
        tasks[name] = asyncio.create_task(scheduler.acquire(name, positions[name], name[0]))
        await positions[name].changed()
    # x holds the slot: y and z, though later, come before x's next ones.
    assert {name: p.seen[-1] for name, p in positions.items()} == {
        "y1": 1,
        "z1": 2,
        "x1": 3,
        "x2": 4,
        "x3": 5,
    }
    order = []
    for _ in range(5):
        scheduler.release(slot)
        done, _ = await asyncio.wait(
            [t for t in tasks.values() if not t.done()], return_when=asyncio.FIRST_COMPLETED
        )
        (task,) = done
        order.append(next(name for name, t in tasks.items() if t is task))
        slot = task.result()
    assert order == ["y1", "z1", "x1", "x2", "x3"]
    scheduler.release(slot)
    assert (scheduler.free, scheduler.busy, scheduler.waiting) == (1, 0, 0)


async def test_owners_holding_nothing_are_served_first_come_first_served() -> None:
    scheduler = Scheduler(2, 10)
    held = [await scheduler.acquire(n, lambda p: None, "x") for n in ("x0", "x1")]
    tasks = []
    for name in "abc":
        queued = Positions()
        tasks.append(asyncio.create_task(scheduler.acquire(name, queued, name)))
        await queued.changed()
    scheduler.release(held[0])
    assert await tasks[0] == held[0]
    scheduler.release(held[1])
    assert await tasks[1] == held[1]
    scheduler.release(held[0])
    assert await tasks[2] == held[0]
