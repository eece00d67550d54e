"""Fair sharing of the model's slots across connections.

An engine runs a fixed number of generations at once (the llama backend:
sequences decoded together in one context; the openai backend: upstream
streams), so a backend offers that many *slots*. Requests from every
connection wait for one in a single queue; each waiter is told its 1-based
position whenever it changes (the ``queued`` frame). More than
``max_waiting`` waiters → ``overloaded``. Until the model has loaded no slot
is handed out, so requests that arrive during a load simply wait their turn.

**Fair by owner.** Each waiter names its *owner* (the connection it came
on). A free slot goes to the waiter whose owner holds the fewest slots —
counting, for an owner's later waiters, the ones before them as if already
served — then whose owner was last given a slot longest ago (never: first),
then to the one that came first. Requests of different connections that
hold nothing are served first come, first served, as a FIFO; but one
connection with many requests at once (the Responses API's WebSocket mode
has lanes) cannot put them all ahead of a client that came after: the
connections take turns, one slot each. Positions are that order. An owner
is remembered only while it holds a slot or waits for one.

Every interleaving of acquire, cancel and release must keep the books:
free slots + held slots = capacity, and every waiter is served once or
cancelled, never both. The subtle case is a waiter cancelled *before* a
release hands it a slot: ``Task.cancel()`` cancels the future the task waits
on at once, but the task leaves the queue only on a later loop turn, when it
runs its ``except CancelledError``. So a release must skip waiters whose future
is already done, and a cancelled waiter must leave the queue only if it is
still in it. (The opposite order — the slot handed over, then the task
cancelled before it resumes — is the waiter's to undo: it gives the slot back.)
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from ..errors import ProtocolError

__all__ = ["Scheduler"]

PositionCallback = Callable[[int], None]


@dataclass(eq=False, slots=True)
class _Waiter:
    future: asyncio.Future[int]
    on_position: PositionCallback
    request_id: str
    owner: Hashable
    #: Order of arrival (ties between owners holding as many slots).
    arrival: int
    position: int = field(default=0)


class Scheduler:
    """FIFO of requests waiting for one of ``slots`` slots (0 = unlimited)."""

    def __init__(self, slots: int, max_waiting: int, *, ready: bool = True) -> None:
        self._unlimited = slots <= 0
        self._free: list[int] = list(range(slots)) if slots > 0 else []
        self._next_unlimited = 0
        self._busy: set[int] = set()
        #: Who holds each slot handed out, and how many each owner holds.
        self._holders: dict[int, Hashable] = {}
        self._held: Counter[Hashable] = Counter()
        #: When each owner was last given a slot (a count of grants).
        self._last_grant: dict[Hashable, int] = {}
        self._grants = itertools.count()
        self._max_waiting = max_waiting
        self._waiters: deque[_Waiter] = deque()
        self._arrivals = itertools.count()
        self._ready = ready

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def busy(self) -> int:
        return len(self._busy)

    @property
    def free(self) -> int:
        """Slots that can be handed out now (0 with unlimited slots)."""
        return len(self._free)

    def held(self) -> frozenset[int]:
        """The slots handed out and not yet released."""
        return frozenset(self._busy)

    @property
    def ready(self) -> bool:
        return self._ready

    def open(self) -> None:
        """The model is loaded: start handing out slots."""
        self._ready = True
        self._dispatch()

    def close(self) -> None:
        """The model is being unloaded: hand out no slot until :meth:`open`.
        Requests that come meanwhile wait (the registry loads it again)."""
        assert not self._busy, "a model with running requests is never unloaded"
        self._ready = False

    def fail(self, error: ProtocolError) -> None:
        """The model could not be loaded: every waiting request is refused
        with ``error`` (each with its own id); the queue is empty after."""
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.future.done():
                waiter.future.set_exception(
                    ProtocolError(error.code, error.message, waiter.request_id)
                )

    async def acquire(
        self, request_id: str, on_position: PositionCallback, owner: Hashable = None
    ) -> int:
        """Wait for a slot and return it. ``owner``: the connection the request
        came on (see "Fair by owner"). Cancelling the wait leaves the queue."""
        if self._ready and not self._waiters:
            slot = self._take(owner)
            if slot is not None:
                return slot
        if len(self._waiters) >= self._max_waiting:
            raise ProtocolError(
                "overloaded",
                f"{len(self._waiters)} requests are already waiting for the model",
                request_id,
            )
        waiter = _Waiter(
            asyncio.get_running_loop().create_future(),
            on_position,
            request_id,
            owner,
            next(self._arrivals),
        )
        self._waiters.append(waiter)
        self._announce()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if (
                waiter.future.done()
                and not waiter.future.cancelled()
                and waiter.future.exception() is None
            ):
                # The slot was handed over just as we were cancelled: give it back.
                self.release(waiter.future.result())
            elif waiter in self._waiters:
                # A release in between may already have skipped (and dropped) us.
                self._waiters.remove(waiter)
                self._announce()
            raise

    def release(self, slot: int) -> None:
        if slot not in self._busy:
            # Releasing twice would hand one slot to two requests.
            raise ValueError(f"slot {slot} is not held")
        self._busy.discard(slot)
        owner = self._holders.pop(slot)
        self._held[owner] -= 1
        if not self._held[owner]:
            del self._held[owner]
        if not self._unlimited:
            self._free.append(slot)
            self._free.sort()
        self._dispatch()

    def _take(self, owner: Hashable) -> int | None:
        if self._unlimited:
            slot = self._next_unlimited
            self._next_unlimited += 1
        elif self._free:
            slot = self._free.pop(0)
        else:
            return None
        self._busy.add(slot)
        self._holders[slot] = owner
        self._held[owner] += 1
        self._last_grant[owner] = next(self._grants)
        return slot

    def _dispatch(self) -> None:
        if not self._ready:
            return
        if any(waiter.future.done() for waiter in self._waiters):
            # Cancelled, their tasks not yet resumed: they must not get a slot.
            self._waiters = deque(w for w in self._waiters if not w.future.done())
        while self._waiters:
            waiter = self._order()[0]
            slot = self._take(waiter.owner)
            if slot is None:
                break
            self._waiters.remove(waiter)
            waiter.future.set_result(slot)
        self._announce()

    def reannounce(self) -> None:
        """Tell every waiter its position again (what goes with it changed:
        its model's download progressed)."""
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.on_position(waiter.position)

    def _order(self) -> list[_Waiter]:
        """The waiters in the order they will be served (see "Fair by owner")."""
        ahead: Counter[Hashable] = Counter()
        keyed = []
        for waiter in self._waiters:
            owner = waiter.owner
            turn = self._last_grant.get(owner, -1)
            keyed.append((self._held[owner] + ahead[owner], turn, waiter.arrival, waiter))
            ahead[owner] += 1
        keyed.sort(key=lambda entry: entry[:3])
        return [entry[3] for entry in keyed]

    def _announce(self) -> None:
        waiting = {waiter.owner for waiter in self._waiters}
        for owner in [o for o in self._last_grant if not self._held[o] and o not in waiting]:
            del self._last_grant[owner]
        for index, waiter in enumerate(self._order(), start=1):
            if waiter.position != index:
                waiter.position = index
                waiter.on_position(index)
