"""A fault-injecting OpenAI-compatible upstream for the openai backend's tests.

A real HTTP server (aiohttp.web) on 127.0.0.1, port 0, speaking the streamed
``/v1/completions`` and ``/v1/chat/completions`` and ``/v1/models``. What a
request gets is chosen by :attr:`FakeUpstream.mode` — normal streaming, or
one of the faults (an HTTP error, a hang before the headers, silence
mid-stream, a drop mid-stream, malformed events, a stream without its final
chunk, a stream that never ends). It records what it was asked, how far each
stream got, and when each client went away (aiohttp cancels the handler on
disconnect: ``handler_cancellation=True``), as events the tests wait on.

The pauses between tokens (``token_delay``) are the upstream's simulated
speed, not synchronisation: tests never wait on them.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import gzip
import json
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from wsserver.backends.fake_embed import fake_score, fake_vector

__all__ = ["PIECES", "FakeUpstream", "Stream"]

#: What a normal stream sends, a piece per chunk: multi-byte text, split words.
PIECES = ["Hel", "lo", ",", " wor", "ld", " —", " café", " 日本", "語", " 😀", "!"]


@dataclass(eq=False)
class Stream:
    """One request the upstream served."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    chunks_sent: int = 0
    bytes_sent: int = 0
    #: A write is waiting for the client to read (TCP pushes back).
    writing: bool = False
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


