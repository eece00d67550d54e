"""An asyncio client for wsserver, built on websockets.

    async with Client("ws://127.0.0.1:8765/") as client:
        async for text in client.generate(prompt="Once upon a time"):
            print(text, end="", flush=True)

One reader task receives every frame and hands it to the connection's
:class:`~wsserver_client.core.RequestTable`, which routes it by request ID.
The rules about requests — IDs, frames, and that nothing of a cancelled or
restarted request reaches the caller — live in :mod:`wsserver_client.core`,
shared with the synchronous client (:mod:`wsserver_client.sync`). The frame
classes and their parsing are shared with the server (:mod:`wsserver.core.protocol`).

**Reconnecting.** With ``Client(url, resumable=True)`` (or ``resumable=True``
on one request) the server keeps a request through a lost connection. When
the connection drops while such a request is live, the reader reconnects
(backing off, for up to ``reconnect_timeout`` seconds: the policy of
:mod:`wsserver_client.reconnect`, which the table applies), sends ``resume``
with the last ``seq`` received, and the stream's iterator just goes on; the
``on_reconnect`` callback and :attr:`Client.reconnects` say it happened.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from wsserver.core.protocol import Done, Progress, PullDone

from .base import ClientBase
from .core import (
    Embedding,
    EmbedRequest,
    Event,
    GenerationError,
    PullRequest,
    Request,
    RequestResult,
)

__all__ = ["Client", "GenerationError", "Pull", "RequestResult", "Stream"]

T = TypeVar("T")


class Stream(Request):
    """One request's frames. Iterate for text; ``done`` is set at the end.

    ``async for event in stream.events()`` yields every event instead: the
    answer's :class:`~wsserver_client.core.Text`, the model's
    :class:`~wsserver_client.core.Reasoning` and each part of its tool calls
    (:class:`~wsserver_client.core.ToolCallDelta`). Either way
    :attr:`reasoning` and :attr:`tool_calls` hold what arrived.

    Leaving the loop early does not cancel the request (iterate again to read
    on); :meth:`cancel` or :meth:`Client.restart` does.
    """

    def __init__(self, client: Client, request_id: str, frame: dict[str, Any]) -> None:
        super().__init__(request_id, frame)
        self.client = client
        self._wake = asyncio.Event()

    def changed(self) -> None:
        self._wake.set()

    async def send(self) -> Stream:
        """Send the request frame (iteration does this by itself), after its
        images' uploads."""
        if not self.sent:
            self.sent = True
            uploads, self.uploads = self.uploads, []
            await self.client._send_request(self.frame, uploads)
        return self

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate(self.pieces)

    def events(self) -> AsyncIterator[Event]:
        """Iterate the request's events (text, reasoning, tool call parts)."""
        return self._iterate(self.event_pieces)

    async def _iterate(self, items: Callable[[], Iterator[T | None]]) -> AsyncIterator[T]:
        await self.send()
        for item in items():
            if item is not None:
                yield item
                continue
            # Nothing can happen between items() finding nothing and clear():
            # no await in between, so no wake-up is lost. (Finding no text
            # may have passed over other events and left the request ended.)
            if not self.ready:
                self._wake.clear()
                await self._wake.wait()

    async def result(self) -> RequestResult:
        """Read to the end; return the whole text and the ``done`` frame."""
        async for _ in self:
            pass
        await self.wait_done()
        return self.finished_result()

    async def cancel(self) -> Done | None:
        """Cancel in-band and wait for this request's ``done``; once it has
        ended, just return its ``done``."""
        if self.finished:
            return self.done
        return await self.client.cancel(self.id)

    async def wait_done(self) -> Done | None:
        """Wait for the end of the request without consuming its text."""
        while not self.finished:
            self._wake.clear()
            await self._wake.wait()
        return self.done


class Pull(PullRequest):
    """A model being pulled onto the server. ``async for progress in pull``
    yields its progress reports; :meth:`result` is its ``pull_done``."""

    def __init__(self, client: Client, request_id: str, frame: dict[str, Any]) -> None:
        super().__init__(request_id, frame)
        self.client = client
        self._wake = asyncio.Event()

    def changed(self) -> None:
        self._wake.set()

    async def send(self) -> Pull:
        if not self.sent:
            self.sent = True
            await self.client._send(self.frame)
        return self

    async def __aiter__(self) -> AsyncIterator[Progress]:
        await self.send()
        for report in self.reports():
            if report is not None:
                yield report
            elif not self.ready:
                self._wake.clear()
                await self._wake.wait()

    async def result(self) -> PullDone:
        """Wait for the end: the ``pull_done`` frame."""
        async for _ in self:
            pass
        return self.finished_done()

    async def cancel(self) -> PullDone:
        """Cancel it; its ``pull_done`` (reason ``cancelled``) comes at once."""
        if not self.finished and self.sent:
            await self.client._send({"type": "cancel", "id": self.id})
        elif not self.sent:
            self.done = PullDone(id=self.id, reason="cancelled")
            self.client.requests.pulls.pop(self.id, None)
        return await self.result()


class _Embed(EmbedRequest):
    def __init__(self, request_id: str, frame: dict[str, Any]) -> None:
        super().__init__(request_id, frame)
        self.wake = asyncio.Event()

    def changed(self) -> None:
        self.wake.set()


