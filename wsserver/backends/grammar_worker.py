"""A thread for the engine's grammar work, which the engine may stop waiting for.

llama.cpp's grammar engine runs inside native calls that nothing interrupts,
and an ambiguous grammar can make one such call last for ever (its parse
stacks multiply with the text: :mod:`.grammar_bounds` refuses the shapes
known to do it, but not every such grammar can be told from its shape). So
the batched engine does not make those calls on its own thread: it hands a
sequence's grammar-constrained sampling to a :class:`GrammarWorker` and waits
for it — at most ``deadline`` seconds, and no longer once the request is
cancelled. Past that the engine **abandons** the worker: the request ends,
every other stream goes on, and a new worker takes the next sequence's work.

An abandoned worker's thread goes on inside its native call (it cannot be
stopped; it keeps a core busy until the call returns, if ever). What that
call uses stays its own: the task is given everything it touches (its
candidate buffers, a copy of the logits, the request's samplers), and when
the call returns the thread runs the task's ``cleanup`` (freeing those
samplers) and ends. The model it reads must outlive it: see
:meth:`GrammarWorker.alive` and the engine's ``close``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["GrammarWorker"]

log = logging.getLogger("wsserver.llama")


class GrammarWorker:
    """One thread that runs one task at a time for a waiting engine thread.

    ``changed`` is the engine's condition: a finished task notifies it, so the
    engine can wait for the task and for a cancel on one condition.
    """

    _count = 0

    def __init__(self, changed: threading.Condition) -> None:
        self._changed = changed
        self._lock = threading.Condition()
        self._task: Callable[[], Any] | None = None
        self._cleanup: Callable[[], None] | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        #: The task handed last has returned (or raised).
        self.done = True
        self.abandoned = False
        self._overdue = False
        self._closed = False
        GrammarWorker._count += 1
        self._thread = threading.Thread(
            target=self._run, name=f"wsserver-llama-grammar-{GrammarWorker._count}", daemon=True
        )
        self._thread.start()

    def start(self, task: Callable[[], Any]) -> None:
        """Run ``task`` on the thread; :attr:`done` turns True when it returns."""
        with self._lock:
            assert self.done and not self.abandoned, "one task at a time"
            self._task = task
            self._result = self._error = None
            self.done = False
            self._lock.notify()

    def result(self) -> Any:
        """The finished task's value (or its exception, raised here)."""
        assert self.done
        if self._error is not None:
            raise self._error
        return self._result

    def abandon(self, cleanup: Callable[[], None], *, overdue: bool = True) -> None:
        """Stop waiting for the running task: when it returns, ``cleanup``
        runs on the thread, which then ends. ``overdue``: given up on for its
        deadline (its return is logged), not for a cancel."""
        with self._lock:
            self.abandoned = True
            self._overdue = overdue
            self._thread.name += "-abandoned"
            finished = self.done
            if not finished:
                self._cleanup = cleanup
        if finished:  # it returned just now: nothing runs on
            cleanup()
            self.close()

    def alive(self) -> bool:
        """Whether the thread still runs (an abandoned task still inside its call)."""
        return self._thread.is_alive()

    def close(self) -> None:
        """End an idle worker's thread, and wait for it (an abandoned one
        ends by itself when its call returns)."""
        with self._lock:
            self._closed = True
            self._lock.notify()
            abandoned = self.abandoned
        if not abandoned and self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def _run(self) -> None:
        while True:
            with self._lock:
                while self._task is None and not self._closed:
                    self._lock.wait()
                if self._task is None:
                    return
                task, self._task = self._task, None
            result: Any = None
            error: BaseException | None = None
            try:
                result = task()
            except BaseException as exc:  # handed to the engine thread
                error = exc
            with self._lock:
                self._result, self._error = result, error
                abandoned, cleanup = self.abandoned, self._cleanup
                if not abandoned:
                    self.done = True
            if abandoned:
                if self._overdue:
                    log.warning("a grammar computation given up on returned; its thread ends")
                if cleanup is not None:
                    try:
                        cleanup()
                    except Exception:
                        log.exception("freeing an abandoned grammar computation failed")
                return
            with self._changed:
                self._changed.notify_all()