class FakeUpstream:
    """``async with FakeUpstream() as up:`` — ``up.url`` ends in ``/v1``."""

    def __init__(self, *, model: str = "fake-upstream", sndbuf: int = 0) -> None:
        self.model = model
        #: ok | endless | status | not_streamed | hang | silence | drop | malformed | bad_sse |
        #: no_final | error_event | comments (keep-alive comments only, after fault_after) |
        #: gzip_bomb (20 MiB of blank lines, gzip-compressed, whatever was asked)
        self.mode = "ok"
        self.status = 500
        self.pieces = list(PIECES)
        self.token_delay = 0.0
        #: Chunks sent before a mid-stream fault (silence, drop, malformed, ...).
        self.fault_after = 3
        self.send_usage = True
        #: llama-server's ``timings`` object in the final chunk (None = none).
        self.timings: dict[str, Any] | None = None
        #: A usage chunk before the first piece (as vLLM's continuous usage stats).
        self.usage_first = False
        #: ``usage.prompt_tokens_details.cached_tokens`` in the usage chunk (None = none).
        self.cached_tokens: int | None = None
        #: Chat only: reasoning pieces streamed first, each as ``delta.<reasoning_key>``
        #: (llama-server's ``reasoning_content``; vLLM's and Ollama's ``reasoning``).
        self.reasoning: list[str] = []
        self.reasoning_key = "reasoning_content"
        #: Chat only: ``delta.tool_calls`` lists streamed after the pieces, one
        #: per chunk; the stream then ends with ``finish_reason: "tool_calls"``.
        self.tool_call_deltas: list[list[dict[str, Any]]] = []
        #: Park before sending ``tool_call_deltas[hold_calls_at]`` (``calls_held``
        #: is set) until ``release_calls`` is set: what came before must get through.
        self.hold_calls_at: int | None = None
        self.calls_held = asyncio.Event()
        self.release_calls = asyncio.Event()
        self.streams: list[Stream] = []
        self.arrived = asyncio.Event()
        self.models_requests = 0
        #: Serve /v1/embeddings and /v1/rerank (the fake engine's vectors and
        #: scores: wsserver.backends.fake_embed); their request bodies, in order.
        self.embeddings = False
        self.embed_bodies: list[dict[str, Any]] = []
        #: Answer the embeddings' vectors as float lists, not base64 (as asked).
        self.float_vectors = False
        self._sndbuf = sndbuf
        self._runner: web.AppRunner | None = None
        self._port = 0
        #: Set to release handlers parked in hang/silence (at teardown).
        self._release = asyncio.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}/v1"

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, port: int = 0) -> None:
        """Listen (again, after :meth:`stop`: pass the old port to come back on it)."""
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/rerank", self._embeddings)
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0
        )
        await self._runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self._sndbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._sndbuf)
        sock.bind(("127.0.0.1", port))
        self._port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()

    async def stop(self) -> None:
        """Stop listening and drop every connection (an upstream killed mid-run)."""
        self._release.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def next_stream(self, index: int) -> Stream:
        """The ``index``-th request this upstream received, once it arrived."""
        while len(self.streams) <= index:
            self.arrived.clear()
            await self.arrived.wait()
        return self.streams[index]

    # ------------------------------------------------------------ handlers

    async def _models(self, request: web.Request) -> web.Response:
        self.models_requests += 1
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def _embeddings(self, request: web.Request) -> web.Response:
        if not self.embeddings:
            return web.json_response({"error": {"message": "Not found"}}, status=404)
        body = await request.json()
        self.embed_bodies.append(body)
        usage = {"prompt_tokens": 7, "total_tokens": 7}
        if request.path.endswith("/rerank"):
            results = [
                {"index": i, "relevance_score": fake_score(body["query"], d)}
                for i, d in enumerate(body["documents"])
            ]
            results.sort(key=lambda r: -r["relevance_score"])
            return web.json_response({"results": results, "usage": usage})
        items = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = []
        for index, item in enumerate(reversed(items)):  # out of order: the index says
            vector = fake_vector(item if isinstance(item, str) else tuple(item))
            embedding: Any = (
                list(struct.unpack(f"<{len(vector) // 4}f", vector))
                if self.float_vectors or body.get("encoding_format") != "base64"
                else base64.b64encode(vector).decode()
            )
            data.append({"index": len(items) - 1 - index, "embedding": embedding})
        return web.json_response({"data": data, "model": body["model"], "usage": usage})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        stream = Stream(request.path, body, dict(request.headers))
        self.streams.append(stream)
        self.arrived.set()
        try:
            return await self._respond(request, stream)
        except (asyncio.CancelledError, ConnectionResetError):
            stream.disconnected.set()
            raise
        finally:
            stream.finished.set()

    async def _respond(self, request: web.Request, stream: Stream) -> web.StreamResponse:
        mode = self.mode
        if mode == "status":
            message = {"error": {"message": f"upstream says no ({self.status})", "type": "x"}}
            return web.json_response(message, status=self.status)
        if mode == "not_streamed":
            return web.json_response({"choices": [{"text": "".join(self.pieces)}]})
        if mode == "hang":
            await self._park()
        if mode == "gzip_bomb":
            headers = {"Content-Type": "text/event-stream", "Content-Encoding": "gzip"}
            return web.Response(body=_gzip_bomb(), headers=headers)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = request.path.endswith("/chat/completions")
        if chat:
            await self._event(response, stream, _chat({"role": "assistant"}))
        if self.usage_first:
            usage = {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}
            await self._event(response, stream, {"choices": [], "usage": usage})
        for thought in self.reasoning if chat else ():
            await self._event(response, stream, _chat({self.reasoning_key: thought}))
        index = 0
        while True:
            if mode != "endless" and index >= len(self.pieces):
                break
            if self._release.is_set():  # stopped: die like a killed process would
                assert request.transport is not None
                request.transport.abort()
                return response
            if index == self.fault_after and mode in _MID_STREAM:
                await self._fault(mode, request, response, stream)
                return response
            piece = self.pieces[index % len(self.pieces)]
            if self.token_delay:
                await asyncio.sleep(self.token_delay)  # sleep-ok: the upstream's pace
            event = _chat({"content": piece}) if chat else _text(piece)
            if stream.body.get("logprobs"):
                event["choices"][0]["logprobs"] = _logprobs(piece, chat, index)
            await self._event(response, stream, event)
            index += 1
        if mode == "no_final":
            await response.write_eof()
            return response
        calls = self.tool_call_deltas if chat else []
        for number, parts in enumerate(calls):
            if number == self.hold_calls_at:
                self.calls_held.set()
                await self.release_calls.wait()
            await self._event(response, stream, _chat({"tool_calls": parts}))
        finish: dict[str, Any] = (
            {
                "choices": [
                    {"index": 0, "delta": {}, "finish_reason": "tool_calls" if calls else "stop"}
                ]
            }
            if chat
            else {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}
        )
        if self.timings is not None:
            finish["timings"] = self.timings  # where llama-server puts them
        await self._event(response, stream, finish)
        if self.send_usage:
            # A chunk a token: the reasoning's and the calls' too.
            made = index + (len(self.reasoning) if chat else 0) + len(calls)
            usage: dict[str, Any] = {
                "prompt_tokens": 7,
                "completion_tokens": made,
                "total_tokens": 7 + made,
            }
            if self.cached_tokens is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
            await self._event(response, stream, {"choices": [], "usage": usage})
        await self._raw(response, stream, b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _fault(
        self, mode: str, request: web.Request, response: web.StreamResponse, stream: Stream
    ) -> None:
        if mode == "silence":
            await self._park()
        elif mode == "drop":
            assert request.transport is not None
            request.transport.abort()
            await self._park()
        elif mode == "malformed":
            await self._raw(response, stream, b'data: {"choices": [{"text": "x"\n\n')
            await self._park()
        elif mode == "bad_sse":
            await self._raw(response, stream, b"data: \xff\xfe not utf-8\n\n")
            await self._park()
        elif mode == "error_event":
            await self._event(response, stream, {"error": {"message": "out of memory"}})
            await self._park()
        elif mode == "comments":
            while not self._release.is_set():
                await self._raw(response, stream, b": keep-alive\n\n")
                await asyncio.sleep(self.token_delay)  # sleep-ok: the upstream's pace

    async def _park(self) -> None:
        """Wait until the client leaves (cancelled then) or the upstream stops."""
        await self._release.wait()

    async def _event(self, response: web.StreamResponse, stream: Stream, obj: Any) -> None:
        await self._raw(response, stream, b"data: " + json.dumps(obj).encode() + b"\n\n")
        stream.chunks_sent += 1

    async def _raw(self, response: web.StreamResponse, stream: Stream, data: bytes) -> None:
        stream.writing = True
        await response.write(data)
        stream.writing = False
        stream.bytes_sent += len(data)


_MID_STREAM = frozenset({"silence", "drop", "malformed", "bad_sse", "error_event", "comments"})


@functools.cache
def _gzip_bomb() -> bytes:
    return gzip.compress(b"\n" * (20 << 20), compresslevel=9)


def _text(piece: str) -> dict[str, Any]:
    return {
        "object": "text_completion",
        "choices": [{"index": 0, "text": piece, "finish_reason": None}],
    }


def _chat(delta: dict[str, Any]) -> dict[str, Any]:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
    }


def _logprobs(piece: str, chat: bool, index: int) -> dict[str, Any]:
    """A piece's made-up log-probabilities, in the chat or the legacy shape."""
    value = -0.25 * (index + 1)
    if chat:
        entry = {"token": piece, "logprob": value, "bytes": list(piece.encode())}
        other = {"token": "x", "logprob": value - 1, "bytes": [120]}
        return {"content": [{**entry, "top_logprobs": [entry, other]}], "refusal": None}
    return {
        "tokens": [piece],
        "token_logprobs": [value],
        "top_logprobs": [{"x": value - 1, piece: value}],
        "text_offset": [0],
    }
