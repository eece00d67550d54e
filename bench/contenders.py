"""The three ways to stream from the model that sections 1 and 2 compare.

* :class:`InProcess` — llama-cpp-python's ``create_completion(stream=True)``
  called directly in the harness process: the floor, no transport at all.
* :class:`WsContender` — wsserver with the llama backend in its own process
  (``bench.probe_server``), read with the bundled Python client over loopback.
* :class:`PeerContender` — ``python -m llama_cpp.server`` (llama-cpp-python's
  OpenAI-compatible server) in its own process, read as Server-Sent Events
  over loopback with a minimal asyncio HTTP client.

Every contender loads the same GGUF with the same ``n_ctx``, ``n_batch`` and
thread count, and is asked for the same prompts at temperature 0 (greedy).
Each records, per request, when the first and last text arrived, so TTFT and
decode throughput are measured the same way for all three.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .common import PYTHON, ServerProcess, die_with_parent, free_port

now = time.perf_counter


@dataclass
class Run:
    """One streamed completion, times in seconds from sending the request."""

    contender: str
    prompt_index: int
    first: float | None = None
    last: float | None = None
    end: float = 0.0
    pieces: int = 0
    tokens: int | None = None
    #: wsserver only: its own ``done.timings.ttft_ms`` (request read → first delta sent).
    server_ttft_ms: float | None = None
    text_parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def piece(self, t0: float, text: str) -> None:
        if not text:
            return
        t = now() - t0
        if self.first is None:
            self.first = t
        self.last = t
        self.pieces += 1
        self.text_parts.append(text)

    def decode_tps(self, tokens: int | None = None) -> float | None:
        n = tokens if tokens is not None else self.tokens
        if n is None or n < 2 or self.first is None or self.last is None or self.last <= self.first:
            return None
        return (n - 1) / (self.last - self.first)

    def e2e_tps(self, tokens: int | None = None) -> float | None:
        n = tokens if tokens is not None else self.tokens
        return n / self.end if n and self.end > 0 else None


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
        run = Run(self.name, index)
        t0 = now()
        for chunk in self.completion_stream(prompt, max_tokens):
            run.piece(t0, chunk["choices"][0]["text"])
        run.end = now() - t0
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
    """wsserver (llama backend) in a subprocess; the bundled client in here."""

    def __init__(
        self,
        model: str,
        *,
        n_ctx: int,
        n_batch: int,
        threads: int,
        name: str = "wsserver",
        extra: dict[str, Any] | None = None,
        root: Path | None = None,
    ) -> None:
        self.name = name
        self.server = ServerProcess(
            {
                "backend.kind": "llama",
                "backend.llama.model": model,
                "backend.llama.n_ctx": n_ctx,
                "backend.llama.n_batch": n_batch,
                "backend.llama.n_threads": threads,
                "backend.llama.parallel": 1,
                "limits.max_tokens": 4096,
                **(extra or {}),
            },
            name=name,
            **({} if root is None else {"root": root}),
        )
        self.client: Any = None

    async def start(self) -> WsContender:
        from wsserver_client import Client

        await self.server.start(timeout=300)
        self.client = Client(self.server.url)
        await self.client.connect()
        return self

    async def complete(self, prompt: str, max_tokens: int, index: int = 0) -> Run:
        run = Run(self.name, index)
        t0 = now()
        stream = self.client.generate(prompt=prompt, max_tokens=max_tokens, temperature=0)
        async for text in stream:
            run.piece(t0, text)
        run.end = now() - t0
        if stream.done is not None:
            run.tokens = stream.done.usage.completion_tokens
            run.server_ttft_ms = stream.done.timings.ttft_ms
        return run

    async def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()
        await self.server.stop()


# ------------------------------------------------------------------ peer


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


class PeerContender:
    """``python -m llama_cpp.server`` in a subprocess, read over SSE."""

    name = "llama_cpp.server"

    def __init__(self, model: str, *, n_ctx: int, n_batch: int, threads: int) -> None:
        self.model = model
        self.args = {
            "n_ctx": n_ctx,
            "n_batch": n_batch,
            "n_ubatch": n_batch,
            "n_threads": threads,
            "n_threads_batch": threads,
        }
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="bench-peer-", suffix=".log")[1])
        self._drain: asyncio.Task[None] | None = None

    async def start(self, timeout: float = 300.0) -> PeerContender:
        self.port = free_port()
        cmd = [
            PYTHON,
            "-m",
            "llama_cpp.server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        for key, value in self.args.items():
            cmd += [f"--{key}", str(value)]
        self.proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            limit=1 << 20,
            preexec_fn=die_with_parent,
        )
        assert self.proc.stderr is not None
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the drain task, which closes it
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await self.proc.stderr.readline()
                    if not line:
                        raise RuntimeError(f"llama_cpp.server exited:\n{self.log_tail()}")
                    log.write(line)
                    if b"Uvicorn running on" in line:
                        break
        except BaseException:
            log.close()
            await self.stop()
            raise
        self._drain = asyncio.create_task(self._drain_stderr(log))
        return self

    async def _drain_stderr(self, log: Any) -> None:
        # The server prints llama.cpp timings per request; keep the pipe flowing.
        assert self.proc is not None and self.proc.stderr is not None
        try:
            while line := await self.proc.stderr.readline():
                log.write(line)
        finally:
            log.close()

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        # repeat_penalty: the server defaults to 1.1, create_completion to 1.0.
        return {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "repeat_penalty": 1.0,
            "stream": True,
        }

    async def connect(self) -> SseStream:
        """A fresh connection (the timed part starts when the request is sent)."""
        return await SseStream.connect(self.port)

    async def send(self, stream: SseStream, prompt: str, max_tokens: int) -> None:
        await stream.post("/v1/completions", self.body(prompt, max_tokens))

    async def complete(self, prompt: str, max_tokens: int, index: int = 0) -> Run:
        run = Run(self.name, index)
        stream = await self.connect()
        t0 = now()
        await self.send(stream, prompt, max_tokens)
        try:
            async for event in stream.events():
                run.piece(t0, event["choices"][0].get("text") or "")
        finally:
            await stream.close()
        run.end = now() - t0
        return run

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            try:
                async with asyncio.timeout(15):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._drain is not None:
            with contextlib.suppress(BaseException):
                await self._drain
        with contextlib.suppress(OSError):
            self.log_path.unlink()
