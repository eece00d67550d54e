"""Section 20's servers and what they are sent (bench/images.py): the pairs
of a random-weight text model and projector, the images, wsserver and
llama-server serving a pair, each timing its own image work.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import ROOT
from .contenders import SseStream
from .servers import Child, ServerProcess, llama_overrides
from .timing import Stream, now

N_CTX = 4096
#: The tokens an image request asks for.
IMAGE_TOKENS_ASKED = 8
#: The pixels of every image sent (each its own pattern).
IMAGE_SIDE = 256
WSSERVER = "wsserver (defaults: gap 200 ms)"
LLAMA_SERVER = "llama-server -np 4 --mmproj"


@dataclass(frozen=True)
class Pair:
    """A text model and its projector: the builders' keyword arguments."""

    text: dict[str, Any]
    projector: dict[str, Any]

    @property
    def image_tokens(self) -> int:
        side = int(self.projector.get("image_size", 32))
        return (side // int(self.projector.get("patch_size", 8))) ** 2

    def describe(self) -> str:
        p, t = self.projector, self.text
        side, patch = p.get("image_size", 32), p.get("patch_size", 8)
        return (
            f"{side}-pixel images, patches of {patch} → {self.image_tokens} tokens, "
            f"{p.get('n_layer', 2)} vision layers of width {p.get('width', 32)}; text model "
            f"{t.get('n_layer', 2)} layers of width {t.get('n_embd', 64)}"
        )


#: One chat template for both servers (ChatML, llama-server's own fallback),
#: so that both render the same prompt: without one each uses its own fallback.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PAIRS: dict[str, Pair] = {
    "tiny": Pair(text={"chat_template": CHATML}, projector={}),
    "small": Pair(
        text={
            "n_layer": 4,
            "n_embd": 256,
            "n_head": 4,
            "n_head_kv": 2,
            "n_ff": 768,
            "chat_template": CHATML,
        },
        projector={
            "text_width": 256,
            "width": 256,
            "n_layer": 7,
            "n_head": 4,
            "n_ff": 1024,
            "image_size": 224,
            "patch_size": 14,
        },
    ),
}


