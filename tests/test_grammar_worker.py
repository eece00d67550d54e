"""The grammar worker (wsserver.backends.grammar_worker): a task's result
reaches the waiting thread through its condition; a task given up on keeps
running, and its cleanup runs when it returns — never before, never twice."""

from __future__ import annotations

import threading

import pytest
from conftest import timeout

from wsserver.backends.grammar_worker import GrammarWorker


def test_a_task_runs_and_wakes_the_waiting_thread() -> None:
    changed = threading.Condition(threading.RLock())
    worker = GrammarWorker(changed)
    worker.start(lambda: 42)
    with changed:
        assert changed.wait_for(lambda: worker.done, timeout(10))
    assert worker.result() == 42
    worker.start(lambda: 1 // 0)
    with changed:
        assert changed.wait_for(lambda: worker.done, timeout(10))
    with pytest.raises(ZeroDivisionError):
        worker.result()
    worker.close()
    assert not worker.alive()


def test_a_task_given_up_on_cleans_up_when_it_returns_and_its_thread_ends() -> None:
    changed = threading.Condition(threading.RLock())
    worker = GrammarWorker(changed)
    inside, leave = threading.Event(), threading.Event()
    cleaned: list[str] = []

    def stuck() -> None:  # a native call that does not return (yet)
        inside.set()
        leave.wait(timeout(30))

    worker.start(stuck)
    assert inside.wait(timeout(10))
    worker.abandon(lambda: cleaned.append("freed"))
    assert worker.alive() and not worker.done and cleaned == []
    assert worker._thread.name.endswith("-abandoned")
    leave.set()
    worker._thread.join(timeout(10))
    assert not worker.alive()
    assert cleaned == ["freed"]
    assert not worker.done  # the engine never reads an abandoned task's result


def test_giving_up_on_a_task_that_just_returned_cleans_up_at_once() -> None:
    changed = threading.Condition(threading.RLock())
    worker = GrammarWorker(changed)
    worker.start(lambda: None)
    with changed:
        assert changed.wait_for(lambda: worker.done, timeout(10))
    cleaned: list[str] = []
    worker.abandon(lambda: cleaned.append("freed"), overdue=False)
    assert cleaned == ["freed"]
    worker._thread.join(timeout(10))
    assert not worker.alive()
