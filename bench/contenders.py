"""The clients that stream the model from each contender of sections 1, 2 and 8.

* :class:`InProcess` — llama-cpp-python's ``create_completion(stream=True)``
  called directly in the harness process: the floor, no transport at all.
* :class:`WsContender` — wsserver with the llama backend in its own process
  (``bench.probe_server``), read with the bundled Python client over loopback.
* :class:`SseContender` — any OpenAI-compatible server (``llama_cpp.server``,
  ``llama-server``, wsserver's own ``/v1``): ``POST /v1/completions`` streamed,
  read as Server-Sent Events over loopback with :class:`SseStream`, a minimal
  asyncio HTTP client.
* :func:`llama_completion` — llama-server's own streamed ``/completion``, the
  peer of the batched engine's sections (10, 12, 15).

Every contender loads the same GGUF with the same ``n_ctx``, ``n_batch`` and
thread count, and is asked for the same prompts at temperature 0 (greedy).
Each records a :class:`Run` per request (when the first and last text
arrived), so TTFT and decode throughput are measured the same way for all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from .common import ROOT
from .servers import ServerProcess, llama_overrides
from .timing import Stream, now


@dataclass
class Run(Stream):
    """One streamed completion of a contender, for the ``index``-th prompt."""

    contender: str = ""
    prompt_index: int = 0
    #: wsserver only: its own ``done.timings.ttft_ms`` (request read → first delta sent).
    server_ttft_ms: float | None = None


# ------------------------------------------------------------------ in-process


class InProcess:
    name = "in-process"

    def __init__(self, model: str, *, n_ctx: int, n_batch: int, threads: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(
            model_path=str(model),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def tokenize(self, text: str) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=False, special=False))

    def detokenize(self, tokens: list[int]) -> str:
        return self.llm.detokenize(tokens).decode("utf-8", errors="ignore")

    def completion_stream(self, prompt: str, max_tokens: int) -> Any:
        return self.llm.create_completion(
            prompt, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0, stream=True
        )

    def complete_sync(self, prompt: str, max_tokens: int, index: int = 0) -> Run:
        run = Run(contender=self.name, prompt_index=index)
        for chunk in self.completion_stream(prompt, max_tokens):
            if text := chunk["choices"][0]["text"]:
                run.piece(text)
        run.end = now()
        return run

    async def complete(self, prompt: str, max_tokens: int, index: int = 0) -> Run:
        # On a worker thread, so the harness's loop keeps answering the other
        # contenders' keepalive pings; the loop is otherwise idle meanwhile.
        return await asyncio.to_thread(self.complete_sync, prompt, max_tokens, index)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.close()


# ------------------------------------------------------------------ wsserver


class WsContender:
    """wsserver (llama backend, one slot) in a subprocess; the bundled client in here."""

    def __init__(
        self,
        model: str,
        *,
        n_ctx: int,
        n_batch: int,
        threads: int,
        name: str = "wsserver",
        root: Path | None = None,
    ) -> None:
        self.name = name
        overrides = llama_overrides(
            model, threads=threads, parallel=1, n_ctx=n_ctx, n_batch=n_batch
        )
        self.server = ServerProcess(overrides, name=name, root=root or ROOT)
        self.client: Any = None

    async def start(self) -> WsContender:
        from wsserver_client import Client

        await self.server.start(timeout=300)
        self.client = Client(self.server.url)
        await self.client.connect()
        return self

    async def complete(self, prompt: str, max_tokens: int, index: int = 0) -> Run:
        run = Run(contender=self.name, prompt_index=index)
        stream = self.client.generate(prompt=prompt, max_tokens=max_tokens, temperature=0)
        async for text in stream:
            if text:
                run.piece(text)
        run.end = now()
        if stream.done is not None:
            run.tokens = stream.done.usage.completion_tokens
            run.server_ttft_ms = stream.done.timings.ttft_ms
        return run

    async def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        await self.server.stop()


# ------------------------------------------------------------------ SSE


class SseStream:
    """A streamed ``POST`` answered with Server-Sent Events (chunked HTTP/1.1)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.port = 0
        self._buffer = b""

    @classmethod
    async def connect(cls, port: int) -> SseStream:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stream = cls(reader, writer)
        stream.port = port
        return stream

    async def post(self, path: str, body: dict[str, Any]) -> None:
        data = orjson.dumps(body)
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await self.writer.drain()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Each ``data:`` JSON object until ``[DONE]`` or the end of the body."""
        status = await self.reader.readline()
        if b" 200 " not in status:
            rest = await self.reader.read(4096)
            raise RuntimeError(f"peer answered {status!r}: {rest[:300]!r}")
        chunked = False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        while True:
            if chunked:
                size_line = await self.reader.readline()
                if not size_line:
                    return
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    return
                self._buffer += await self.reader.readexactly(size)
                await self.reader.readexactly(2)
            else:
                data = await self.reader.read(65536)
                if not data:
                    return
                self._buffer += data
            while True:
                cut = [
                    i
                    for i in (self._buffer.find(b"\r\n\r\n"), self._buffer.find(b"\n\n"))
                    if i >= 0
                ]
                if not cut:
                    break
                at = min(cut)
                sep = 4 if self._buffer[at : at + 4] == b"\r\n\r\n" else 2
                event, self._buffer = self._buffer[:at], self._buffer[at + sep :]
                for raw in event.splitlines():
                    if raw.startswith(b"data:"):
                        payload = raw[5:].strip()
                        if payload == b"[DONE]":
                            return
                        yield orjson.loads(payload)

    def abort(self) -> None:
        """Drop the connection at once (what a browser tab does on Stop)."""
        self.writer.transport.abort()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


class SseContender:
    """An OpenAI-compatible server on ``port``: ``POST /v1/completions`` streamed.

    ``extra`` goes into every request's body (``repeat_penalty = 1.0`` for
    llama_cpp.server, whose default is 1.1 where ``create_completion``'s is
    1.0); ``usage`` asks for the usage chunk (``stream_options``).
    """

    def __init__(
        self, name: str, port: int, extra: dict[str, Any] | None = None, *, usage: bool = True
    ) -> None:
        self.name = name
        self.port = port
        self.extra = extra or {}
        self.usage = usage

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        usage = {"stream_options": {"include_usage": True}} if self.usage else {}
        return {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            **usage,
            **self.extra,
        }

    async def open(self, prompt: str, max_tokens: int) -> SseStream:
        """A fresh connection with the request sent on it."""
        stream = await SseStream.connect(self.port)
        await stream.post("/v1/completions", self.body(prompt, max_tokens))
        return stream

    async def complete(self, prompt: str, max_tokens: int, index: int = 0) -> Run:
        stream = await SseStream.connect(self.port)
        run = Run(contender=self.name, prompt_index=index)  # timed from the request on
        await stream.post("/v1/completions", self.body(prompt, max_tokens))
        finish = None
        try:
            async for event in stream.events():
                for choice in event.get("choices") or []:
                    if text := choice.get("text"):
                        run.piece(text)
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens"):
                    run.tokens = int(usage["completion_tokens"])
        finally:
            await stream.close()
        run.end = now()
        if not run.tokens and finish == "length":
            run.tokens = max_tokens
        return run

    async def abandon(self, prompt: str, max_tokens: int, after_s: float) -> float:
        """Send ``prompt``, drop the connection ``after_s`` later (a Stop, or a
        user who gives up); the time of the drop."""
        stream = await self.open(prompt, max_tokens)
        await asyncio.sleep(after_s)  # sleep-ok: the scenario (the user gives up)
        dropped = now()
        stream.abort()
        return dropped

    async def first_text(self, prompt: str, max_tokens: int, timeout: float) -> float | None:
        """Send ``prompt`` and wait for its first text (None after ``timeout``); its time."""
        stream = await self.open(prompt, max_tokens)
        try:
            async with asyncio.timeout(timeout):
                async for event in stream.events():
                    if event["choices"][0].get("text"):
                        return now()
        except TimeoutError:
            return None
        finally:
            stream.abort()
        return None


async def llama_completion(
    port: int,
    body: dict[str, Any],
    *,
    stop_on: asyncio.Event | None = None,
    on_piece: Callable[[Stream], Awaitable[None]] | None = None,
) -> Stream:
    """One streamed ``POST /completion`` of llama-server's own API, on a
    connection of its own: each token's text an event, timed into a
    :class:`Stream` (arrivals kept), the last event in ``final`` and its
    arrival in ``end``. ``stop_on``: close the connection (which cancels the
    slot) once that event is set; ``on_piece`` runs after each piece."""
    import aiohttp

    stream = Stream(arrivals=[])
    async with aiohttp.ClientSession() as session:
        stream.sent = now()
        url = f"http://127.0.0.1:{port}/completion"
        async with session.post(url, json={**body, "stream": True}) as resp:
            stream.head = now()
            if resp.status != 200:
                raise RuntimeError(f"llama-server answered {resp.status}: {await resp.text()}")

            async def read() -> None:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = json.loads(line[6:])
                    if data.get("content"):
                        stream.piece(data["content"])
                        if on_piece is not None:
                            await on_piece(stream)
                    if data.get("stop"):
                        stream.end = now()
                        stream.final = data
                        return

            reader = asyncio.create_task(read())
            if stop_on is None:
                await reader
            else:
                stopper = asyncio.create_task(stop_on.wait())
                await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
                reader.cancel()  # closing the connection cancels the slot
                stopper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
    timings = stream.final.get("timings") or {}
    stream.tokens = int(stream.final.get("tokens_predicted") or timings.get("predicted_n") or 0)
    return stream
