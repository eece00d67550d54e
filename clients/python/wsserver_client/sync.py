"""A synchronous client for wsserver, built on websockets' sync client.

    from wsserver_client.sync import Client

    with Client("ws://127.0.0.1:8765/") as client:
        for text in client.generate("Once upon a time", max_tokens=64):
            print(text, end="", flush=True)

The same shape as the async client (:mod:`wsserver_client.client`) and the
same rules, because both run on :mod:`wsserver_client.core`: requests by ID,
and nothing of a cancelled or restarted request reaches the caller.

There is no reader thread of ours. websockets' sync connection receives in its
own background thread; this module takes frames from it only while the
caller iterates or waits (:meth:`Stream.result`, :meth:`Client.cancel`), and
routes each to its request — so a loop that stops reading makes the server
wait, which is the backpressure the server is built around. Use a client
from one thread at a time.

**Ctrl-C.** A ``KeyboardInterrupt`` inside ``for text in stream`` (nearly
always raised while the loop waits for the next frame) cancels the request
in-band — a ``cancel`` frame, then the server's ``done`` with reason
``cancelled`` — and is raised again: the script stops as Python scripts do,
and a caller who catches it finds ``stream.done.reason == "cancelled"``. An
interrupt that lands in the loop body instead is not seen by the stream; it
still leaves the ``with`` block, and closing the client cancels in-band
whatever still runs before the connection closes. (A caller who catches
``KeyboardInterrupt`` to carry on can call ``stream.cancel()``: it does nothing
more if the request is already cancelled.)

**Reconnecting**, as in the async client and by the same policy
(:mod:`wsserver_client.reconnect`): with ``resumable=True`` a lost connection
is reconnected (backing off, for up to ``reconnect_timeout`` seconds) while
the caller waits, the live requests are resumed, and the iterator goes on;
``on_reconnect`` and :attr:`Client.reconnects` tell.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import orjson
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from wsserver.core.protocol import Done, Progress, PullDone

from .base import ClientBase
from .core import (
    Embedding,
    Event,
    GenerationError,
    PullRequest,
    Reasoning,
    Request,
    RequestResult,
    Text,
    ToolCall,
    ToolCallDelta,
)

__all__ = [
    "Client",
    "Event",
    "GenerationError",
    "Pull",
    "Reasoning",
    "RequestResult",
    "Stream",
    "Text",
    "ToolCall",
    "ToolCallDelta",
]

T = TypeVar("T")


class Stream(Request):
    """One request. Iterate for text; ``done`` is set at the end.

    ``for event in stream.events()`` yields every event instead: the
    answer's :class:`~wsserver_client.core.Text`, the model's
    :class:`~wsserver_client.core.Reasoning` and each part of its tool calls
    (:class:`~wsserver_client.core.ToolCallDelta`). Either way
    :attr:`reasoning` and :attr:`tool_calls` hold what arrived.

    Leaving the loop with ``break`` does not cancel the request (iterate
    again to read on); :meth:`cancel`, :meth:`Client.restart` or Ctrl-C does.
    """

    def __init__(self, client: Client, request_id: str, frame: dict[str, Any]) -> None:
        super().__init__(request_id, frame)
        self.client = client

    def send(self) -> Stream:
        """Send the request frame (iteration does this by itself), after its
        images' uploads."""
        if not self.sent:
            self.sent = True
            uploads, self.uploads = self.uploads, []
            self.client._send_request(self.frame, uploads)
        return self

    def __iter__(self) -> Iterator[str]:
        return self._iterate(self.pieces)

    def events(self) -> Iterator[Event]:
        """Iterate the request's events (text, reasoning, tool call parts)."""
        return self._iterate(self.event_pieces)

    def _iterate(self, items: Callable[[], Iterator[T | None]]) -> Iterator[T]:
        try:
            self.send()
            for item in items():
                if item is None:
                    self.client._wait(lambda: self.ready)
                else:
                    yield item
        except KeyboardInterrupt:
            self._interrupted()
            raise

    def result(self, timeout: float | None = None) -> RequestResult:
        """Read to the end; return the whole text and the ``done`` frame."""
        for _ in self:
            pass
        self.wait_done(timeout)
        return self.finished_result()

    def cancel(self, timeout: float | None = None) -> Done | None:
        """Cancel in-band and wait for this request's ``done``; once it has
        ended, just return its ``done``."""
        if self.finished:
            return self.done
        return self.client.cancel(self.id, timeout=timeout)

    def wait_done(self, timeout: float | None = None) -> Done | None:
        """Wait for the end of the request without reading its text (sending
        it first if it was not sent yet)."""
        self.send()
        self.client._wait(lambda: self.finished, timeout)
        return self.done

    def _interrupted(self) -> None:
        """Ctrl-C: cancel in-band, as far as the connection allows."""
        if not self.sent or self.finished:
            return
        with contextlib.suppress(GenerationError, TimeoutError):
            self.cancel(timeout=self.client.cancel_timeout)