def _tests_module(name: str) -> Any:
    """A builder of tests/ (as bench/models.py imports tiny_gguf)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "tests"))


def write_pair(pair: Pair, folder: Path) -> tuple[Path, Path]:
    """The text model and projector GGUFs of ``pair`` in ``folder``."""
    text = _tests_module("tiny_gguf").write_tiny_gguf(folder / "text.gguf", **pair.text)
    projector = _tests_module("tiny_mmproj").write_tiny_mmproj(
        folder / "mmproj.gguf", **pair.projector
    )
    return Path(text), Path(projector)


@functools.cache
def image_url(index: int) -> str:
    """A ``data:`` URL of a PNG whose pixels differ with ``index`` (drawn in
    Python, ~0.1 s: made before a measure starts, never during one)."""
    png = _tests_module("tiny_images").png
    shift = 37 * index
    data = png(
        IMAGE_SIDE,
        IMAGE_SIDE,
        lambda x, y: ((x + shift) % 256, (y * 3 + shift) % 256, (x * y + shift) % 256),
    )
    return "data:image/png;base64," + base64.b64encode(data).decode()


# ------------------------------------------------------------------ the wire


async def _sse(
    port: int,
    path: str,
    body: dict[str, Any],
    text_of: Callable[[dict[str, Any]], str],
    *,
    stop_on: asyncio.Event | None = None,
    on_piece: Callable[[Stream], Awaitable[None]] | None = None,
) -> Stream:
    """One streamed POST: each event's text a piece (arrivals kept), the
    usage chunk in ``final``; ``stop_on`` drops the connection once set (and
    ``final["stopped"]`` says the answer was still going then)."""
    stream = Stream(arrivals=[])
    sse = await SseStream.connect(port)
    stream.sent = now()
    await sse.post(path, {**body, "stream": True, "stream_options": {"include_usage": True}})

    async def read() -> None:
        async for event in sse.events():
            if text := text_of(event):
                stream.piece(text)
                if on_piece is not None:
                    await on_piece(stream)
            if isinstance(event.get("usage"), dict):
                stream.final = event

    reader = asyncio.create_task(read())
    try:
        if stop_on is None:
            await reader
        else:
            stopper = asyncio.create_task(stop_on.wait())
            await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if not reader.done():
                sse.abort()  # a dropped connection ends the request on both servers
                reader.cancel()
                stream.final["stopped"] = True  # it was still going: it did not end by itself
            with contextlib.suppress(asyncio.CancelledError):
                await reader
    finally:
        await sse.close()
    stream.end = now()
    return stream


def _chat_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or [{}]
    return str((choices[0].get("delta") or {}).get("content") or "")


def _completion_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or [{}]
    return str(choices[0].get("text") or "")


class Contender:
    """A server serving the pair, as the section drives it."""

    name: str
    port: int
    #: Fields only this server takes (llama-server's ``cache_prompt``).
    extra: dict[str, Any]

    def serving(self) -> contextlib.AbstractAsyncContextManager[Any]:
        raise NotImplementedError

    async def image_work(self) -> list[dict[str, float]]:
        """The images encoded since the last call: encode and decode ms each."""
        raise NotImplementedError

    async def image(self, index: int) -> Stream:
        content = [
            {"type": "text", "text": f"Image {index}. Look at"},
            {"type": "image_url", "image_url": {"url": image_url(index)}},
            {"type": "text", "text": "and say what it shows."},
        ]
        body = {
            "messages": [{"role": "user", "content": content}],
            "max_tokens": IMAGE_TOKENS_ASKED,
            "temperature": 0,
            **self.extra,
        }
        stream = await _sse(self.port, "/v1/chat/completions", body, _chat_text)
        if stream.first is None:
            raise RuntimeError(f"{self.name}: the image request streamed no text: {stream.final}")
        return stream

    async def text(
        self, prompt: str, n: int, stop_on: asyncio.Event | None = None, hook: Any = None
    ) -> Stream:
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, **self.extra}
        return await _sse(
            self.port, "/v1/completions", body, _completion_text, stop_on=stop_on, on_piece=hook
        )


class Wsserver(Contender):
    name = WSSERVER

    def __init__(self, text: Path, projector: Path, threads: int) -> None:
        overrides = llama_overrides(
            str(text), threads=threads, parallel=4, n_ctx=N_CTX, unpaced=True
        )
        overrides["backend.llama.mmproj"] = str(projector)
        self.server = ServerProcess(overrides, name="wsserver-images")
        self.extra = {}

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Wsserver]:
        async with self.server:
            self.port = int(self.server.http.rstrip("/").rsplit(":", 1)[1])
            await self.image_work()
            yield self

    async def image_work(self) -> list[dict[str, float]]:
        answer = await self.server.command("images", reset=True)
        if "images" not in answer:
            raise RuntimeError(f"bench.probe_server does not time images: {answer}")
        return list(answer["images"])


#: llama-server's log: a line's time (minutes.seconds.ms.µs), the image's steps.
_STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")
_ENCODING = "encoding mtmd batch"
_DECODING = re.compile(r"decoding image batch 1/")
_DECODED = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+) ms")


def llama_server_images(log: str) -> list[dict[str, float]]:
    """Each image llama-server's log (``-lv 4``) times: from ``encoding mtmd
    batch`` to ``decoding image batch 1/n`` (its encode), and the sum of its
    ``image decoded (batch i/n) in N ms`` (its embeddings' decode)."""
    images: list[dict[str, float]] = []
    started: float | None = None
    for line in log.splitlines():
        stamp = _STAMP.match(line)
        at = None
        if stamp:
            m, s, ms, us = (int(g) for g in stamp.groups())
            at = m * 60_000.0 + s * 1000.0 + ms + us / 1000.0
        if _ENCODING in line:
            started = at
        elif _DECODING.search(line) and started is not None and at is not None:
            images.append({"encode_ms": at - started, "decode_ms": 0.0})
            started = None
        elif (done := _DECODED.search(line)) and images:
            images[-1]["decode_ms"] += float(done.group(1))
    return images


class LlamaServer(Contender):
    name = LLAMA_SERVER

    def __init__(self, binary: Path, text: Path, projector: Path, threads: int) -> None:
        args = ("--mmproj", projector, "-np", 4, "-c", N_CTX * 4, "-t", threads, "-lv", 4)
        argv = [str(binary), "-m", str(text), "--host", "127.0.0.1", *map(str, args)]
        self.child = Child("llama-server", argv)
        self.extra = {"cache_prompt": False}
        self._seen = 0

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[LlamaServer]:
        async with self.child:
            self.port = self.child.port
            self._seen = 0
            yield self

    async def image_work(self) -> list[dict[str, float]]:
        images = llama_server_images(self.child.log_path.read_text(errors="replace"))
        new, self._seen = images[self._seen :], len(images)
        return new
