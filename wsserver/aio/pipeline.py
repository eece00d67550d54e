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

**Attachment.** ``Generation.ctx`` is the request's binding to a connection
(its session, its ``apply``, its ``on_gone``) and nothing else refers to the
connection. A resumable request whose connection is lost is *detached*
(:meth:`Generation.detach`): the pump stops at its next step and waits — it
reads nothing more from the channel, which fills, so the engine pauses — and a
frame whose send failed is not retried: it is in the replay tail. A resume
*attaches* it to the new connection's context (:meth:`Generation.attach`)
after the replay was written, and the pump goes on there.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

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


class ResumeRegistry(Protocol):
    """What a request tells the server's registry of resumable requests
    (:class:`wsserver.aio.resume.Resumes`, which depends on this module)."""

    def add(self, generation: Generation, token: str) -> None: ...

    def discard(self, generation: Generation) -> None: ...


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
    #: Requests are resumable unless they say otherwise (``stream.resumable``).
    resumable_default: bool = False
    #: The server's registry of resumable requests (``None``: none are).
    resumes: ResumeRegistry | None = None


class Generation:
    """The live parts of one started request, and its path (:meth:`run`)."""

    def __init__(self, request: Generate, ctx: RequestContext) -> None:
        self.request = request
        #: The binding to a connection; swapped by attach() on a resume.
        self.ctx = ctx
        wants = request.resumable if request.resumable is not None else ctx.resumable_default
        self.resumable = wants and ctx.resumes is not None
        #: Set once ``started`` with a token was sent (resumable requests only).
        self.resume_token: str | None = None
        self.attached = True
        #: The pump waits for a resume after a failed send (the frame is kept).
        self.waiting_for_resume = False
        self._rebound = asyncio.Event()
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
        self._rebound.set()
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

    def detach(self) -> None:
        """Its connection is lost: the pump stops at its next step and waits."""
        self.attached = False

    def attach(self, ctx: RequestContext) -> None:
        """Go on on another connection (after its replay was written)."""
        self.ctx = ctx
        self.log = ctx.log.request(self.request.id)
        self.attached = True
        self._rebound.set()

    async def _bound(self, unless: RequestContext | None = None) -> bool:
        """Wait while detached (or still bound to ``unless``, a connection that
        failed). False if the request was stopped meanwhile."""
        while not self.stopped and (not self.attached or self.ctx is unless):
            self._rebound.clear()
            await self._rebound.wait()
        return not self.stopped

    async def _send(self, effects: list[Effect]) -> bool:
        """Carry out effects; for a resumable request a lost connection is not
        the end: wait for a resume (what was sent is in the replay tail).
        False if the request was stopped meanwhile."""
        ctx = self.ctx
        try:
            await ctx.apply(effects)
            return True
        except ConnectionClosed:
            if self.resume_token is None or self.stopped:
                raise
        self.waiting_for_resume = True
        try:
            return await self._bound(unless=ctx)
        finally:
            self.waiting_for_resume = False

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
            # >= 128 bits: the request id alone is not a credential.
            token = secrets.token_urlsafe(24) if self.resumable else None
            effects = ctx.session.started(request_id, now, token)
            if not effects:
                return
            if token is not None and ctx.resumes is not None:
                self.resume_token = token
                ctx.resumes.add(self, token)
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
            # Detached: take nothing more (the channel fills, the engine pauses).
            # (Checked inline first: this loop runs per token at full speed.)
            if not self.attached and not await self._bound():
                return
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
            if not self.attached and not await self._bound():
                return
            end = self._take(coalescer, item)
            # Merge whatever else is already waiting: one frame, not many.
            while end is None and not coalescer.full:
                more = channel.get_nowait()
                if more is None:
                    break
                end = self._take(coalescer, more)
            if end is not None:
                if await self._flush(coalescer):
                    session = self.ctx.session
                    done = session.finish(self.request.id, end.outcome, loop.time())
                    if await self._send(done):
                        self.ctx.session.done_sent(self.request.id)
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
        return await self._send(effects)

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
        if ctx.resumes is not None and self.resume_token is not None:
            ctx.resumes.discard(self)
        await self.ctx.on_gone(self)

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
