"""A lean WebSocket load client for the fake-backend sections.

The bundled client validates every frame into dataclasses; at tens of
thousands of frames per second that cost would make the *client* the
bottleneck and understate the server. This one speaks the same protocol with
websockets and orjson and only counts. It negotiates the same extensions as
the bundled client (websockets' defaults), so the server does the same work
per frame as it does for real clients.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect


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


def generate_frame(request_id: str, prompt: str, max_tokens: int, **extra: Any) -> bytes:
    return orjson.dumps(
        {
            "type": "generate",
            "id": request_id,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            **extra,
        }
    )


async def read_request(
    ws: ClientConnection, request_id: str, tally: Tally, chunks: list[str] | None = None
) -> dict[str, Any]:
    """Read frames until ``request_id``'s ``done``; count them; return the done frame."""
    while True:
        message = await ws.recv()
        frame = orjson.loads(message)
        tally.frames += 1
        kind = frame["type"]
        if kind == "delta":
            tally.delta_frames += 1
            text = frame["text"]
            tally.text_bytes += len(text)
            if chunks is not None:
                chunks.append(text)
        elif kind == "done":
            if frame["id"] == request_id:
                tally.requests += 1
                tally.tokens += int(frame["usage"]["completion_tokens"])
                return dict(frame)
        elif kind == "error":
            tally.errors.append(f"{frame.get('code')}: {frame.get('message')}")
            if frame.get("id") == request_id:
                return dict(frame)


async def stream_until(ws: ClientConnection, name: str, deadline: float, max_tokens: int) -> Tally:
    """Back-to-back requests on one connection until ``deadline`` (perf_counter)."""
    tally = Tally()
    index = 0
    while time.perf_counter() < deadline:
        request_id = f"{name}-{index}"
        await ws.send(
            generate_frame(request_id, f"load {name} {index}", max_tokens).decode(), text=True
        )
        await read_request(ws, request_id, tally)
        index += 1
    return tally
