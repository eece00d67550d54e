"""An asyncio client for wsserver, built on websockets.

    async with Client("ws://127.0.0.1:8765/") as client:
        async for text in client.generate(prompt="Once upon a time"):
            print(text, end="", flush=True)

One reader task receives every frame and hands it to the connection's
:class:`~wsserver_client.core.RequestTable`, which routes it by request ID.
The rules about requests — IDs, frames, and that nothing of a cancelled or
restarted request reaches the caller — live in :mod:`wsserver_client.core`,
shared with the synchronous client (:mod:`wsserver_client.sync`). The frame
classes and their parsing are shared with the server (:mod:`wsserver.protocol`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from wsserver.protocol import Done, Error, Hello

from .core import GenerationError, Request, RequestResult, RequestTable

__all__ = ["Client", "GenerationError", "RequestResult", "Stream"]


class Stream(Request):
    """One request's frames. Iterate for text; ``done`` is set at the end.

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
        """Send the request frame (iteration does this by itself)."""
        if not self.sent:
            self.sent = True
            await self.client._send(self.frame)
        return self

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[str]:
        await self.send()
        while True:
            text = self.take()
            if text is not None:
                yield text
            elif self.ended:
                self.raise_for_error()
                return
            else:
                # Nothing can happen between the checks above and clear():
                # no await in between, so no wake-up is lost.
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
        self.requests: RequestTable[Stream] = RequestTable()
        self._reader: asyncio.Task[None] | None = None

    @property
    def hello(self) -> Hello | None:
        """The server's ``hello`` (model, limits), once connected."""
        return self.requests.hello

    @property
    def errors(self) -> list[Error]:
        """``error`` frames about no live request."""
        return self.requests.errors

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
        self.requests.hello_from(await self.ws.recv())
        self._reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    def new_id(self) -> str:
        return self.requests.new_id()

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        id: str | None = None,
        **params: Any,
    ) -> Stream:
        """A request; iterate the returned stream for its text."""
        request_id, frame = self.requests.generate_frame(prompt, messages, id, params)
        return self.requests.add(Stream(self, request_id, frame))

    def restart(self, old: str | Stream, *, new_id: str | None = None, **overrides: Any) -> Stream:
        """Regenerate: cancel ``old`` (a stream or its ID) if it runs, then run
        its input again with ``overrides``."""
        request_id, frame = self.requests.restart_frame(old, new_id, overrides)
        return self.requests.add(Stream(self, request_id, frame))

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

    async def _send(self, frame: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(orjson.dumps(frame), text=True)

    async def _read(self) -> None:
        assert self.ws is not None
        reason = "connection closed"
        try:
            async for message in self.ws:
                self.requests.receive(message)
        except ConnectionClosed as exc:
            reason = f"connection closed: {exc}"
        finally:
            self.requests.lost(reason)
