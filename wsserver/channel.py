"""The bounded channel from a producer thread to the event loop.

One channel per running request, built on :mod:`janus` (a queue with a
blocking sync side and an awaitable async side). Its size bounds a
connection's memory: at most ``capacity`` items, each one token's text. When
the sender is parked in a slow ``send()``, the channel fills and
:meth:`Channel.emit` blocks the producer in a condition wait — no polling, no
CPU. :meth:`Channel.close` (cancel, disconnect, shutdown) shuts the queue down
with ``immediate=True``, which wakes a blocked producer at once with an
exception, and discards whatever was still queued.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import janus

from .errors import GenerationCancelled
from .session import Outcome

__all__ = ["CancelEvent", "Channel", "End", "Item", "Piece", "PromptDone"]


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    tokens: int


@dataclass(frozen=True, slots=True)
class PromptDone:
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class End:
    outcome: Outcome


Item = Piece | PromptDone | End


class CancelEvent(threading.Event):
    """A ``threading.Event`` that also runs callbacks, on the setting thread, when set.

    A backend may register a callback to mirror the cancel into native state
    the instant it happens (the llama backend sets llama.cpp's abort flag this
    way) instead of keeping a thread blocked in ``wait()``. Callbacks must be
    quick and must not raise.
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


class Channel:
    """Producer → loop queue, implementing the backends' ``TokenSink``.

    Create it on the event loop. The producer thread calls :meth:`emit`,
    :meth:`prompt_processed` and :meth:`end`; the loop reads :attr:`queue`.
    """

    def __init__(self, capacity: int) -> None:
        self.queue: janus.Queue[Item] = janus.Queue(maxsize=capacity)
        self.cancel = CancelEvent()
        # Written by the producer thread only; read for metrics and tests.
        self.blocked_seconds = 0.0
        self.blocked_cpu_seconds = 0.0
        self.blocked_since: float | None = None
        #: Set while the producer is blocked on a full channel (metrics, tests).
        self.blocked = threading.Event()
        self.tokens = 0

    # ------------------------------------------------------------ producer side

    def prompt_processed(self, prompt_tokens: int) -> None:
        self._put(PromptDone(prompt_tokens))

    def emit(self, text: str, tokens: int = 1) -> None:
        self.tokens += tokens
        self._put(Piece(text, tokens))

    def end(self, outcome: Outcome) -> None:
        self._put(End(outcome))

    def _put(self, item: Item) -> None:
        if self.cancel.is_set():
            raise GenerationCancelled()
        sync_q = self.queue.sync_q
        try:
            sync_q.put_nowait(item)
            return
        except janus.SyncQueueFull:
            pass
        except janus.SyncQueueShutDown:
            raise GenerationCancelled() from None
        # Full: the client reads slower than the model writes. Block here.
        wall, cpu = time.monotonic(), time.thread_time()
        self.blocked_since = wall
        self.blocked.set()
        try:
            sync_q.put(item)
        except janus.SyncQueueShutDown:
            raise GenerationCancelled() from None
        finally:
            self.blocked.clear()
            self.blocked_since = None
            self.blocked_seconds += time.monotonic() - wall
            self.blocked_cpu_seconds += time.thread_time() - cpu

    # ------------------------------------------------------------ loop side

    def close(self) -> None:
        """Cancel: wake the producer and discard what is queued. Idempotent."""
        self.cancel.set()
        self.queue.shutdown(immediate=True)

    def buffered_bytes(self) -> int:
        """UTF-8 bytes of text waiting in the queue (a snapshot)."""
        with self.queue._sync_mutex:  # janus has no public snapshot API
            items = list(self.queue._queue)
        return sum(len(i.text.encode()) for i in items if isinstance(i, Piece))
