"""The two handles between the server and an engine, for every kind of request:
the :class:`CancelEvent` the server sets, the :class:`Submission` the engine
completes (sans-I/O, thread-safe; :mod:`.base` has the seam they serve)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["CancelEvent", "Submission"]


class CancelEvent(threading.Event):
    """A ``threading.Event`` that also runs callbacks, on the setting thread, when set.

    An engine registers a callback to mirror the cancel into its own state the
    instant it happens (the llama backend sets llama.cpp's abort flag; a
    batched engine marks the sequence; an async engine cancels its task
    through ``call_soon_threadsafe``) instead of keeping a thread blocked in
    ``wait()``. Callbacks must be quick and must not raise.
    """

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def add_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when the event is set — at once if it already is."""
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def remove_callback(self, callback: Callable[[], None]) -> None:
        with self._callbacks_lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def set(self) -> None:
        with self._callbacks_lock:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class Submission:
    """The handle of one submitted request: completed once, by the engine.

    Callbacks run on the completing thread (at once if already completed).
    The asyncio layer turns completion into a future and frees the slot then.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._callbacks: list[Callable[[], None]] = []

    def complete(self) -> None:
        """The engine is done with the request and its slot. Idempotent."""
        with self._lock:
            if self._done:
                return
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback()

    @property
    def done(self) -> bool:
        return self._done

    def alive(self) -> bool:
        """Whether the engine still runs anything for this request (a thread, a task)."""
        return not self._done

    def join(self, timeout: float) -> None:
        """Block until what :meth:`alive` reports is gone. Called off the loop."""
        return None
