"""One WebSocket connection: the receive loop and the effects of the session.

This is the thin asyncio layer around :class:`~wsserver.session.Session`. Per
connection:

* the **receive loop** (:meth:`Connection.run`) always runs, so a ``cancel`` is
  read even while a stream is backed up; it parses frames, asks the session
  what to do, and carries out the effects;
* each request the session starts gets a :class:`~wsserver.aio.pipeline.Generation`
  task (acquire a slot, submit to the engine, pump its channel into ``delta``
  frames) — see :mod:`wsserver.aio.pipeline`;
* frames go out through one :class:`~wsserver.aio.sender.Sender`, whose drain
  watchdog aborts a client that reads nothing.

Whatever the session answers — to a client frame or to a request's progress —
comes back here as effects, and :meth:`Connection.apply` is the one place that
turns them into frames, log lines and metrics.

When the connection is lost, a running resumable request is *parked* in the
server's :class:`~wsserver.aio.resume.Resumes` instead of being stopped; a
``resume`` frame adopts such a request into this connection's session
(replaying what may not have arrived) and attaches its generation here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from ..backends.base import Backend, Outcome
from ..config import Config
from ..errors import ProtocolError
from ..logs import ConnectionLog
from ..protocol import Cancel, Done, Error, Hello, Limits, Resume, parse_client_frame
from ..security import FrameLimiter
from ..session import Effect, RequestState, Send, Session, StartGeneration, StopGeneration
from .metrics import Metrics
from .peer import PeerAwareConnection, resume_tail_bytes
from .pipeline import Generation, RequestContext
from .resume import Resumes
from .scheduler import Scheduler
from .sender import Sender

__all__ = ["Connection", "Shared"]

log = logging.getLogger("wsserver.connection")


@dataclass(frozen=True, slots=True, eq=False)
class Shared:
    """What every connection of one server uses; built once by the server."""

    config: Config
    backend: Backend
    scheduler: Scheduler
    metrics: Metrics
    wire_limits: Limits
    server_name: str
    #: Tasks started from callbacks, kept referenced until they finish.
    background: set[asyncio.Task[Any]]
    #: Resumable requests, attached or detached (``None``: resuming is off).
    resumes: Resumes | None = None


class Connection:
    """Serves one client. Create per handshake and ``await run()``."""

    def __init__(self, shared: Shared, websocket: ServerConnection, conn_id: str) -> None:
        self.ws = websocket
        self.conn_id = conn_id
        self.log = ConnectionLog(log, conn_id)
        config = shared.config
        self._shared = shared
        self._metrics = shared.metrics
        self._scheduler = shared.scheduler
        self._wire_limits = shared.wire_limits
        self.session = Session(
            restart_bytes=config.limits.restart_memory_bytes,
            resume_tail_bytes=resume_tail_bytes(config),
        )
        self.generations: dict[str, Generation] = {}
        self._send_timeout = config.server.send_timeout_s
        self._idle_timeout = config.server.idle_timeout_s or None
        self._stall_timeout = config.stream.stall_timeout_s or None
        self._loop = asyncio.get_running_loop()
        self.closed = False
        self._sender = Sender(
            websocket,
            send_timeout=self._send_timeout,
            stall_timeout=self._stall_timeout,
            on_stall=self._stall_blocked_producers,
            log=self.log,
            active_id=lambda: self.session.active_id,
        )
        self._requests: RequestContext | None = RequestContext(
            session=self.session,
            backend=shared.backend,
            scheduler=shared.scheduler,
            metrics=shared.metrics,
            log=self.log,
            apply=self.apply,
            in_background=self._in_background,
            on_gone=self._generation_gone,
            queue_tokens=config.stream.queue_tokens,
            flush_window=config.stream.flush_ms / 1000.0,
            flush_tokens=config.stream.flush_tokens,
            default_max_tokens=config.limits.default_max_tokens,
            resumable_default=config.stream.resumable,
            resumes=shared.resumes,
        )
        if isinstance(websocket, PeerAwareConnection):
            websocket.on_peer_close = self._peer_closed
        limits = config.limits
        self._frame_limiter = FrameLimiter(
            rate=limits.frames_per_s,
            burst=limits.frames_burst,
            close_after=limits.flood_close_after,
            now=self._loop.time(),
        )

    # ------------------------------------------------------------ receive loop

    async def run(self) -> None:
        shared = self._shared
        try:
            await self._sender.send(
                Hello(
                    model=shared.backend.model_name,
                    server=shared.server_name,
                    limits=self._wire_limits,
                )
            )
            idle = self._idle_timeout
            while True:
                try:
                    # Cancelling recv() is safe in websockets: no frame is lost.
                    async with asyncio.timeout(idle):
                        message = await self.ws.recv()
                except TimeoutError:
                    if self.generations:
                        continue  # a request is running: the connection is not idle
                    self.log.info("idle for %.0fs; closing", idle)
                    await self._close(1000, "idle timeout")
                    return
                await self._receive(message)
        except ConnectionClosed:
            pass
        finally:
            self.closed = True
            await self._teardown()
            # The request context and the sender hold bound methods of this
            # connection: break those cycles, so that a closed connection's
            # memory returns at once, without waiting for the cyclic GC.
            self._requests = None
            self._sender.detach()

    async def _receive(self, message: str | bytes) -> None:
        now = self._loop.time()
        verdict = self._frame_limiter.check(now)
        if verdict != "ok":
            if verdict == "flood":
                self.log.warning("kept sending over the frame rate limit; closing")
                await self._close_discarding(1008, "frame rate limit exceeded")
                raise ConnectionClosed(None, None)
            limited = ProtocolError("rate_limited", "too many frames; slow down")
            await self.apply(self.session.refuse(limited))
            return
        try:
            frame = parse_client_frame(message, self._wire_limits)
        except ProtocolError as exc:
            self.log.debug(
                "refused frame: %s %s",
                exc.code,
                exc.message,
                extra={} if exc.request_id is None else {"request": exc.request_id},
            )
            await self.apply(self.session.refuse(exc))
            return
        if isinstance(frame, Resume):
            await self._resume(frame, now)
            return
        if (
            isinstance(frame, Cancel)
            and frame.resume_token is not None
            and self.session.state_of(frame.id) not in (RequestState.WAITING, RequestState.RUNNING)
        ):
            await self._cancel_detached(frame, frame.resume_token, now)
            return
        await self.apply(self.session.handle(frame, now))

    # ------------------------------------------------------------ resuming

    async def _resume(self, frame: Resume, now: float) -> None:
        """Adopt a detached request: ``resumed``, the replay, then live frames."""
        resumes, requests = self._shared.resumes, self._requests
        try:
            if resumes is None or requests is None:
                raise ProtocolError("unknown_id", f"no resumable request {frame.id!r}", frame.id)
            record = resumes.claim(frame.id, frame.resume_token)
            assert record.parked is not None
            effects = self.session.adopt(record.parked, frame.after_seq, now)
        except ProtocolError as exc:
            await self.apply(self.session.refuse(exc))
            return
        parked = resumes.take(record)
        generation = record.generation
        generation.log.info(
            "resumed on %s after seq %d (%d replayed)",
            self.conn_id,
            frame.after_seq,
            parked.next_seq - 1 - frame.after_seq,
            extra={"after_seq": frame.after_seq},
        )
        if not parked.finished:
            self.generations[frame.id] = generation
        try:
            await self.apply(effects)
        finally:
            # After the replay (or if this connection broke during it: then
            # its teardown parks the request again, and the tail still holds
            # the frames).
            generation.attach(requests)

    async def _cancel_detached(self, frame: Cancel, token: str, now: float) -> None:
        """``cancel`` with a token for a request detached from its connection."""
        resumes = self._shared.resumes
        try:
            if resumes is None:
                raise ProtocolError("unknown_id", f"no running request {frame.id!r}", frame.id)
            record = resumes.claim(frame.id, token)
        except ProtocolError as exc:
            await self.apply(self.session.refuse(exc))
            return
        assert record.parked is not None
        done = record.parked.cancelled(now)
        record.generation.log.info("cancel (detached, from %s)", self.conn_id)
        resumes.drop(record, now)
        await self.apply([Send(done)])

    def _park(self, generation: Generation) -> bool:
        """The connection is lost: keep a resumable request for a resume."""
        resumes = self._shared.resumes
        if resumes is None or resumes.closing or generation.stopped:
            return False
        if generation.resume_token is None:
            return False
        parked = self.session.detach(generation.request.id)
        if parked is None or (parked.finished and not generation.waiting_for_resume):
            return False
        generation.detach()
        if not resumes.park(generation, parked):
            return False
        self.generations.pop(generation.request.id, None)
        generation.log.info(
            "connection lost; detached, waiting %.1fs for a resume at seq %d",
            resumes.grace_s,
            parked.next_seq,
        )
        return True

    # ------------------------------------------------------------ effects

    async def apply(self, effects: Iterable[Effect]) -> None:
        """Carry out the session's effects, in order: the one way out of the session."""
        for effect in effects:
            if isinstance(effect, Send):
                frame = effect.frame
                if isinstance(frame, Error):
                    self._metrics.errors.labels(frame.code).inc()
                    self.log.request(frame.id).info(
                        "refused: %s %s", frame.code, frame.message, extra={"code": frame.code}
                    )
                elif isinstance(frame, Done):
                    self._log_done(frame)
                await self._sender.send(frame)
            elif isinstance(effect, StartGeneration):
                self._start(effect)
            elif isinstance(effect, StopGeneration):
                self._stop(effect)

    def _start(self, effect: StartGeneration) -> None:
        request = effect.request
        if self._requests is None:
            return  # closed: nothing starts any more
        generation = Generation(request, self._requests)
        self.generations[request.id] = generation
        generation.task = asyncio.create_task(
            generation.run(), name=f"generation-{self.conn_id}-{request.id}"
        )

    def _stop(self, effect: StopGeneration) -> None:
        generation = self.generations.get(effect.id)
        if generation is None:
            return
        generation.log.info("cancel")
        generation.cancelled(self._loop.time())

    async def _generation_gone(self, generation: Generation) -> None:
        request_id = generation.request.id
        self.generations.pop(request_id, None)
        if not self.closed:
            await self._apply_safely(self.session.producer_stopped(request_id, self._loop.time()))

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a send from a callback; the server keeps the task referenced."""
        task = asyncio.create_task(coroutine)
        background = self._shared.background
        background.add(task)
        task.add_done_callback(background.discard)

    async def _apply_safely(self, effects: Iterable[Effect]) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self.apply(effects)

    def _peer_closed(self) -> None:
        """The client sent its close frame: stop producing for it right away."""
        self.log.info("client is closing; stopping its generation")
        self.closed = True
        for gen in list(self.generations.values()):
            if gen.resume_token is None:  # a resumable one is parked at teardown
                gen.stop()

    def _stall_blocked_producers(self) -> None:
        """End requests whose engine waits on a client that reads nothing,
        when another request is waiting for the model (else nobody is harmed)."""
        if self._scheduler.waiting == 0:
            return
        for gen in list(self.generations.values()):
            if gen.channel.blocked.is_set() and not gen.stopped:
                gen.log.warning(
                    "client read nothing for %.1fs; ending the request as stalled",
                    self._stall_timeout,
                )
                stalled = Outcome(
                    reason="error",
                    completion_tokens=gen.channel.tokens,
                    error_code="stalled",
                    error_message="the client read nothing for the stall timeout",
                )
                effects = self.session.finish(gen.request.id, stalled, self._loop.time())
                gen.stop()
                if effects:
                    # Logged (and counted) when sent, like every done.
                    self._in_background(self._apply_safely(effects))

    # ------------------------------------------------------------ closing

    async def _close(self, code: int, reason: str) -> None:
        """Close with a handshake, or abort if the client does not take part."""
        try:
            async with asyncio.timeout(self._send_timeout):
                await self.ws.close(code, reason)
        except TimeoutError:
            self.ws.transport.abort()

    async def _close_discarding(self, code: int, reason: str) -> None:
        """Close while discarding what the client still sends: its close frame may
        sit behind a backlog of messages that nobody would read any more (reading
        pauses at ``max_queue``). Call only from the receive loop."""
        closing = asyncio.create_task(self._close(code, reason))
        with contextlib.suppress(ConnectionClosed):
            while True:
                await self.ws.recv()
        await closing

    async def _teardown(self) -> None:
        generations = [g for g in list(self.generations.values()) if not self._park(g)]
        for gen in generations:
            gen.stop()
        tasks = [g.task for g in generations if g.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _log_done(self, frame: Done) -> None:
        self._metrics.done(frame)
        log_done(self.log.request(frame.id), frame)

    # ------------------------------------------------------------ inspection

    def buffered_bytes(self) -> int:
        """Bytes this connection holds for its client: channel + write buffer."""
        total = 0
        for gen in list(self.generations.values()):
            total += gen.channel.buffered_bytes()
        transport = self.ws.transport
        if transport is not None and not transport.is_closing():
            total += transport.get_write_buffer_size()
        return total

    def held_bytes(self) -> dict[str, int]:
        """Everything this connection holds in memory, by part (docs/operations.md)."""
        ws = self.ws
        receive = ws.receive_buffered_bytes() if isinstance(ws, PeerAwareConnection) else 0
        return {
            "send": self.buffered_bytes(),
            "receive": receive,
            "restart": self.session.restart_bytes,
            "resume": self.session.resume_bytes,
        }

    async def shutdown(self, timeout: float | None = None) -> None:
        """Server shutdown: end running requests as cancelled, then close 1001.

        Within ``timeout`` seconds, or the connection is aborted: a client
        that does not read must not hold up the server's exit.
        """
        try:
            async with asyncio.timeout(timeout):
                request_id = self.session.active_id
                if request_id is not None:
                    await self._apply_safely(
                        self.session.handle(Cancel(id=request_id), self._loop.time())
                    )
                await self._close(1001, "server shutting down")
        except TimeoutError:
            self.log.info("did not take part in closing; aborting")
            self.ws.transport.abort()


def log_done(log: Any, frame: Done) -> None:
    """The one log line of a finished request, WebSocket or HTTP alike."""
    timings = frame.timings
    log.info(
        "done %s",
        _done_summary(frame),
        extra={
            "reason": frame.reason,
            "queued_ms": round(timings.queued_ms, 3),
            "ttft_ms": None if timings.ttft_ms is None else round(timings.ttft_ms, 3),
            "total_ms": round(timings.total_ms, 3),
            "completion_tokens": frame.usage.completion_tokens,
        },
    )


def _done_summary(frame: Done) -> str:
    usage, timings = frame.usage, frame.timings
    ttft = "-" if timings.ttft_ms is None else f"{timings.ttft_ms:.1f}ms"
    return (
        f"reason={frame.reason} prompt_tokens={usage.prompt_tokens} "
        f"completion_tokens={usage.completion_tokens} queued={timings.queued_ms:.1f}ms "
        f"ttft={ttft} total={timings.total_ms:.1f}ms tok/s={timings.tokens_per_s:.1f}"
    )
