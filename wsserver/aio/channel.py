"""The bounded channel from an engine to the event loop: the seam's :class:`Sink`.

One channel per running request, built on :mod:`janus` (a queue with a sync
side for engine threads and an awaitable async side for the loop). Its items
are the sink's calls, in order: :class:`Piece` (text), :class:`Call` (a part
of a call the engine parsed itself), :class:`PromptDone`, :class:`End`. Its
bound is counted here, in pieces — at most ``capacity`` of them, each one
token's text (and, if the request asked for them, that token's
log-probabilities: at most :data:`~wsserver.core.logprobs.MAX_ENTRY_BYTES`) or one
call part — *and* in characters (a call part's: its arguments'): at most
:data:`CHARS_PER_TOKEN` per piece on average (≤ 256 UTF-8 bytes a piece),
whatever the engine puts in a piece, plus the one piece that found room; so a
connection's memory is bounded by bytes even for an upstream whose chunks are
megabytes. The prompt count and the end are not counted: they always fit, so
an engine can end a request whose channel is full without waiting (a batched
engine must never wait).

When the sender is parked in a slow ``send()`` the channel fills. Then
:meth:`Channel.emit` blocks a threaded engine in a condition wait — no
polling, no CPU — and :meth:`Channel.offer` tells a batched or async engine
"not now", with :meth:`Channel.when_room` to wake it. Either way the request
counts as *blocked* (metrics, the stall check) until there is room again.
:meth:`Channel.close` (cancel, disconnect, shutdown) wakes every waiter at
once, discards whatever was still queued, and drops whatever comes after.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import janus

from ..backends.base import CancelEvent, Outcome
from ..core.call_parts import CallPart
from ..core.logprobs import TokenLogprob, entries_size
from ..errors import GenerationCancelled

__all__ = ["CHARS_PER_TOKEN", "Call", "Channel", "End", "Item", "Piece", "PromptDone"]

#: The channel holds at most ``capacity`` x this many characters (4 bytes
#: each at most: the 256 bytes a token may carry, ``peer.MAX_TOKEN_BYTES``).
CHARS_PER_TOKEN = 64


@dataclass(frozen=True, slots=True)
class Piece:
    text: str
    tokens: int
    #: The tokens' log-probabilities, if the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Call:
    """A part of a call the engine parsed itself (:meth:`Channel.offer_call`)."""

    part: CallPart
    tokens: int


@dataclass(frozen=True, slots=True)
class PromptDone:
    prompt_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class End:
    outcome: Outcome


Item = Piece | Call | PromptDone | End


class Channel:
    """Engine → loop queue, implementing the seam's ``Sink``.

    Create it on the event loop. The engine calls the sink methods from any
    thread (``emit`` never on the loop); the loop reads with :meth:`get` and
    :meth:`get_nowait`, which also make room.
    """

    def __init__(self, capacity: int) -> None:
        self.queue: janus.Queue[Item] = janus.Queue()
        self.capacity = max(1, capacity)
        self.max_chars = self.capacity * CHARS_PER_TOKEN
        self._chars = 0
        self.cancel = CancelEvent()
        self._room = threading.Condition()
        self._pieces = 0
        self._room_callbacks: list[Callable[[], None]] = []
        self._ended = False
        # Metrics and tests read these; they change under ``_room``.
        self.blocked_seconds = 0.0
        self.blocked_cpu_seconds = 0.0
        self.blocked_since: float | None = None
        #: Set while the request waits for room in its full channel.
        self.blocked = threading.Event()
        self.tokens = 0

    # ------------------------------------------------------------ engine side

    def prompt_processed(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        self._put_control(PromptDone(prompt_tokens, cached_tokens))

    def end(self, outcome: Outcome) -> None:
        with self._room:
            if self._ended:
                return
            self._ended = True
        self._put_control(End(outcome))

    def offer(self, text: str, tokens: int = 1, logprobs: tuple[TokenLogprob, ...] = ()) -> bool:
        with self._room:
            if self.cancel.is_set():
                return False
            if self._full():
                self._pause()
                return False
            return self._put_piece(Piece(text, tokens, logprobs), len(text), tokens)

    def offer_call(self, part: CallPart, tokens: int = 0) -> bool:
        with self._room:
            if self.cancel.is_set():
                return False
            if self._full():
                self._pause()
                return False
            return self._put_piece(Call(part, tokens), len(part.arguments), tokens)

    def emit(self, text: str, tokens: int = 1, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        with self._room:
            if self._full() and not self.cancel.is_set():
                # Full: the client reads slower than the model writes. Wait here.
                cpu = time.thread_time()
                self._pause()
                while self._full() and not self.cancel.is_set():
                    self._room.wait()
                self.blocked_cpu_seconds += time.thread_time() - cpu
            piece = Piece(text, tokens, logprobs)
            if self.cancel.is_set() or not self._put_piece(piece, len(text), tokens):
                raise GenerationCancelled()

    def when_room(self, callback: Callable[[], None]) -> None:
        with self._room:
            if self._full() and not self.cancel.is_set():
                self._room_callbacks.append(callback)
                return
        callback()

    def _put_piece(self, item: Piece | Call, chars: int, tokens: int) -> bool:
        """Queue a piece (``_room`` held). False if the queue was shut down."""
        try:
            self.queue.sync_q.put_nowait(item)
        except janus.SyncQueueShutDown:
            return False
        self._pieces += 1
        self._chars += chars
        self.tokens += tokens
        return True

    def _full(self) -> bool:
        return self._pieces >= self.capacity or self._chars >= self.max_chars

    def _put_control(self, item: Item) -> None:
        if self.cancel.is_set():
            return  # nothing after a cancel
        with contextlib.suppress(janus.SyncQueueShutDown):
            self.queue.sync_q.put_nowait(item)

    def _pause(self) -> None:
        if self.blocked_since is None:
            self.blocked_since = time.monotonic()
            self.blocked.set()

    def _resume(self) -> list[Callable[[], None]]:
        """There is room, or the request is cancelled (``_room`` held)."""
        since = self.blocked_since
        if since is not None:
            self.blocked_seconds += time.monotonic() - since
            self.blocked_since = None
            self.blocked.clear()
        self._room.notify_all()
        callbacks, self._room_callbacks = self._room_callbacks, []
        return callbacks

    # ------------------------------------------------------------ loop side

    async def get(self) -> Item | None:
        """The next item, waiting for it; ``None`` once the channel is closed."""
        try:
            item = await self.queue.async_q.get()
        except janus.AsyncQueueShutDown:
            return None
        self._taken(item)
        return item

    def get_nowait(self) -> Item | None:
        """The next item if one is queued, else ``None``."""
        try:
            item = self.queue.async_q.get_nowait()
        except (janus.AsyncQueueEmpty, janus.AsyncQueueShutDown):
            return None
        self._taken(item)
        return item

    def _taken(self, item: Item) -> None:
        if isinstance(item, Piece):
            chars = len(item.text)
        elif isinstance(item, Call):
            chars = len(item.part.arguments)
        else:
            return
        with self._room:
            self._pieces -= 1
            self._chars -= chars
            callbacks = [] if self._full() else self._resume()
        for callback in callbacks:
            callback()

    def close(self) -> None:
        """Cancel: wake the engine and discard what is queued. Idempotent."""
        self.cancel.set()
        with self._room:
            callbacks = self._resume()
        self.queue.shutdown(immediate=True)
        for callback in callbacks:
            callback()

    def buffered_bytes(self) -> int:
        """UTF-8 bytes of text (and call arguments) waiting in the queue, and
        what its log-probabilities hold (a snapshot)."""
        with self.queue._sync_mutex:  # janus has no public snapshot API
            items = list(self.queue._queue)
        return sum(
            len(i.text.encode()) + entries_size(i.logprobs)
            if isinstance(i, Piece)
            else len(i.part.arguments.encode())
            if isinstance(i, Call)
            else 0
            for i in items
        )
