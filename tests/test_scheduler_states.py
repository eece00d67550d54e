"""A hypothesis state machine over acquire / cancel / release / loop turns.

The loop is driven one turn at a time, so hypothesis explores the orders in
which a cancelled waiter's cleanup, a handover and a release can interleave —
the orders that a real server hits only by chance.
"""

from __future__ import annotations

import asyncio

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from wsserver.aio.scheduler import Scheduler
from wsserver.errors import ProtocolError


def one_turn(loop: asyncio.AbstractEventLoop) -> None:
    loop.call_soon(loop.stop)
    loop.run_forever()


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.capacity = 2
        self.scheduler = Scheduler(self.capacity, 4)
        self.tasks: list[asyncio.Task[int]] = []
        #: Slots whose owner (a finished acquire) has not released them yet.
        self.granted: dict[int, int] = {}  # task index -> slot
        self.released: set[int] = set()  # task indexes whose slot went back
        self.overloaded = 0

    @rule()
    def acquire(self) -> None:
        task = self.loop.create_task(self.scheduler.acquire(str(len(self.tasks)), lambda p: None))
        self.tasks.append(task)

    @rule(data=st.data())
    @precondition(lambda self: any(not t.done() for t in self.tasks))
    def cancel(self, data: st.DataObject) -> None:
        live = [t for t in self.tasks if not t.done()]
        data.draw(st.sampled_from(live)).cancel()

    @rule(data=st.data())
    @precondition(lambda self: bool(self._holders()))
    def release(self, data: st.DataObject) -> None:
        index = data.draw(st.sampled_from(sorted(self._holders())))
        self.scheduler.release(self.tasks[index].result())
        self.released.add(index)

    @rule()
    def turn(self) -> None:
        one_turn(self.loop)

    def _holders(self) -> set[int]:
        out = set()
        for index, task in enumerate(self.tasks):
            if index in self.released or not task.done() or task.cancelled():
                continue
            if task.exception() is not None:
                assert isinstance(task.exception(), ProtocolError)  # overloaded
                continue
            out.add(index)
        return out

    @invariant()
    def books_balance(self) -> None:
        scheduler = self.scheduler
        assert scheduler.free + scheduler.busy == self.capacity
        holders = self._holders()
        slots = [self.tasks[i].result() for i in holders]
        # Every held slot has exactly one finished acquire that owns it.
        assert len(slots) == len(set(slots))
        assert set(slots) <= scheduler.held()
        # A slot held by nobody is one in flight to a waiter that has not resumed.
        in_flight = scheduler.held() - set(slots)
        assert len(in_flight) <= sum(1 for t in self.tasks if not t.done())

    def teardown(self) -> None:
        try:
            for task in self.tasks:
                if not task.done():
                    task.cancel()
            for _ in range(5):
                one_turn(self.loop)
            assert all(t.done() for t in self.tasks)
            for index in self._holders():
                self.scheduler.release(self.tasks[index].result())
            # Every waiter was served once or cancelled; nothing leaked.
            assert (self.scheduler.free, self.scheduler.busy) == (self.capacity, 0)
            assert self.scheduler.waiting == 0
        finally:
            self.loop.close()


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
test_scheduler_state_machine = SchedulerMachine.TestCase
