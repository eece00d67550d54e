"""One WebSocket connection: receive loop, producers and the paced sender.

This is the thin asyncio layer around :class:`~wsserver.session.Session`. Per
connection:

* the **receive loop** (:meth:`Connection.run`) always runs, so a ``cancel`` is
  read even while a stream is backed up; it parses frames, asks the session
  what to do, and carries out the effects;
* each started request gets a **producer** thread running the backend, a
  bounded :class:`~wsserver.channel.Channel` to the loop, and a **sender**
  coroutine that coalesces the channel's tokens into ``delta`` frames
  (:class:`~wsserver.pacing.Coalescer`) and awaits ``send()``.

``send()`` waits while the transport holds more than ``write_limit`` bytes (the
listening socket also gets a small ``SO_SNDBUF``), so a slow reader parks the
sender; the channel fills; the producer blocks. Every send is bounded by
``send_timeout``: a client that does not read at all is aborted rather than
allowed to hang the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import struct
import termios
from collections.abc import Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Final

import janus
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from .backends.base import GenerationRequest
from .channel import Channel, End, Item, Piece, PromptDone
from .errors import ProtocolError
from .logs import context
from .pacing import Coalescer
from .producer import Generation, start_producer
from .protocol import (
    Cancel,
    Done,
    Error,
    Generate,
    Hello,
    ServerFrame,
    parse_client_frame,
    serialize,
)
from .security import FrameLimiter
from .session import (
    Effect,
    Outcome,
    RequestState,
    Send,
    Session,
    StartGeneration,
    StopGeneration,
)

if TYPE_CHECKING:
    from .config import Config
    from .server import Server

__all__ = ["Connection", "PeerAwareConnection", "memory_bound", "peer_aware_connection"]

log = logging.getLogger("wsserver.connection")


class PeerAwareConnection(ServerConnection):
    """A websockets connection with two guards the library does not have.

    **The client's close frame is reported at once.** websockets only ends
    ``recv()`` when the TCP connection is gone. A client that closes while a
    stream is backed up cannot receive our closing frame behind the queued
    deltas, so that takes until ``close_timeout``; all that time the producer
    would keep running for nobody. ``on_peer_close`` is called as soon as the
    close frame arrives.

    **Buffered output has a hard ceiling, whoever wrote it.** Our own sends
    wait above ``write_limit``, but websockets answers every ping with a pong
    written without flow control: a client that sends pings and never reads
    would grow the write buffer without limit. After each read, if the write
    buffer holds more than ``output_ceiling`` bytes, reading from the client
    stops (so it cannot make us write more) until the buffer drains to the
    low-water mark; if it has not drained within ``output_timeout`` seconds,
    the connection is aborted.

    Reading is paused for either of two reasons — this ceiling, or
    websockets' own ``max_queue`` of received messages — and resumes only
    when neither holds.
    """

    on_peer_close: Callable[[], None] | None = None
    #: Set by the server before the handshake completes (``None`` = no ceiling).
    output_ceiling: int | None = None
    output_timeout: float = 10.0
    #: Times reading was paused because of the output ceiling (metrics, tests).
    output_overflows: int = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._read_holds: set[str] = set()
        self._overflow_timer: asyncio.TimerHandle | None = None
        #: Set while reading from the client is paused, for whatever reason.
        self.reading_paused = asyncio.Event()
        #: Set while the write buffer is above ``write_limit`` (sends wait).
        self.writing_paused = asyncio.Event()
        # websockets pauses and resumes reading for its receive queue by
        # calling these; route them through the same set of reasons.
        self.recv_messages.pause = functools.partial(self._hold_reading, "max_queue")
        self.recv_messages.resume = functools.partial(self._release_reading, "max_queue")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.protocol.close_rcvd is not None and self.on_peer_close is not None:
            callback, self.on_peer_close = self.on_peer_close, None
            callback()
        ceiling = self.output_ceiling
        if (
            ceiling is not None
            and "output" not in self._read_holds
            and self.transport.get_write_buffer_size() > ceiling
        ):
            self.output_overflows += 1
            self._hold_reading("output")
            self._overflow_timer = self.loop.call_later(self.output_timeout, self._overflowed)

    def pause_writing(self) -> None:
        super().pause_writing()
        self.writing_paused.set()

    def resume_writing(self) -> None:
        super().resume_writing()
        self.writing_paused.clear()
        # The write buffer drained to the low-water mark: the client reads.
        if self._overflow_timer is not None:
            self._overflow_timer.cancel()
            self._overflow_timer = None
        self._release_reading("output")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._overflow_timer is not None:
            self._overflow_timer.cancel()
            self._overflow_timer = None
        self.on_peer_close = None
        super().connection_lost(exc)

    def receive_buffered_bytes(self) -> int:
        """Bytes received from the client and not yet handed to our receive loop."""
        queued = sum(len(frame.data) for frame in self.recv_messages.frames.queue)
        return queued + len(self.protocol.reader.buffer)

    def _overflowed(self) -> None:
        self._overflow_timer = None
        self.logger.warning(
            "client read nothing of %d buffered bytes for %.1fs; aborting",
            self.transport.get_write_buffer_size(),
            self.output_timeout,
        )
        self.transport.abort()

    def _hold_reading(self, reason: str) -> None:
        if not self._read_holds:
            self.transport.pause_reading()
            self.reading_paused.set()
        self._read_holds.add(reason)

    def _release_reading(self, reason: str) -> None:
        if reason not in self._read_holds:
            return
        self._read_holds.discard(reason)
        if not self._read_holds:
            self.reading_paused.clear()
            if not self.transport.is_closing():
                self.transport.resume_reading()


#: asyncio reads at most this much per ``data_received``: the most that one
#: read can add to the write buffer in automatic replies (pongs) before the
#: output ceiling is checked, and the most a read adds on the receive side.
READ_CHUNK_BYTES: Final = 256 * 1024
#: The longest text one token may carry, for the channel's bound in bytes
#: (llama.cpp vocabularies stay far below it).
MAX_TOKEN_BYTES: Final = 256


def memory_bound(config: Config) -> dict[str, int]:
    """The most one connection holds in process memory, by part (bytes).

    * send: the output ceiling, one read's worth of pongs on top, and the
      channel (``queue_tokens`` tokens); the kernel's ``sndbuf`` comes on
      top of that in kernel memory;
    * receive: websockets' queue (``max_queue`` + 1 frames before it pauses
      reading), the frame being parsed, the message our receive loop is
      handling, and one read;
    * restart: the inputs kept for ``restart`` — the budget, or one maximal
      input (4 bytes a character) if that is larger.
    """
    server, stream, limits = config.server, config.stream, config.limits
    ceiling = max(server.max_output_bytes, server.write_limit)
    return {
        "send": ceiling + READ_CHUNK_BYTES + stream.queue_tokens * MAX_TOKEN_BYTES,
        "receive": (server.max_queue + 3) * server.max_frame_bytes + READ_CHUNK_BYTES,
        "restart": max(limits.restart_memory_bytes, 4 * limits.max_prompt_chars + 4096),
    }


def peer_aware_connection(
    *, output_ceiling: int, output_timeout: float
) -> type[PeerAwareConnection]:
    """A :class:`PeerAwareConnection` class with this server's output ceiling."""
    return type(
        "PeerAwareConnection",
        (PeerAwareConnection,),
        {"output_ceiling": output_ceiling, "output_timeout": output_timeout},
    )


