"""One request's path, in order: acquire → started → submit → pump → finalize.

:meth:`Generation.run` is the task a connection starts for each request the
session lets start:

1. **acquire** a slot from the :class:`~wsserver.aio.scheduler.Scheduler`
   (``queued`` frames report the position while it waits);
2. **started** — the session says whether the request still wants it;
3. **submit** it to the engine (:mod:`wsserver.backends.base`) with its
   bounded :class:`~wsserver.aio.channel.Channel` and cancel event; the slot
   is released the moment the engine completes the submission, even if the
   sender is still stuck on a slow socket with the last frames;
4. **pump**: channel → :class:`~wsserver.pacing.Coalescer` → ``delta``
   frames → socket, then the engine's end → ``done``;
5. **finalize**: wait until the engine is gone (a thread joined), record the
   cancel latency, and tell the connection (``on_gone``).

Everything the session answers is handed to the connection's ``apply`` as
effects: frames, their logs and their metrics leave from that one place.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from websockets.exceptions import ConnectionClosed

from .. import pacing
from ..backends.base import Backend, GenerationRequest, Submission
from ..errors import ProtocolError
from ..logs import ConnectionLog
from ..pacing import Coalescer
from ..protocol import Delta, Generate
from ..session import Effect, RequestState, Send, Session
from .channel import Channel, End, Item, Piece, PromptDone
from .metrics import Metrics
from .scheduler import Scheduler

__all__ = ["Generation", "RequestContext"]

Apply = Callable[[Iterable[Effect]], Awaitable[None]]


@dataclass(frozen=True, slots=True, eq=False)
class RequestContext:
    """What every request of one connection uses; built once by the connection."""

    session: Session
    backend: Backend
    scheduler: Scheduler
    metrics: Metrics
    log: ConnectionLog
    #: Carry out effects (the connection's one way out of the session).
    apply: Apply
    #: Run a coroutine beside the request, kept referenced by the server.
    in_background: Callable[[Coroutine[Any, Any, None]], None]
    #: The request's task has ended and its engine is gone.
    on_gone: Callable[[Generation], Awaitable[None]]
    queue_tokens: int
    flush_window: float
    flush_tokens: int
    default_max_tokens: int


class Generation:
    """The live parts of one started request, and its path (:meth:`run`)."""

    def __init__(self, request: Generate, ctx: RequestContext) -> None:
        self.request = request
        self.ctx = ctx
        self.log = ctx.log.request(request.id)
        self.channel = Channel(ctx.queue_tokens)
        self.task: asyncio.Task[None] | None = None
        self.acquire: asyncio.Task[int] | None = None
        self.submission: Submission | None = None
        self.exited: asyncio.Future[None] | None = None
        self.stopped = False
        self.slot: int | None = None
        #: Loop time at which a cancel (or restart) frame stopped this request.
        self.cancel_requested: float | None = None
        #: Loop time at which the engine of a cancelled request completed.
        self.exited_at: float | None = None

    def stop(self) -> None:
        """Cancel: wake and end the engine's work, stop waiting for a slot. Idempotent."""
        self.stopped = True
        self.channel.close()
        if self.acquire is not None and not self.acquire.done():
            self.acquire.cancel()

    def cancelled(self, now: float) -> None:
        """A cancel (or restart) frame stopped this request: stop, and time it."""
        self.cancel_requested = now
        if self.exited is not None and self.exited.done() and self.exited_at is None:
            # The engine was done already: nothing left to wait for.
            self.exited_at = now
        self.stop()

    def alive(self) -> bool:
        """Whether the engine still runs anything for this request."""
        return self.submission is not None and self.submission.alive()

    # ------------------------------------------------------------ the path

    async def run(self) -> None:
        ctx = self.ctx
        request_id = self.request.id
        loop = asyncio.get_running_loop()
        try:
            self.acquire = asyncio.ensure_future(ctx.scheduler.acquire(request_id, self.queued))
            try:
                self.slot = await self.acquire
            except asyncio.CancelledError:
                if self.stopped:
                    return  # cancelled while waiting for the model
                raise
            except ProtocolError as exc:
                await self._apply_safely(ctx.session.reject(request_id, exc))
                return
            if self.stopped:
                return
            now = loop.time()
            effects = ctx.session.started(request_id, now)
            if not effects:
                return
            queued_ms = ctx.session.since_received_ms(request_id, now)
            self.log.info(
                "started slot=%s queued=%.1fms",
                self.slot,
                queued_ms,
                extra={"slot": self.slot, "queued_ms": round(queued_ms, 3)},
            )
            await ctx.apply(effects)
            self._submit(loop)
            await self._pump()
        except ConnectionClosed:
            self.stop()
        except Exception:
            self.log.exception("sender failed")
            self.stop()
        finally:
            await self._finalize()

    def queued(self, position: int) -> None:
        """The scheduler's callback: the request's place in the queue changed."""
        effects = self.ctx.session.queued(self.request.id, position)
        if effects:
            self.ctx.in_background(self._send_queued(effects))

    async def _send_queued(self, effects: list[Effect]) -> None:
        # This runs as a task, after the scheduler's callback: meanwhile a cancel
        # may have ended the request and sent its done. Check at the last moment
        # (no await between the check and the write) so that a queued frame
        # never follows its done.
        if self.ctx.session.state_of(self.request.id) is not RequestState.WAITING:
            return
        await self._apply_safely(effects)

    def _submit(self, loop: asyncio.AbstractEventLoop) -> None:
        ctx = self.ctx
        assert self.slot is not None
        slot: int = self.slot
        request = GenerationRequest.from_frame(
            self.request, default_max_tokens=ctx.default_max_tokens, conn_id=ctx.log.conn_id
        )
        channel = self.channel
        self.submission = ctx.backend.submit(
            request, slot=slot, sink=channel, cancel=channel.cancel
        )
        exited: asyncio.Future[None] = loop.create_future()
        # The model is free as soon as the engine is done with the request.
        exited.add_done_callback(lambda _: ctx.scheduler.release(slot))
        exited.add_done_callback(self._mark_exited)
        self.exited = exited
        self.submission.add_done_callback(lambda: _call_soon(loop, _set_result, exited))

    def _mark_exited(self, _: object) -> None:
        if self.cancel_requested is not None:
            self.exited_at = asyncio.get_running_loop().time()

    async def _pump(self) -> None:
        """The sender: channel → coalesced ``delta`` frames → socket."""
        ctx = self.ctx
        channel = self.channel
        coalescer = Coalescer(
            flush_window=ctx.flush_window,
            flush_tokens=ctx.flush_tokens,
            max_chars=pacing.FRAME_TEXT_CHARS,
        )
        loop = asyncio.get_running_loop()
        while True:
            if coalescer.due(loop.time()):
                if not await self._flush(coalescer):
                    return
                continue
            if coalescer.full:
                # A frame's worth of text waits for its window; the rest stays
                # in the bounded channel meanwhile, and the engine pauses.
                wait = max(0.0, coalescer.deadline() - loop.time())
                await asyncio.sleep(wait)  # sleep-ok: the pacing itself, not a synchronisation
                continue
            try:
                # Wait for the window only with text pending: tokens whose bytes
                # are held back (half a character) never make a flush due, and
                # waiting on a past deadline for them would spin.
                if coalescer.has_text:
                    async with asyncio.timeout_at(coalescer.deadline()):
                        item = await channel.get()
                else:
                    item = await channel.get()
            except TimeoutError:
                continue
            if item is None:
                return  # closed: cancelled, or the connection is going
            end = self._take(coalescer, item)
            # Merge whatever else is already waiting: one frame, not many.
            while end is None and not coalescer.full:
                more = channel.get_nowait()
                if more is None:
                    break
                end = self._take(coalescer, more)
            if end is not None:
                await self._flush(coalescer)
                await ctx.apply(ctx.session.finish(self.request.id, end.outcome, loop.time()))
                return

    async def _flush(self, coalescer: Coalescer) -> bool:
        """Send everything pending as one delta. False if the request has ended."""
        ctx = self.ctx
        now = asyncio.get_running_loop().time()
        text, tokens = coalescer.take(now)
        ctx.metrics.tokens.inc(tokens)
        effects = ctx.session.delta(self.request.id, text, tokens, now)
        if not effects:
            return ctx.session.state_of(self.request.id) is RequestState.RUNNING
        first = effects[0]
        if isinstance(first, Send) and isinstance(first.frame, Delta) and first.frame.seq == 0:
            ttft_ms = ctx.session.since_received_ms(self.request.id, now)
            self.log.info("first text ttft=%.1fms", ttft_ms, extra={"ttft_ms": round(ttft_ms, 3)})
        await ctx.apply(effects)
        return True

    def _take(self, coalescer: Coalescer, item: Item) -> End | None:
        if isinstance(item, Piece):
            coalescer.add(item.text, item.tokens)
            return None
        if isinstance(item, PromptDone):
            self.ctx.session.prompt_processed(self.request.id, item.prompt_tokens)
            return None
        return item

    async def _finalize(self) -> None:
        ctx = self.ctx
        if self.exited is not None:
            # Never leave an engine behind: wait until it is done with the request.
            # (Its slot was released the moment it completed; see _submit.)
            await asyncio.shield(self.exited)
            submission = self.submission
            if submission is not None and submission.alive():
                # Completion is signalled from the thread's last lines; the
                # thread itself ends a moment later. Join it, so that "stopped"
                # means gone (a leak check right after cannot see it).
                await asyncio.to_thread(submission.join, 5.0)
        elif self.slot is not None:
            ctx.scheduler.release(self.slot)
        ctx.metrics.producer_finished(self.channel.blocked_seconds)
        if self.cancel_requested is not None:
            loop = asyncio.get_running_loop()
            end = self.exited_at if self.exited_at is not None else loop.time()
            latency = end - self.cancel_requested
            ctx.metrics.cancel_latency.observe(latency)
            self.log.info(
                "producer stopped %.1fms after the cancel",
                latency * 1000.0,
                extra={"cancel_latency_ms": round(latency * 1000.0, 3)},
            )
        await ctx.on_gone(self)

    async def _apply_safely(self, effects: Iterable[Effect]) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.ctx.apply(effects)


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _call_soon(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object
) -> None:
    # The loop may already be closed at interpreter shutdown; nothing to tell then.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)
