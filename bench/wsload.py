"""The lean client of wsserver's WebSocket protocol that the sections read with.

The bundled client validates every frame into dataclasses; at tens of
thousands of frames per second that cost would make the *client* the
bottleneck and understate the server. This one speaks the same protocol with
websockets and orjson and only counts — a :class:`Tally` — or times —
a :class:`~bench.timing.Stream`. It negotiates the same extensions as the
bundled client (websockets' defaults), so the server does the same work per
frame as it does for real clients.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect

from .timing import Stream, now


@dataclass
class Tally:
    """What one or more connections received."""

    requests: int = 0
    tokens: int = 0
    delta_frames: int = 0
    frames: int = 0
    text_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.tokens += other.tokens
        self.delta_frames += other.delta_frames
        self.frames += other.frames
        self.text_bytes += other.text_bytes
        self.errors.extend(other.errors)


async def open_connection(url: str, *, rcvbuf: int = 0, **kwargs: Any) -> ClientConnection:
    """Connect and read ``hello``. ``rcvbuf`` > 0 sets a small SO_RCVBUF first."""
    if rcvbuf > 0:
        host, port = url.split("//", 1)[1].rstrip("/").rsplit(":", 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        ws = await connect(url, sock=sock, max_size=None, **kwargs)
    else:
        ws = await connect(url, max_size=None, **kwargs)
    hello = orjson.loads(await ws.recv())
    if hello.get("type") != "hello":
        raise RuntimeError(f"expected hello, got {hello!r}")
    return ws


async def open_many(
    url: str, count: int, *, batch: int = 64, **kwargs: Any
) -> list[ClientConnection]:
    """``count`` connections, opened ``batch`` at a time (the listen backlog is finite)."""
    out: list[ClientConnection] = []
    for start in range(0, count, batch):
        n = min(batch, count - start)
        out.extend(await asyncio.gather(*(open_connection(url, **kwargs) for _ in range(n))))
    return out


async def close_many(conns: list[ClientConnection]) -> None:
    await asyncio.gather(*(ws.close() for ws in conns), return_exceptions=True)


def generate_frame(request_id: str, prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "type": "generate",
        "id": request_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


async def send(ws: ClientConnection, frame: dict[str, Any]) -> None:
    await ws.send(orjson.dumps(frame).decode())


async def next_frame(ws: ClientConnection, kind: str, timeout: float = 30.0) -> dict[str, Any]:
    """The next frame of type ``kind`` (any request's); an ``error`` frame raises."""
    async with asyncio.timeout(timeout):
        while True:
            frame: dict[str, Any] = orjson.loads(await ws.recv())
            if frame["type"] == kind:
                return frame
            if frame["type"] == "error":
                raise RuntimeError(f"refused: {frame}")


async def read_reply(
    ws: ClientConnection,
    request_id: str,
    *,
    stream: Stream | None = None,
    tally: Tally | None = None,
    on_delta: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """Frames until ``request_id``'s ``done``, or an ``error`` for it: that frame.

    Deltas are counted into ``tally`` and timed into ``stream`` (whose
    ``final`` and ``end`` the last frame sets), and handed to ``on_delta``.
    """
    while True:
        frame = orjson.loads(await ws.recv())
        kind = frame["type"]
        if tally is not None:
            tally.frames += 1
        if kind == "delta":
            text = frame.get("text", "")
            if stream is not None:
                stream.piece(text)
            if tally is not None:
                tally.delta_frames += 1
                tally.text_bytes += len(text)
            if on_delta is not None:
                await on_delta(frame)
        elif kind == "done":
            if frame["id"] == request_id:
                if tally is not None:
                    tally.requests += 1
                    tally.tokens += int(frame["usage"]["completion_tokens"])
                break
        elif kind == "error":
            if tally is not None:
                tally.errors.append(f"{frame.get('code')}: {frame.get('message')}")
            if frame.get("id") == request_id:
                break
    if stream is not None:
        stream.end = now()
        stream.final = frame
        if kind == "done":
            stream.tokens = int(frame["usage"]["completion_tokens"])
    return dict(frame)


async def request(
    ws: ClientConnection,
    frame: dict[str, Any],
    *,
    stream: Stream | None = None,
    cancel_on: asyncio.Event | None = None,
    **read: Any,
) -> dict[str, Any]:
    """Send ``frame`` (a ``generate``) and :func:`read_reply` its answer.

    ``stream``'s ``sent`` is taken just before the send; ``cancel_on``: send
    ``cancel`` for the request once that event is set.
    """
    canceller = None
    if cancel_on is not None:

        async def cancel_when_told() -> None:
            await cancel_on.wait()
            await send(ws, {"type": "cancel", "id": frame["id"]})

        canceller = asyncio.create_task(cancel_when_told())
    try:
        if stream is not None:
            stream.sent = now()
        await ws.send(orjson.dumps(frame).decode())
        return await read_reply(ws, frame["id"], stream=stream, **read)
    finally:
        if canceller is not None:
            canceller.cancel()


async def timed(
    ws: ClientConnection, frame: dict[str, Any], *, arrivals: bool = False, **kwargs: Any
) -> Stream:
    """One request timed into a :class:`Stream` (``arrivals``: each delta's
    time kept); a refusal raises."""
    stream = Stream(arrivals=[] if arrivals else None)
    last = await request(ws, frame, stream=stream, **kwargs)
    if last["type"] != "done":
        raise RuntimeError(f"wsserver refused {frame['id']}: {last}")
    return stream


async def timed_alone(url: str, frame: dict[str, Any], **kwargs: Any) -> Stream:
    """:func:`timed` on a connection of its own, opened first and closed after."""
    ws = await open_connection(url)
    try:
        return await timed(ws, frame, **kwargs)
    finally:
        await ws.close()


async def at_once(url: str, prompts: list[str], max_tokens: int) -> tuple[list[Stream], float]:
    """A request per prompt, all at once, each on a connection of its own;
    their streams, and when they were started."""
    t0 = now()
    streams = await asyncio.gather(
        *(timed_alone(url, generate_frame(f"s{i}", p, max_tokens)) for i, p in enumerate(prompts))
    )
    return list(streams), t0


async def cancel(ws: ClientConnection, request_id: str) -> dict[str, Any]:
    """Send ``cancel`` and read until the request's ``done``."""
    await send(ws, {"type": "cancel", "id": request_id})
    return await read_reply(ws, request_id)


async def stream_until(ws: ClientConnection, name: str, deadline: float, max_tokens: int) -> Tally:
    """Back-to-back requests on one connection until ``deadline`` (perf_counter)."""
    tally = Tally()
    index = 0
    while now() < deadline:
        request_id = f"{name}-{index}"
        frame = generate_frame(request_id, f"load {name} {index}", max_tokens)
        await request(ws, frame, tally=tally)
        index += 1
    return tally