class Connection:
    """Serves one client. Create per handshake and ``await run()``."""

    def __init__(self, server: Server, websocket: ServerConnection, conn_id: str) -> None:
        self.server = server
        self.ws = websocket
        self.conn_id = conn_id
        config = server.config
        self.session = Session(restart_bytes=config.limits.restart_memory_bytes)
        self.generations: dict[str, Generation] = {}
        self._send_timeout = config.server.send_timeout_s
        self._idle_timeout = config.server.idle_timeout_s or None
        self._flush_window = config.stream.flush_ms / 1000.0
        self._flush_tokens = config.stream.flush_tokens
        self._queue_tokens = config.stream.queue_tokens
        self._stall_timeout = config.stream.stall_timeout_s or None
        sock = websocket.transport.get_extra_info("socket") if websocket.transport else None
        self._socket_fd: int | None = sock.fileno() if sock is not None else None
        # How often a blocked send looks at the client's progress.
        self._watch_s = min(0.25, self._send_timeout / 4, (self._stall_timeout or 1.0) / 4)
        self._loop = asyncio.get_running_loop()
        self.closed = False
        if isinstance(websocket, PeerAwareConnection):
            websocket.on_peer_close = self._peer_closed
        self._metrics = server.metrics
        limits = config.limits
        self._frame_limiter = FrameLimiter(
            rate=limits.frames_per_s,
            burst=limits.frames_burst,
            close_after=limits.flood_close_after,
            now=self._loop.time(),
        )

    # ------------------------------------------------------------ receive loop

    async def run(self) -> None:
        server = self.server
        try:
            await self._send(
                Hello(
                    model=server.backend.model_name, server=server.server_name, limits=server.limits
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
                    log.info(
                        "conn=%s idle for %.0fs; closing",
                        self.conn_id,
                        idle,
                        extra=context(self.conn_id),
                    )
                    await self._close(1000, "idle timeout")
                    return
                await self._receive(message)
        except ConnectionClosed:
            pass
        finally:
            self.closed = True
            await self._teardown()

    async def _receive(self, message: str | bytes) -> None:
        now = self._loop.time()
        verdict = self._frame_limiter.check(now)
        if verdict != "ok":
            if verdict == "flood":
                log.warning(
                    "conn=%s kept sending over the frame rate limit; closing",
                    self.conn_id,
                    extra=context(self.conn_id),
                )
                await self._close_discarding(1008, "frame rate limit exceeded")
                raise ConnectionClosed(None, None)
            limited = ProtocolError("rate_limited", "too many frames; slow down")
            await self._apply(self.session.refuse(limited))
            return
        try:
            frame = parse_client_frame(message, self.server.limits)
        except ProtocolError as exc:
            log.debug(
                "conn=%s refused frame: %s %s",
                self.conn_id,
                exc.code,
                exc.message,
                extra=context(self.conn_id, exc.request_id),
            )
            await self._apply(self.session.refuse(exc))
            return
        await self._apply(self.session.handle(frame, now))

    async def _apply(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Send):
                frame = effect.frame
                if isinstance(frame, Error):
                    self._metrics.errors.labels(frame.code).inc()
                    log.info(
                        "conn=%s id=%s refused: %s %s",
                        self.conn_id,
                        frame.id,
                        frame.code,
                        frame.message,
                        extra=context(self.conn_id, frame.id, code=frame.code),
                    )
                elif isinstance(frame, Done):
                    self._log_done(frame)
                await self._send(frame)
            elif isinstance(effect, StartGeneration):
                self._start(effect.request)
            elif isinstance(effect, StopGeneration):
                generation = self.generations.get(effect.id)
                if generation is not None:
                    log.info(
                        "conn=%s id=%s cancel",
                        self.conn_id,
                        effect.id,
                        extra=context(self.conn_id, effect.id),
                    )
                    generation.cancel_requested = self._loop.time()
                    if generation.exited is not None:
                        # Cancel latency ends when the thread is gone and its slot
                        # free (released by an earlier callback on the same future),
                        # not when this connection's sender gets round to it.
                        generation.exited.add_done_callback(
                            functools.partial(_mark_exited, generation, self._loop)
                        )
                    generation.stop()

    def _peer_closed(self) -> None:
        """The client sent its close frame: stop producing for it right away."""
        log.info(
            "conn=%s client is closing; stopping its generation",
            self.conn_id,
            extra=context(self.conn_id),
        )
        self.closed = True
        for gen in list(self.generations.values()):
            gen.stop()

    # ------------------------------------------------------------ generation

    def _start(self, request: Generate) -> None:
        channel = Channel(self._queue_tokens)
        generation = Generation(request=request, channel=channel, created=self._loop.time())
        self.generations[request.id] = generation
        generation.task = asyncio.create_task(
            self._run_generation(generation), name=f"generation-{self.conn_id}-{request.id}"
        )

    async def _run_generation(self, gen: Generation) -> None:
        request_id = gen.request.id
        scheduler = self.server.scheduler
        try:
            gen.acquire = asyncio.ensure_future(
                scheduler.acquire(request_id, lambda position: self._queued(request_id, position))
            )
            try:
                gen.slot = await gen.acquire
            except asyncio.CancelledError:
                if gen.stopped:
                    return  # cancelled while waiting for the model
                raise
            except ProtocolError as exc:
                self.session.reject(request_id)
                await self._send_safely(self.session.refuse(exc))
                return
            if gen.stopped:
                return
            frame = self.session.started(request_id, self._loop.time())
            if frame is None:
                return
            queued_ms = (self._loop.time() - gen.created) * 1000.0
            log.info(
                "conn=%s id=%s started slot=%s queued=%.1fms",
                self.conn_id,
                request_id,
                gen.slot,
                queued_ms,
                extra=context(
                    self.conn_id, request_id, slot=gen.slot, queued_ms=round(queued_ms, 3)
                ),
            )
            await self._send(frame)
            self._spawn_producer(gen)
            await self._pump(gen)
        except ConnectionClosed:
            gen.stop()
        except Exception:
            log.exception(
                "conn=%s id=%s sender failed",
                self.conn_id,
                request_id,
                extra=context(self.conn_id, request_id),
            )
            gen.stop()
        finally:
            if gen.exited is not None:
                # Never leave a producer behind: wait for its thread to exit.
                # (Its slot was released the moment it exited; see _spawn_producer.)
                await asyncio.shield(gen.exited)
                thread = gen.thread
                if thread is not None and thread.is_alive():
                    # ``exited`` is set from the thread's last lines; the thread
                    # itself ends a moment later. Join it, so that "stopped"
                    # means gone (a leak check right after cannot see it).
                    await asyncio.to_thread(thread.join, 5.0)
            elif gen.slot is not None:
                scheduler.release(gen.slot)
            self._producer_gone(gen)
            self.generations.pop(request_id, None)
            if not self.closed:
                await self._send_safely(
                    self.session.producer_stopped(request_id, self._loop.time())
                )

    def _producer_gone(self, gen: Generation) -> None:
        """Metrics and a log line once the producer has exited and the slot is free."""
        self._metrics.producer_finished(gen)
        if gen.cancel_requested is not None:
            end = gen.exited_at if gen.exited_at is not None else self._loop.time()
            latency = end - gen.cancel_requested
            self._metrics.cancel_latency.observe(latency)
            log.info(
                "conn=%s id=%s producer stopped %.1fms after the cancel",
                self.conn_id,
                gen.request.id,
                latency * 1000.0,
                extra=context(
                    self.conn_id, gen.request.id, cancel_latency_ms=round(latency * 1000.0, 3)
                ),
            )

    def _queued(self, request_id: str, position: int) -> None:
        frame = self.session.queued(request_id, position)
        if frame is not None:
            self._in_background(self._send_queued(request_id, frame))

    async def _send_queued(self, request_id: str, frame: ServerFrame) -> None:
        # This runs as a task, after the scheduler's callback: meanwhile a cancel
        # may have ended the request and sent its done. Check at the last moment
        # (no await between the check and the write) so that a queued frame
        # never follows its done.
        if self.session.state_of(request_id) is not RequestState.WAITING:
            return
        await self._send_safely([Send(frame)])

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> None:
        """Run a send from a callback; the server keeps the task referenced."""
        task = asyncio.create_task(coroutine)
        self.server.background.add(task)
        task.add_done_callback(self.server.background.discard)

    def _spawn_producer(self, gen: Generation) -> None:
        # The model is free as soon as the producer thread is gone, even if the
        # sender is still stuck on a slow socket with the last frames.
        assert gen.slot is not None
        granted: int = gen.slot
        scheduler = self.server.scheduler
        request = GenerationRequest.from_frame(
            gen.request, default_max_tokens=self.server.limits.default_max_tokens
        )
        start_producer(
            gen,
            self.server.backend,
            request,
            loop=self._loop,
            on_failed=self._producer_failed,
            on_exit=lambda: scheduler.release(granted),
            name=f"wsserver-producer-{self.conn_id}-{request.id}",
            log_context=context(self.conn_id, request.id),
        )

    def _producer_failed(self, gen: Generation, outcome: Outcome) -> None:
        """On the loop: the producer ended abnormally and could not queue its end."""
        done = self.session.finish(gen.request.id, outcome, self._loop.time())
        gen.channel.close()
        if done is not None:
            # Logged (and counted) when sent, like every done.
            self._in_background(self._send_safely([Send(done)]))

    async def _pump(self, gen: Generation) -> None:
        """The sender: channel → coalesced ``delta`` frames → socket."""
        request_id = gen.request.id
        queue = gen.channel.queue.async_q
        coalescer = Coalescer(flush_window=self._flush_window, flush_tokens=self._flush_tokens)
        loop = self._loop
        session = self.session
        while True:
            if coalescer.due(loop.time()):
                if not await self._flush(gen, coalescer):
                    return
                continue
            try:
                # Wait for the window only with text pending: tokens whose bytes
                # are held back (half a character) never make a flush due, and
                # waiting on a past deadline for them would spin.
                if coalescer.has_text:
                    async with asyncio.timeout_at(coalescer.deadline()):
                        item = await queue.get()
                else:
                    item = await queue.get()
            except TimeoutError:
                continue
            except janus.AsyncQueueShutDown:
                return
            end = self._take(gen, coalescer, item)
            # Merge whatever else is already waiting: one frame, not many.
            while end is None:
                try:
                    item = queue.get_nowait()
                except (janus.AsyncQueueEmpty, janus.AsyncQueueShutDown):
                    break
                end = self._take(gen, coalescer, item)
            if end is not None:
                await self._flush(gen, coalescer)
                done = session.finish(request_id, end.outcome, loop.time())
                if done is not None:
                    self._log_done(done)
                    await self._send(done)
                return

    async def _flush(self, gen: Generation, coalescer: Coalescer) -> bool:
        """Send everything pending as one delta. False if the request has ended."""
        now = self._loop.time()
        text, tokens = coalescer.take(now)
        self._metrics.tokens.inc(tokens)
        frame = self.session.delta(gen.request.id, text, tokens, now)
        if frame is None:
            return self.session.state_of(gen.request.id) is RequestState.RUNNING
        if frame.seq == 0:
            self._log_first_text(gen)
        await self._send(frame)
        return True

    def _take(self, gen: Generation, coalescer: Coalescer, item: Item) -> End | None:
        if isinstance(item, Piece):
            coalescer.add(item.text, item.tokens)
            return None
        if isinstance(item, PromptDone):
            self.session.prompt_processed(gen.request.id, item.prompt_tokens)
            return None
        return item

    # ------------------------------------------------------------ sending

    async def _send(self, frame: ServerFrame) -> None:
        """Send one frame. While the client reads slowly, watch its progress.

        ``send()`` writes the frame at once and then waits while the write
        buffer is above ``write_limit``. If that takes longer than one watch
        interval, :meth:`_drain_watching` takes over the wait.
        """
        data = serialize(frame)
        try:
            async with asyncio.timeout(self._watch_s):
                await self.ws.send(data, text=True)
            return
        except TimeoutError:
            # The frame is written; only the wait for the drain was cut short.
            pass
        await self._drain_watching()

    async def _drain_watching(self) -> None:
        """Wait for the write buffer to drain, judging the client by its progress.

        Progress means the bytes outstanding to the client (write buffer plus
        the kernel's unacknowledged queue) went down: the client is reading,
        however slowly, and a slow reader is never cut off for its speed. With
        no progress for ``stream.stall_timeout_s`` while a producer is blocked
        on the full channel and another request waits for the model, that
        request ends as ``stalled`` and the model goes to the next one; with
        none for ``server.send_timeout_s`` the connection is aborted (keepalive
        pings cannot tell: they queue behind the same buffer).
        """
        transport = self.ws.transport
        loop = self._loop
        last_size = self._outstanding_bytes()
        last_progress = loop.time() - self._watch_s
        while True:
            try:
                async with asyncio.timeout(self._watch_s):
                    await self.ws.drain()
                return
            except TimeoutError:
                pass
            if transport.is_closing():
                raise ConnectionClosed(None, None)
            now = loop.time()
            size = self._outstanding_bytes()
            if size < last_size:
                last_progress = now
            last_size = size
            idle = now - last_progress
            if self._stall_timeout is not None and idle >= self._stall_timeout:
                self._stall_blocked_producers()
            if idle >= self._send_timeout:
                log.warning(
                    "conn=%s send made no progress for %.1fs; aborting the connection",
                    self.conn_id,
                    idle,
                    extra=context(self.conn_id, self.session.active_id),
                )
                transport.abort()
                raise ConnectionClosed(None, None)

    def _outstanding_bytes(self) -> int:
        """Bytes sent to this client that it has not yet received.

        The transport's write buffer plus, on Linux, the socket's unacknowledged
        send queue (SIOCOUTQ): the kernel's buffer shrinks as soon as the
        client's TCP stack acknowledges data, long before the transport's
        buffer moves, so a slow reader shows its progress at a fine grain.
        """
        size = self.ws.transport.get_write_buffer_size()
        if self._socket_fd is not None:
            try:
                size += struct.unpack(
                    "i", fcntl.ioctl(self._socket_fd, termios.TIOCOUTQ, b"\0\0\0\0")
                )[0]
            except OSError:
                self._socket_fd = None
        return size

    def _stall_blocked_producers(self) -> None:
        """End requests whose producer waits on a client that reads nothing,
        when another request is waiting for the model (else nobody is harmed)."""
        if self.server.scheduler.waiting == 0:
            return
        for gen in list(self.generations.values()):
            if gen.channel.blocked.is_set() and not gen.stopped:
                log.warning(
                    "conn=%s id=%s client read nothing for %.1fs; ending the request as stalled",
                    self.conn_id,
                    gen.request.id,
                    self._stall_timeout,
                    extra=context(self.conn_id, gen.request.id),
                )
                self._producer_failed(
                    gen,
                    Outcome(
                        reason="error",
                        completion_tokens=gen.channel.tokens,
                        error_code="stalled",
                        error_message="the client read nothing for the stall timeout",
                    ),
                )
                gen.stop()

    async def _send_safely(self, effects: Iterable[Effect]) -> None:
        with contextlib.suppress(ConnectionClosed):
            await self._apply(effects)

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
        generations = list(self.generations.values())
        for gen in generations:
            gen.stop()
        tasks = [g.task for g in generations if g.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def _log_done(self, frame: ServerFrame) -> None:
        fields: dict[str, object] = {}
        if isinstance(frame, Done):
            self._metrics.done(frame)
            timings = frame.timings
            fields = {
                "reason": frame.reason,
                "queued_ms": round(timings.queued_ms, 3),
                "ttft_ms": None if timings.ttft_ms is None else round(timings.ttft_ms, 3),
                "total_ms": round(timings.total_ms, 3),
                "completion_tokens": frame.usage.completion_tokens,
            }
        request_id = getattr(frame, "id", None)
        log.info(
            "conn=%s id=%s done %s",
            self.conn_id,
            request_id,
            _done_summary(frame),
            extra=context(self.conn_id, request_id, **fields),
        )

    def _log_first_text(self, gen: Generation) -> None:
        ttft_ms = (self._loop.time() - gen.created) * 1000.0
        log.info(
            "conn=%s id=%s first text ttft=%.1fms",
            self.conn_id,
            gen.request.id,
            ttft_ms,
            extra=context(self.conn_id, gen.request.id, ttft_ms=round(ttft_ms, 3)),
        )

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
                    await self._send_safely(
                        self.session.handle(Cancel(id=request_id), self._loop.time())
                    )
                await self._close(1001, "server shutting down")
        except TimeoutError:
            log.info(
                "conn=%s did not take part in closing; aborting",
                self.conn_id,
                extra=context(self.conn_id),
            )
            self.ws.transport.abort()


def _done_summary(frame: ServerFrame) -> str:
    reason = getattr(frame, "reason", "?")
    usage = getattr(frame, "usage", None)
    timings = getattr(frame, "timings", None)
    if usage is None or timings is None:
        return reason
    ttft = "-" if timings.ttft_ms is None else f"{timings.ttft_ms:.1f}ms"
    return (
        f"reason={reason} prompt_tokens={usage.prompt_tokens} "
        f"completion_tokens={usage.completion_tokens} queued={timings.queued_ms:.1f}ms "
        f"ttft={ttft} total={timings.total_ms:.1f}ms tok/s={timings.tokens_per_s:.1f}"
    )


def _mark_exited(gen: Generation, loop: asyncio.AbstractEventLoop, _: object) -> None:
    gen.exited_at = loop.time()
