"""A jammed engine must not look healthy, and the probes need no token.

The llama engine is made to stick deterministically: its ``on_prefill`` hook
(called on the engine thread just before a request's first decode) blocks
until the test lets it go — from outside, the same as a step stuck in a
native call.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import make_config, running_server, timeout, wire

from wsserver.aio import Server

TOKEN = "s3cret-token"


async def http_get(
    server: Server, path: str, *, token: str | None = None, before: str | None = None
) -> tuple[int, str]:
    """GET ``path`` on a new connection, with ``token`` if given (after
    ``before``, with the token, on the same connection kept alive, when
    given): its status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    try:
        if before is not None:
            given = f"Authorization: Bearer {TOKEN}\r\n"
            writer.write(f"GET {before} HTTP/1.1\r\nHost: 127.0.0.1\r\n{given}\r\n".encode())
            assert (await _read_response(reader))[0] == 200
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
        return await _read_response(reader)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, str]:
    async with asyncio.timeout(timeout(10)):
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        length = int(re.search(r"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        body = (await reader.readexactly(length)).decode()
    return int(head.split(" ", 2)[1]), body


async def test_readyz_is_public_and_tells_its_reason_only_with_the_token() -> None:
    async with running_server(security__auth_token=TOKEN) as server:
        assert await http_get(server, "/readyz") == (200, "ready\n")
        assert await http_get(server, "/healthz") == (200, "ok\n")
        # Everything else still needs it.
        assert (await http_get(server, "/metrics"))[0] == 401
        # On a connection kept alive by the OpenAI API too.
        assert await http_get(server, "/readyz", before="/v1/models") == (200, "ready\n")
        server.ready.clear()  # as while the model loads
        assert await http_get(server, "/readyz") == (503, "not ready\n")
        assert await http_get(server, "/readyz", token=TOKEN) == (503, "loading\n")
        server.ready.set()


class _Records(logging.Handler):
    """The engine's log records, and an event per message pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[int, str]] = []
        self.seen = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.seen:
            self.messages.append((record.levelno, record.getMessage()))
            self.seen.notify_all()

    def count(self, text: str, level: int) -> int:
        return sum(1 for lv, message in self.messages if text in message and lv == level)

    def wait_for(self, text: str, level: int) -> None:
        with self.seen:
            assert self.seen.wait_for(lambda: self.count(text, level), timeout(30)), text


@pytest.fixture
def records() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("wsserver.llama")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@pytest.mark.llama
async def test_a_stalled_engine_makes_readyz_503_shows_in_metrics_and_is_logged_once(
    tiny_gguf: Path, records: _Records
) -> None:
    pytest.importorskip("llama_cpp")
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_threads=1,
        backend__llama__engine_stall_s=0.3,
        security__auth_token=TOKEN,
    )
    release = threading.Event()
    entered = threading.Event()

    def stick(request_id: str, prompt_tokens: int) -> None:
        entered.set()
        release.wait(timeout(60))

    async with running_server(config) as server:
        backend = server.backend
        backend.on_prefill = stick  # type: ignore[attr-defined]
        try:
            async with wire(server, subprotocols=["wsserver.v1", f"bearer.{TOKEN}"]) as ws:
                await ws.send(
                    {"type": "generate", "id": "held", "prompt": "Hello", "max_tokens": 4}
                )
                assert await asyncio.to_thread(entered.wait, timeout(30))
                stall = "has not finished a step"
                await asyncio.to_thread(records.wait_for, stall, logging.ERROR)
                line = next(m for lv, m in records.messages if stall in m)
                # What the engine is doing, and the request it holds.
                assert "decoding a batch" in line and "held (prompt, 0 tokens)" in line, line
                status, body = await http_get(server, "/readyz", token=TOKEN)
                assert status == 503 and stall in body, body
                assert "held" not in body  # no request's id on the probe
                assert await http_get(server, "/readyz") == (503, "not ready\n")
                status, metrics = await http_get(server, "/metrics", token=TOKEN)
                assert 'wsserver_model_engine_stalled{model="tiny"} 1.0' in metrics
                step = re.search(
                    r'wsserver_model_engine_step_seconds\{model="tiny"\} (\S+)', metrics
                )
                assert step is not None and float(step.group(1)) >= 0.3
                # Five probes and as many /readyz later, still one error line.
                probes = len(server.metrics.loop_lag_samples)
                while len(server.metrics.loop_lag_samples) < probes + 5:
                    assert (await http_get(server, "/readyz"))[0] == 503
                assert records.count(stall, logging.ERROR) == 1
                release.set()
                _, frames = await ws.done("held")
                assert frames[-1]["reason"] == "length"
            await asyncio.to_thread(records.wait_for, "finished a step again", logging.WARNING)
            assert await http_get(server, "/readyz") == (200, "ready\n")
            status, metrics = await http_get(server, "/metrics", token=TOKEN)
            assert 'wsserver_model_engine_stalled{model="tiny"} 0.0' in metrics
        finally:
            release.set()
