"""The websockets connection class, with the guards the library lacks, and the
memory one connection may hold.

:class:`PeerAwareConnection` is what ``serve(create_connection=...)`` builds
for every client; :func:`memory_bound` adds up what its ceilings allow
(docs/operations.md, "Memory per connection").
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Final

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Response

from ..config import Config
from ..core.image_check import MAX_IMAGE_BYTES
from ..core.logprobs import MAX_ENTRY_BYTES
from ..core.pacing import FRAME_LOGPROB_TOKENS, FRAME_TEXT_CHARS

__all__ = [
    "CHANNEL_TOKEN_BYTES",
    "MAX_TOKEN_BYTES",
    "READ_CHUNK_BYTES",
    "PeerAwareConnection",
    "detached_bound",
    "memory_bound",
    "peer_aware_connection",
    "resume_tail_bytes",
]


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

    **Bytes after the handshake request are the client's fault, in one line.**
    websockets parses whatever follows the request as WebSocket frames; a
    pipelined second HTTP request fails the connection (EOF sent) before the
    first is answered, and answering it then trips websockets' ``assert not
    self.eof_sent`` with an ERROR traceback. The answer is skipped instead and
    the connection closes (it is failed already); one INFO line says why.

    **Every close has a deadline.** Once websockets has ended its side (EOF
    sent: a failed connection, a refused handshake, a finished closing
    handshake) the transport still waits for the client to take what is
    buffered; a client that never reads would keep the socket for good. It is
    aborted after ``output_timeout`` seconds.
    """

    on_peer_close: Callable[[], None] | None = None
    #: Set by the server before the handshake completes (``None`` = no ceiling).
    output_ceiling: int | None = None
    output_timeout: float = 10.0
    #: Times reading was paused because of the output ceiling (metrics, tests).
    output_overflows: int = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        protocol = self.protocol
        send_response = protocol.send_response

        def answer_unless_failed(response: Response) -> None:
            if protocol.eof_sent:
                self.logger.info(
                    "client sent more than its handshake request before the answer; closing"
                )
                return
            send_response(response)

        protocol.send_response = answer_unless_failed  # type: ignore[method-assign]
        self._close_deadline: asyncio.TimerHandle | None = None
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

    def send_data(self) -> None:
        super().send_data()
        if self.protocol.eof_sent and self._close_deadline is None:
            self._close_deadline = self.loop.call_later(self.output_timeout, self.transport.abort)

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
        if self._close_deadline is not None:
            self._close_deadline.cancel()
            self._close_deadline = None
        # The wrapper refers to the protocol and the connection: a cycle.
        vars(self.protocol).pop("send_response", None)
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
#: What one token in a channel may hold: its text, and its log-probabilities
#: with 20 alternatives (:data:`wsserver.core.logprobs.MAX_ENTRY_BYTES`) for a
#: request that asked for them.
CHANNEL_TOKEN_BYTES: Final = MAX_TOKEN_BYTES + MAX_ENTRY_BYTES


def memory_bound(config: Config) -> dict[str, int]:
    """The most one connection holds in process memory, by part (bytes).

    * send: the output ceiling, one read's worth of pongs on top, the
      channel (``queue_tokens`` tokens, each with its log-probabilities if
      the request asked for them) and what is merged for the next frame (one
      frame's text and log-probabilities at most); the kernel's ``sndbuf``
      comes on top of that in kernel memory;
    * receive: websockets' queue (``max_queue`` + 1 frames before it pauses
      reading), the frame being parsed, the message our receive loop is
      handling, and one read;
    * restart: the inputs kept for ``restart`` — the budget, or one maximal
      input (4 bytes a character) if that is larger;
    * resume: a resumable request's replay tail (:func:`resume_tail_bytes`),
      which any client may ask for;
    * upload: image uploads (binary frames) waiting for the next request,
      ``limits.max_upload_bytes``.

    A maximal input kept for ``restart`` carries a request's images too
    (:data:`~wsserver.core.image_check.MAX_IMAGE_BYTES`).
    """
    server, stream, limits = config.server, config.stream, config.limits
    ceiling = max(server.max_output_bytes, server.write_limit)
    return {
        "send": ceiling
        + READ_CHUNK_BYTES
        + stream.queue_tokens * CHANNEL_TOKEN_BYTES
        + 4 * FRAME_TEXT_CHARS
        + FRAME_LOGPROB_TOKENS * MAX_ENTRY_BYTES,
        "receive": (server.max_queue + 3) * server.max_frame_bytes + READ_CHUNK_BYTES,
        "restart": max(
            limits.restart_memory_bytes, 4 * limits.max_prompt_chars + 4096 + MAX_IMAGE_BYTES
        ),
        "resume": resume_tail_bytes(config),
        "upload": limits.max_upload_bytes,
    }


#: What Linux autotunes a send buffer up to (``net.ipv4.tcp_wmem``'s default
#: maximum), for ``server.sndbuf = 0``.
AUTOTUNED_SNDBUF_BYTES: Final = 4 << 20


def resume_tail_bytes(config: Config) -> int:
    """The wire bytes of sent deltas a resumable request keeps for a replay.

    ``stream.resume_tail_bytes``, or (0) what may be sent but not received:
    our frames wait above ``write_limit`` in the write buffer, whose ceiling
    is ``max(max_output_bytes, write_limit)``, and the kernel holds up to
    twice ``sndbuf`` (Linux doubles it). What the ceiling allows beyond
    ``write_limit`` (240 KiB by default) covers what the client's TCP stack
    took but its application never saw; a client that lost more gets
    ``seq_out_of_range``, never a gap.
    """
    server = config.server
    if config.stream.resume_tail_bytes:
        return config.stream.resume_tail_bytes
    sndbuf = server.sndbuf or AUTOTUNED_SNDBUF_BYTES
    return max(server.max_output_bytes, server.write_limit) + 2 * sndbuf


def detached_bound(config: Config) -> int:
    """The most a detached request holds while it waits for its resume: its
    replay tail and its full channel (wire/UTF-8 bytes, as measured by
    :meth:`wsserver.aio.resume.Resumes.held_bytes`)."""
    return resume_tail_bytes(config) + config.stream.queue_tokens * CHANNEL_TOKEN_BYTES


def peer_aware_connection(
    *, output_ceiling: int, output_timeout: float
) -> type[PeerAwareConnection]:
    """A :class:`PeerAwareConnection` class with this server's output ceiling."""
    return type(
        "PeerAwareConnection",
        (PeerAwareConnection,),
        {"output_ceiling": output_ceiling, "output_timeout": output_timeout},
    )
