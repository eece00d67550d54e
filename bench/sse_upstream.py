"""A lean OpenAI-compatible streaming upstream, and a client that reads SSE directly.

The relay benchmark (section 9, :mod:`bench.upstream`) needs an upstream
that costs as little CPU as possible per token, so that at hundreds of
streams the figures describe wsserver and not the upstream: raw asyncio
streams, one request per connection (the body ends at the close), one
``data:`` event per token at ``tokens_per_s`` per stream (0 = as fast as the
socket takes them),
then the finish chunk, a usage chunk and ``[DONE]`` — what llama-server and
vLLM send. It records when each client went away mid-stream (its read side
hits EOF), on this process's ``perf_counter`` clock, for the cancel →
disconnect latency.

Run standalone (``python -m bench.sse_upstream RATE --port PORT``) it serves until
it is terminated, so the load of the relay ceiling runs in a process of its
own (:func:`bench.servers.sse_upstream`).

:func:`direct_stream` is the contender wsserver is compared with: a client
that POSTs the same request to the upstream and reads its event stream itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from .timing import Stream

MODEL = "bench-upstream"
WORDS = [" the", " relay", " moves", " bytes", ",", " not", " tokens", "."]


@dataclass
class SSEUpstream:
    """``await SSEUpstream(rate).start()`` — ``url`` ends in ``/v1``."""

    tokens_per_s: float = 0.0
    url: str = ""
    #: ``time.perf_counter()`` when a client left before its stream's end.
    disconnects: list[float] = field(default_factory=list)
    left: asyncio.Event = field(default_factory=asyncio.Event)
    streams: int = 0
    #: ``time.perf_counter()`` when each request's head had arrived, in order.
    arrivals: list[float] = field(default_factory=list)
    _server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> SSEUpstream:
        self._server = await asyncio.start_server(self._serve, host, port, backlog=4096)
        sock = self._server.sockets[0]
        self.url = f"http://{host}:{sock.getsockname()[1]}/v1"
        return self

    async def __aenter__(self) -> SSEUpstream:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # One request per connection (``Connection: close``): the client sends
        # nothing more, so its EOF on the read side can only mean it left.
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.arrivals.append(time.perf_counter())
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            length = 0
            for line in lines[1:]:
                if line.lower().startswith("content-length:"):
                    length = int(line.split(":", 1)[1])
            body = json.loads(await reader.readexactly(length)) if length else {}
            if method == "GET" and path.endswith("/models"):
                payload = json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload)
                )
                await writer.drain()
            else:
                await self._stream(reader, writer, body, chat=path.endswith("/chat/completions"))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return
        finally:
            writer.close()

    async def _stream(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        body: dict[str, Any],
        *,
        chat: bool,
    ) -> None:
        """One streamed answer; the body ends when the connection closes."""
        self.streams += 1
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n"
        )
        eof = asyncio.ensure_future(reader.read(1))
        tokens = int(body.get("max_tokens") or 16)
        interval = 1.0 / self.tokens_per_s if self.tokens_per_s > 0 else 0.0
        start = time.perf_counter()
        try:
            for index in range(tokens):
                if interval:
                    delay = start + index * interval - time.perf_counter()
                    if delay > 0:
                        await asyncio.wait({eof}, timeout=delay)  # the upstream's pace
                if eof.done():
                    raise ConnectionResetError
                piece = WORDS[index % len(WORDS)]
                choice = (
                    {"index": 0, "delta": {"content": piece}}
                    if chat
                    else {"index": 0, "text": piece}
                )
                _event(writer, {"choices": [{**choice, "finish_reason": None}]})
                if writer.transport.get_write_buffer_size() > 65536 or not interval:
                    drain = asyncio.ensure_future(writer.drain())
                    await asyncio.wait({drain, eof}, return_when=asyncio.FIRST_COMPLETED)
                    if eof.done():
                        drain.cancel()
                        raise ConnectionResetError
            final = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
            _event(writer, {"choices": [{**final, "finish_reason": "length"}]})
            usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
            _event(writer, {"choices": [], "usage": usage})
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        except ConnectionError:
            self.disconnects.append(time.perf_counter())
            self.left.set()
        finally:
            eof.cancel()


def _event(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    writer.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


async def direct_stream(
    session: Any, url: str, body: dict[str, Any], *, stop_after: float | None = None
) -> Stream:
    """POST ``body`` with ``stream: true`` and read the events, as a plain client does.

    ``stop_after``: drop the request that many seconds after sending it (the
    Stop of a client that reads the SSE itself) — while it waits for the
    response's head (llama-server sends none before its prefill is done) or
    reads the body.
    """
    path = "/chat/completions" if "messages" in body else "/completions"
    run = Stream()
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    response = None
    finished = False
    try:
        async with asyncio.timeout(stop_after):
            response = await session.post(url + path, json=payload)
            buffer = b""
            while True:
                data = await response.content.readany()
                if not data:
                    finished = True
                    break
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    obj = json.loads(event[6:])
                    for choice in obj.get("choices") or []:
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text:
                            run.tokens += 1
                            if run.first is None:
                                run.first = time.perf_counter()
    except TimeoutError:
        if stop_after is None:
            raise
    finally:
        run.end = time.perf_counter()
        if response is not None:
            if finished:
                response.release()  # complete: the connection goes back to the pool
            else:
                response.close()  # a Stop: drop the connection, as wsserver's cancel does
    return run


async def _main(rate: float, port: int) -> None:
    await SSEUpstream(rate).start(port=port)
    await asyncio.Event().wait()  # until the harness terminates this process


if __name__ == "__main__":
    asyncio.run(_main(float(sys.argv[1]), int(sys.argv[sys.argv.index("--port") + 1])))
