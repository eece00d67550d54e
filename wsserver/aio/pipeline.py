"""One request's engine side, in order: acquire → submit → pump → finalize.

:meth:`Generation.run` is the task the request driver starts for each request
the session lets start:

1. **acquire** a slot from the :class:`~wsserver.aio.scheduler.Scheduler`
   (its position reports go to the driver while it waits);
2. **prepare** what the engine says may take long (the llama engine: its
   chat template's render, bounded in time) on a worker thread;
   **granted** — the driver asks the session whether the request still wants
   the model (then ``started`` goes out);
3. **submit** it to the engine (:mod:`wsserver.backends.base`) with its
   bounded :class:`~wsserver.aio.channel.Channel` and cancel event; the slot
   is released the moment the engine completes the submission, even if the
   client is still slow to take the last frames;
4. **pump** (:mod:`.pump`): channel → :class:`~wsserver.shaping.shaper.Shaper`
   (parts, as :meth:`~wsserver.backends.base.Backend.output_format` says)
   → :class:`~wsserver.core.pacing.Coalescer` → reports, then the end;
5. **finalize**: wait until the engine is gone (a thread joined), record the
   cancel latency, and tell the driver.

A generation never touches the session nor the wire: it *reports*
(:mod:`wsserver.core.events`) to its :class:`Owner`, the request driver.

**Attachment.** ``Generation.owner`` is the request's one binding to a
connection. A resumable request whose connection is lost is *detached*
(:meth:`Generation.detach`): the pump stops and waits (the channel fills, so
the engine pauses); a frame whose write failed is in the replay tail, not
retried. A resume *attaches* it to the new connection's driver
(:meth:`Generation.attach`) after the replay, and the pump goes on there.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

from ..backends.base import GenerationRequest, Submission
from ..core.events import ModelGranted, Rejected, Report
from ..core.protocol import Generate, Progress
from ..core.request_record import RequestRecord
from ..errors import ProtocolError, WireLost
from ..logs import ConnectionLog
from .channel import Channel
from .models import Model
from .pump import Pump
from .services import Services

__all__ = ["Generation", "Owner"]


class Owner(Protocol):
    """What a generation tells its request driver (:class:`wsserver.aio.driver.RequestDriver`)."""

    services: Services
    log: ConnectionLog

    async def report(self, event: Report) -> bool:
        """Hand a report to the session and write what it answers. Whether the
        request is still live; raises :class:`~wsserver.errors.WireLost` if
        the wire is lost."""

    def note(self, event: Report) -> None:
        """A report that sends nothing (the prompt count)."""

    def queued(
        self,
        request_id: str,
        position: int,
        loading: bool = False,
        download: Progress | None = None,
    ) -> None: ...

    async def generation_gone(self, generation: Generation) -> None: ...


class Generation:
    """The live parts of one started request, and its path (:meth:`run`)."""

    def __init__(
        self,
        request: Generate,
        owner: Owner,
        record: RequestRecord,
        *,
        model: Model,
        resumable: bool = False,
    ) -> None:
        self.request = request
        #: The binding to a connection's driver; swapped by attach() on a resume.
        self.owner = owner
        #: The request's record (times, counts, resume token), kept by the session.
        self.record = record
        #: The client asked for a resumable request (and the server resumes).
        self.resumable = resumable
        self.attached = True
        #: The pump waits for a resume after a failed write (the frame is kept).
        self.waiting_for_resume = False
        self._rebound = asyncio.Event()
        self.log = owner.log.request(request.id)
        config = owner.services.config
        self.channel = Channel(config.stream.queue_tokens)
        self.task: asyncio.Task[None] | None = None
        self.acquire: asyncio.Task[int] | None = None
        self.submission: Submission | None = None
        self.exited: asyncio.Future[None] | None = None
        self.stopped = False
        self.slot: int | None = None
        #: The model that serves it, resolved once on the request's way in.
        self.model = model
        #: Loop time at which a cancel (or restart) frame stopped this request.
        self.cancel_requested: float | None = None
        #: Loop time at which the engine of a cancelled request completed.
        self.exited_at: float | None = None

    @property
    def resume_token(self) -> str | None:
        """The token its ``started`` carried (resumable requests only)."""
        return self.record.resume_token

    def stop(self) -> None:
        """Cancel: wake and end the engine's work, stop waiting for a slot. Idempotent."""
        self.stopped = True
        self._rebound.set()
        self.channel.close()
        if self.acquire is not None and not self.acquire.done():
            self.acquire.cancel()

    def cancel_at(self, now: float) -> None:
        """A cancel (or restart) frame stopped this request: stop, and time it."""
        self.cancel_requested = now
        if self.exited is not None and self.exited.done() and self.exited_at is None:
            # The engine was done already: nothing left to wait for.
            self.exited_at = now
        self.stop()

    def detach(self) -> None:
        """Its connection is lost: the pump stops at its next step and waits."""
        self.attached = False

    def attach(self, owner: Owner) -> None:
        """Go on on another connection (after its replay was written)."""
        self.owner = owner
        self.log = owner.log.request(self.request.id)
        self.attached = True
        self._rebound.set()

    async def wait_attached(self, unless: Owner | None = None) -> bool:
        """Wait while detached (or still bound to ``unless``, a connection that
        failed). False if the request was stopped meanwhile."""
        while not self.stopped and (not self.attached or self.owner is unless):
            self._rebound.clear()
            await self._rebound.wait()
        return not self.stopped

    async def report(self, event: Report) -> bool:
        """Report to the owner. For a resumable request a lost connection is
        not the end: wait for a resume (what was written is in the replay
        tail). False if the request ended or was stopped meanwhile."""
        owner = self.owner
        try:
            return await owner.report(event)
        except WireLost:
            if self.resume_token is None or self.stopped:
                raise
        self.waiting_for_resume = True
        try:
            return await self.wait_attached(unless=owner)
        finally:
            self.waiting_for_resume = False

    def note(self, event: Report) -> None:
        """A report that sends nothing (the prompt count)."""
        self.owner.note(event)

    def alive(self) -> bool:
        """Whether the engine still runs anything for this request."""
        return self.submission is not None and self.submission.alive()

    def queued(
        self, position: int, loading: bool = False, download: Progress | None = None
    ) -> None:
        """The scheduler's callback: the request's place in the queue changed
        (``loading``: its model is still being loaded; ``download``: and
        downloaded before that, this far)."""
        self.owner.queued(self.request.id, position, loading, download)

    # ------------------------------------------------------------ the path

    async def run(self) -> None:
        services = self.owner.services
        request_id = self.request.id
        try:
            # The connection's share of the model: its requests (the lanes of
            # a Responses WebSocket) get one slot in turn, like every other's.
            self.acquire = asyncio.ensure_future(
                services.models.acquire(
                    self.model, request_id, self.queued, owner=self.owner.log.conn_id
                )
            )
            try:
                self.slot = await self.acquire
            except asyncio.CancelledError:
                if self.stopped:
                    return  # cancelled while waiting for the model
                raise
            except ProtocolError as exc:
                with contextlib.suppress(WireLost):
                    await self.owner.report(Rejected(request_id, exc))
                return
            if self.stopped:
                return
            request = GenerationRequest.from_frame(
                self.request,
                default_max_tokens=services.config.limits.default_max_tokens,
                conn_id=self.owner.log.conn_id,
            )
            backend = self.model.backend
            if backend.prepare_blocks(request):
                # A chat template's render (bounded in time, not quick): off the
                # loop, and before the engine's thread, which serves every stream.
                request = await asyncio.to_thread(backend.prepare, request)
                if self.stopped:
                    return
            # The token is made by the driver (only for a resumable request).
            if not await self.owner.report(ModelGranted(request_id)):
                return
            # The engine describes its output (for the pump's shaper), then gets the request.
            pump = Pump(self.request, backend.output_format(request), self.channel, self, services)
            self._submit(asyncio.get_running_loop(), request)
            await pump.run()
        except WireLost:
            self.stop()
        except Exception:
            self.log.exception("sender failed")
            self.stop()
        finally:
            await self._finalize()

    def _submit(self, loop: asyncio.AbstractEventLoop, request: GenerationRequest) -> None:
        services = self.owner.services
        backend = self.model.backend
        assert self.slot is not None
        slot: int = self.slot
        channel = self.channel
        self.submission = backend.submit(request, slot=slot, sink=channel, cancel=channel.cancel)
        exited: asyncio.Future[None] = loop.create_future()
        # The model is free as soon as the engine is done with the request.
        models, model, keep = services.models, self.model, self.request.keep_alive
        exited.add_done_callback(lambda _: models.release(model, slot, keep))
        exited.add_done_callback(self._mark_exited)
        self.exited = exited
        self.submission.add_done_callback(lambda: _call_soon(loop, _set_result, exited))

    def _mark_exited(self, _: object) -> None:
        if self.cancel_requested is not None:
            self.exited_at = asyncio.get_running_loop().time()

    async def _finalize(self) -> None:
        services = self.owner.services
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
            services.models.release(self.model, self.slot, self.request.keep_alive)
        services.metrics.producer_finished(self.channel.blocked_seconds)
        if self.cancel_requested is not None:
            loop = asyncio.get_running_loop()
            end = self.exited_at if self.exited_at is not None else loop.time()
            latency = end - self.cancel_requested
            services.metrics.cancel_latency.observe(latency)
            self.log.info(
                "producer stopped %.1fms after the cancel",
                latency * 1000.0,
                extra={"cancel_latency_ms": round(latency * 1000.0, 3)},
            )
        await self.owner.generation_gone(self)


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _call_soon(
    loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object
) -> None:
    # The loop may already be closed at interpreter shutdown; nothing to tell then.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)
