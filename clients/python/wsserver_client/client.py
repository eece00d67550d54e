"""An asyncio client for wsserver, built on websockets.

    async with Client("ws://127.0.0.1:8765/") as client:
        async for text in client.generate(prompt="Once upon a time"):
            print(text, end="", flush=True)

One reader task receives every frame and routes it by request ID to its
:class:`Stream`. Frames of a request the caller cancelled or restarted are
dropped here, so late text can never reach the caller. The frame classes and
their parsing are shared with the server (:mod:`wsserver.protocol`).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from wsserver.protocol import (
    Delta,
    Done,
    Error,
    Hello,
    Queued,
    ServerFrame,
    Started,
    parse_server_frame,
)

__all__ = ["Client", "GenerationError", "RequestResult", "Stream"]


class GenerationError(Exception):
    """The server refused a request (``error`` frame) or the connection dropped."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass
class RequestResult:
    id: str
    text: str
    done: Done


_END = object()


@dataclass(eq=False)
class Stream:
    """One request's frames. Iterate for text; ``done`` is set at the end."""

    client: Client
    id: str
    frame: dict[str, Any]
    done: Done | None = None
    started: bool = False
    positions: list[int] = field(default_factory=list)
    deltas: list[Delta] = field(default_factory=list)
    _queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    _ended: asyncio.Event = field(default_factory=asyncio.Event)
    _sent: bool = False
    _abandoned: bool = False
    _error: GenerationError | None = None

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    async def send(self) -> Stream:
        """Send the request frame (iteration does this by itself)."""
        if not self._sent:
            self._sent = True
            await self.client._send(self.frame)
        return self

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[str]:
        await self.send()
        while True:
            item = await self._queue.get()
            if item is _END:
                if self._error is not None:
                    raise self._error
                return
            yield item

    async def result(self) -> RequestResult:
        """Read to the end; return the whole text and the ``done`` frame."""
        async for _ in self:
            pass
        assert self.done is not None
        return RequestResult(id=self.id, text=self.text, done=self.done)

    async def cancel(self) -> Done | None:
        """Cancel in-band and wait for this request's ``done``."""
        return await self.client.cancel(self.id)

    # Called by the client's reader task.
    def _deliver(self, frame: ServerFrame) -> None:
        if isinstance(frame, Delta):
            if not self._abandoned:
                self.deltas.append(frame)
                self._queue.put_nowait(frame.text)
        elif isinstance(frame, Queued):
            self.positions.append(frame.position)
        elif isinstance(frame, Started):
            self.started = True
        elif isinstance(frame, Done):
            self.done = frame
            self._end()
        elif isinstance(frame, Error):
            self._error = GenerationError(frame.code, frame.message, frame.id)
            self._end()

    def _abandon(self) -> None:
        """The caller cancelled or restarted: text not yet read is dropped too."""
        self._abandoned = True
        while not self._queue.empty():
            self._queue.get_nowait()
        if self._ended.is_set():
            self._queue.put_nowait(_END)

    def _fail(self, error: GenerationError) -> None:
        if self.done is None and self._error is None:
            self._error = error
            self._end()

    def _end(self) -> None:
        self._queue.put_nowait(_END)
        self._ended.set()

    async def wait_done(self) -> Done | None:
        """Wait for the end of the request without consuming its text."""
        await self._ended.wait()
        return self.done


class Client:
    """A connection to wsserver. Use as an async context manager."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        origin: str | None = None,
        **connect_kwargs: Any,
    ) -> None:
        self.url = url
        self.token = token
        self._connect_kwargs = connect_kwargs
        if origin is not None:
            self._connect_kwargs["origin"] = origin
        self.ws: ClientConnection | None = None
        self.hello: Hello | None = None
        self.errors: list[Error] = []
        self._streams: dict[str, Stream] = {}
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._prefix = os.urandom(3).hex()

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        headers = dict(self._connect_kwargs.pop("additional_headers", {}) or {})
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self.ws = await connect(
            self.url, additional_headers=headers or None, **self._connect_kwargs
        )
        first = parse_server_frame(await self.ws.recv())
        if not isinstance(first, Hello):
            raise GenerationError("bad_request", f"expected hello, got {first!r}")
        self.hello = first
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    def new_id(self) -> str:
        return f"r{self._prefix}-{next(self._ids)}"

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        id: str | None = None,
        **params: Any,
    ) -> Stream:
        """A request; iterate the returned stream for its text."""
        request_id = id or self.new_id()
        frame: dict[str, Any] = {"type": "generate", "id": request_id, **params}
        if prompt is not None:
            frame["prompt"] = prompt
        if messages is not None:
            frame["messages"] = messages
        return self._open(request_id, frame)

    def restart(self, old_id: str, *, new_id: str | None = None, **overrides: Any) -> Stream:
        """Regenerate: cancel ``old_id`` if it runs, then run its input again."""
        request_id = new_id or self.new_id()
        old = self._streams.get(old_id)
        if old is not None:
            old._abandon()
        frame = {"type": "restart", "id": old_id, "new_id": request_id, **overrides}
        return self._open(request_id, frame)

    async def cancel(self, request_id: str) -> Done | None:
        """Cancel in-band; returns the request's ``done`` (``None`` if it had none)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream._abandon()
        await self._send({"type": "cancel", "id": request_id})
        if stream is None:
            return None
        return await stream.wait_done()

    async def send_raw(self, data: str | bytes) -> None:
        """Send a frame as is (for tests and debugging)."""
        assert self.ws is not None
        await self.ws.send(data)

    def _open(self, request_id: str, frame: dict[str, Any]) -> Stream:
        stream = Stream(client=self, id=request_id, frame=frame)
        self._streams[request_id] = stream
        return stream

    async def _send(self, frame: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(orjson.dumps(frame), text=True)

    async def _read(self) -> None:
        assert self.ws is not None
        error = GenerationError("internal", "connection closed")
        try:
            async for message in self.ws:
                frame = parse_server_frame(message)
                request_id = getattr(frame, "id", None)
                stream = self._streams.get(request_id) if request_id else None
                if stream is None:
                    if isinstance(frame, Error):
                        self.errors.append(frame)
                    continue
                stream._deliver(frame)
                if isinstance(frame, Done | Error):
                    self._streams.pop(request_id, None)  # type: ignore[arg-type]
        except ConnectionClosed as exc:
            error = GenerationError("internal", f"connection closed: {exc}")
        finally:
            for stream in list(self._streams.values()):
                stream._fail(error)
            self._streams.clear()