class Client(ClientBase[Stream]):
    """A connection to wsserver. Use as an async context manager.

    The options are :class:`~wsserver_client.base.ClientBase`'s; keyword
    arguments other than those go to websockets'
    :func:`~websockets.asyncio.client.connect` (``open_timeout``, ``max_size``, …).
    """

    def _init_io(self) -> None:
        self.ws: ClientConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Clear while reconnecting: sends wait for the new connection.
        self._connected = asyncio.Event()
        #: A request's uploads and its frame go out together: the server's
        #: next generate or restart takes every upload before it.
        self._requesting = asyncio.Lock()

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        await self._open()
        self._reader = asyncio.create_task(self._read())

    async def _open(self) -> None:
        self.ws = await connect(
            self.url, additional_headers=self._headers or None, **self._connect_kwargs
        )
        self.requests.hello_from(await self.ws.recv())
        self._connected.set()

    async def close(self) -> None:
        self._closing = True
        self._connected.set()
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def cancel(self, request_id: str) -> Done | None:
        """Cancel in-band; returns the request's ``done`` (``None`` if it had none)."""
        stream, frame = self.requests.cancel_frame(request_id)
        await self._send(frame)
        if stream is None:
            return None
        return await stream.wait_done()

    async def send_raw(self, data: str | bytes) -> None:
        """Send a frame as is (for tests and debugging)."""
        assert self.ws is not None
        await self.ws.send(data)

    def _stream(self, request_id: str, frame: dict[str, Any]) -> Stream:
        return Stream(self, request_id, frame)

    def _pull(self, request_id: str, frame: dict[str, Any]) -> Pull:
        return Pull(self, request_id, frame)

    def _new_embed(self, request_id: str, frame: dict[str, Any]) -> EmbedRequest:
        return _Embed(request_id, frame)

    async def embed(
        self, input: Any, *, model: str | None = None, id: str | None = None
    ) -> Embedding:
        """Each input's vector (docs/embeddings.md): ``input`` is a string,
        strings, token ids or token-id arrays; the server runs it in its
        model's queue and engine beside the streams. Raises
        :class:`GenerationError` when it is refused or fails; cancelling the
        awaiting task cancels it on the server too."""
        embed, frame = self._embed_request(input, model, id)
        assert isinstance(embed, _Embed)
        embed.sent = True
        try:
            await self._send(frame)
            while not embed.finished:
                embed.wake.clear()
                await embed.wake.wait()
        except asyncio.CancelledError:
            if not embed.finished:
                self.requests.embeds.pop(embed.id, None)
                with contextlib.suppress(Exception):
                    await self._send({"type": "cancel", "id": embed.id})
            raise
        return embed.result()

    def pull(self, reference: str, *, id: str | None = None) -> Pull:
        pull: Pull = super().pull(reference, id=id)
        return pull

    async def _send(self, frame: dict[str, Any]) -> None:
        await self._connected.wait()  # while reconnecting, for the new connection
        assert self.ws is not None
        await self.ws.send(orjson.dumps(frame), text=True)

    async def _send_request(self, frame: dict[str, Any], uploads: list[bytes]) -> None:
        """A ``generate`` or ``restart`` frame, its uploads first (binary frames)."""
        async with self._requesting:
            for data in uploads:
                await self._connected.wait()
                assert self.ws is not None
                await self.ws.send(data)
            await self._send(frame)

    async def _read(self) -> None:
        reason = "connection closed"
        try:
            while True:
                assert self.ws is not None
                try:
                    async for message in self.ws:
                        request = self.requests.receive(message)
                        if request is not None and request.retry_resume:
                            task = asyncio.create_task(self._retry_resume(request))
                            self._tasks.add(task)
                            task.add_done_callback(self._tasks.discard)
                except ConnectionClosed as exc:
                    reason = f"connection closed: {exc}"
                if self._closing:
                    break
                kept = self.requests.lost(reason, keep_resumable=True)
                if not kept:
                    break
                self._connected.clear()
                if not await self._reconnect():
                    reason += "; could not reconnect"
                    break
        finally:
            self._connected.set()
            self.requests.lost(reason)

    async def _reconnect(self) -> bool:
        """Connect again, after the policy's waits, and resume the kept requests."""
        for wait in self.requests.reconnect_waits():
            await asyncio.sleep(wait)  # sleep-ok: reconnect backoff
            if self._closing:
                break
            try:
                await self._open()
                for frame in self.requests.resume_frames():
                    await self.ws.send(orjson.dumps(frame), text=True)  # type: ignore[union-attr]
            except (OSError, ConnectionClosed, TimeoutError, GenerationError):
                continue
            self._reconnected()
            return True
        return False

    async def _retry_resume(self, request: Stream) -> None:
        """The server still holds the request for the old connection: it finds
        out soon (its send fails, or a ping goes unanswered); ask again."""
        wait = self.requests.retry_wait(request)
        if wait is None:
            return
        await asyncio.sleep(wait)  # sleep-ok: resume backoff
        if request.retry_resume and not request.finished:
            with contextlib.suppress(ConnectionClosed):
                await self._send(self.requests.resume_frame(request))