class Pull(PullRequest):
    """A model being pulled onto the server. ``for progress in pull`` yields
    its progress reports; :meth:`result` is its ``pull_done``."""

    def __init__(self, client: Client, request_id: str, frame: dict[str, Any]) -> None:
        super().__init__(request_id, frame)
        self.client = client

    def send(self) -> Pull:
        if not self.sent:
            self.sent = True
            self.client._send(self.frame)
        return self

    def __iter__(self) -> Iterator[Progress]:
        self.send()
        for report in self.reports():
            if report is None:
                self.client._wait(lambda: self.ready)
            else:
                yield report

    def result(self, timeout: float | None = None) -> PullDone:
        """Wait for the end: the ``pull_done`` frame."""
        self.send()
        self.client._wait(lambda: self.finished, timeout)
        for _ in self:
            pass
        return self.finished_done()

    def cancel(self, timeout: float | None = None) -> PullDone:
        """Cancel it; its ``pull_done`` (reason ``cancelled``) comes at once."""
        if not self.finished and self.sent:
            self.client._send({"type": "cancel", "id": self.id})
        elif not self.sent:
            self.done = PullDone(id=self.id, reason="cancelled")
            self.client.requests.pulls.pop(self.id, None)
        return self.result(timeout)


class Client(ClientBase[Stream]):
    """A connection to wsserver. Use as a context manager.

    ``cancel_timeout`` bounds how long Ctrl-C and :meth:`close` wait for the
    ``done`` of a request they cancel. The other options are the async
    client's (:class:`~wsserver_client.base.ClientBase`); keyword arguments
    other than those go to :func:`websockets.sync.client.connect`
    (``open_timeout``, ``max_size``, …).
    """

    def __init__(self, url: str, *, cancel_timeout: float = 10.0, **options: Any) -> None:
        self.cancel_timeout = cancel_timeout
        super().__init__(url, **options)

    def _init_io(self) -> None:
        self.ws: ClientConnection | None = None
        self._lost: str | None = None
        self._exit = contextlib.ExitStack()

    def __enter__(self) -> Client:
        self.connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def connect(self) -> None:
        headers = self._headers
        # Entered as a context manager: websockets >= 17.1 deprecates using
        # connect()'s return value directly, and older versions allow both.
        self.ws = self._exit.enter_context(
            connect(self.url, additional_headers=headers or None, **self._connect_kwargs)
        )
        self.requests.hello_from(self.ws.recv(timeout=self._connect_kwargs.get("open_timeout", 10)))

    def close(self) -> None:
        """Cancel in-band what still runs, then close the connection."""
        if self.ws is None:
            return
        self._closing = True
        running = [s for s in self.requests.live.values() if s.sent and not s.abandoned]
        try:
            with contextlib.suppress(GenerationError, TimeoutError):
                for stream in running:
                    self._send(self.requests.cancel_frame(stream.id)[1])
                deadline = time.monotonic() + self.cancel_timeout
                for stream in running:
                    stream.wait_done(max(0.0, deadline - time.monotonic()))
        finally:
            self._exit.close()

    def cancel(self, request_id: str, *, timeout: float | None = None) -> Done | None:
        """Cancel in-band; returns the request's ``done`` (``None`` if it had none)."""
        stream, frame = self.requests.cancel_frame(request_id)
        self._send(frame)
        if stream is None:
            return None
        return stream.wait_done(timeout)

    def send_raw(self, data: str | bytes) -> None:
        """Send a frame as is (for tests and debugging)."""
        assert self.ws is not None
        self.ws.send(data)

    # ------------------------------------------------------------ internals

    def _stream(self, request_id: str, frame: dict[str, Any]) -> Stream:
        return Stream(self, request_id, frame)

    def _pull(self, request_id: str, frame: dict[str, Any]) -> Pull:
        return Pull(self, request_id, frame)

    def embed(
        self,
        input: Any,
        *,
        model: str | None = None,
        id: str | None = None,
        timeout: float | None = None,
    ) -> Embedding:
        """Each input's vector (docs/embeddings.md): ``input`` is a string,
        strings, token ids or token-id arrays. Raises :class:`GenerationError`
        when it is refused or fails; past ``timeout`` (TimeoutError, or
        Ctrl-C) the embed is cancelled on the server."""
        embed, frame = self._embed_request(input, model, id)
        embed.sent = True
        self._send(frame)
        try:
            self._wait(lambda: embed.finished, timeout)
        except (TimeoutError, KeyboardInterrupt):
            if not embed.finished:
                self.requests.embeds.pop(embed.id, None)
                with contextlib.suppress(GenerationError):
                    self._send({"type": "cancel", "id": embed.id})
            raise
        return embed.result()

    def pull(self, reference: str, *, id: str | None = None) -> Pull:
        pull: Pull = super().pull(reference, id=id)
        return pull

    def _send_request(self, frame: dict[str, Any], uploads: list[bytes]) -> None:
        """A ``generate`` or ``restart`` frame, its uploads first (binary frames)."""
        assert self.ws is not None, "call connect() first"
        for data in uploads:
            if self._lost is not None:
                raise GenerationError("connection_lost", self._lost, frame.get("id"))
            try:
                self.ws.send(data)
            except ConnectionClosed as exc:
                self._connection_lost(exc)
                raise GenerationError("connection_lost", str(exc), frame.get("id")) from None
        self._send(frame)

    def _send(self, frame: dict[str, Any]) -> None:
        assert self.ws is not None, "call connect() first"
        if self._lost is not None:
            raise GenerationError("connection_lost", self._lost, frame.get("id"))
        try:
            self.ws.send(orjson.dumps(frame), text=True)
        except ConnectionClosed as exc:
            self._connection_lost(exc)
            if self._lost is None:  # reconnected (and resumed): send it there
                self._send(frame)
                return
            raise GenerationError("connection_lost", self._lost or "", frame.get("id")) from exc

    def _wait(self, ready: Callable[[], bool], timeout: float | None = None) -> None:
        """Receive and route frames until ``ready()``.

        Raises TimeoutError after ``timeout`` seconds, and GenerationError if
        the connection is gone and ``ready()`` still is not true.
        """
        assert self.ws is not None, "call connect() first"
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            if self._lost is not None:
                raise GenerationError("connection_lost", self._lost)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                message = self.ws.recv(timeout=remaining)
            except ConnectionClosed as exc:
                self._connection_lost(exc)
                continue
            request = self.requests.receive(message)
            if request is not None and request.retry_resume:
                self._retry_resume(request)

    def _connection_lost(self, exc: ConnectionClosed) -> None:
        if self._lost is not None:
            return
        reason = f"connection closed: {exc}"
        if not self._closing and self.requests.lost(reason, keep_resumable=True):
            if self._reconnect():
                return
            reason += "; could not reconnect"
        self._lost = reason
        self.requests.lost(reason)

    def _reconnect(self) -> bool:
        """Connect again, after the policy's waits, and resume the kept requests."""
        for wait in self.requests.reconnect_waits():
            time.sleep(wait)  # sleep-ok: reconnect backoff
            self._exit.close()
            try:
                self.connect()
                assert self.ws is not None
                for frame in self.requests.resume_frames():
                    self.ws.send(orjson.dumps(frame), text=True)
            except (OSError, ConnectionClosed, TimeoutError, GenerationError):
                continue
            self._reconnected()
            return True
        return False

    def _retry_resume(self, request: Stream) -> None:
        """The server still holds the request for the old connection; ask again."""
        wait = self.requests.retry_wait(request)
        if wait is None:
            return
        time.sleep(wait)  # sleep-ok: resume backoff
        self._send(self.requests.resume_frame(request))
