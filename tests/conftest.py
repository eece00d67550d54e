"""Shared test helpers.

Every timeout derives from one unit, ``WSSERVER_TEST_UNIT`` seconds (default
1.0): slow machines scale it up instead of editing tests. Nothing here sleeps
to synchronise; helpers wait on events with generous timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from wsserver.aio import Server
from wsserver.config import Config, load_config

# The tree's own Python client: an installed one may be another checkout's
# (an editable install of the main tree, tested from a worktree).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "clients" / "python"))

ROOT = Path(__file__).resolve().parents[1]
# Ctrl-C tests send SIGINT to the processes they start. A suite started in
# the background by a non-interactive shell (``script &``, as CI runners and
# nohup do) inherits SIGINT *ignored*, and so would every child, which then
# never hears the signal: restore the default here, so that children start
# as they would from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

UNIT = float(os.environ.get("WSSERVER_TEST_UNIT", "1.0"))

#: The names the tests' servers serve their model under (a request that names
#: another is refused with ``model_not_found``): the fake backend's, the tiny
#: GGUF's (its file's stem, :func:`tiny_gguf`) and the default model's.
FAKE_MODEL = "fake"
TINY_MODEL = "tiny"
DEFAULT_MODEL = "gemma-3-270m-q4_k_m"


def timeout(units: float = 10.0) -> float:
    """A generous timeout, in scaled units."""
    return units * UNIT


def make_config(**overrides: Any) -> Config:
    """A config for tests: fake backend, any free port, no environment."""
    # Long outputs are the point of several tests: lift the max_tokens limit.
    values: dict[str, Any] = {
        "server.port": 0,
        "backend.kind": "fake",
        "limits.max_tokens": 1_000_000,
    }
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(env={}, overrides=values).config


@contextlib.asynccontextmanager
async def running_server(config: Config | None = None, **overrides: Any) -> AsyncIterator[Server]:
    """A real server on 127.0.0.1, port 0; stopped (and checked for leaks) after."""
    server = Server(config if config is not None else make_config(**overrides))
    await server.start()
    pools: list[Any] = []
    try:
        async with asyncio.timeout(timeout(60)):
            await server.wait_ready()
        yield server
    finally:
        pools = template_pools(server)
        await server.stop(grace=0)
        # No producer thread may outlive the server.
        leftover = [
            t.name for t in threading.enumerate() if t.name.startswith("wsserver-producer-")
        ]
        assert not leftover, f"producer threads leaked: {leftover}"
        # Nor a chat template worker process (ended and reaped: not even a zombie).
        workers = [pid for pool in pools for pid in (*pool.pids(), *pool.started) if _exists(pid)]
        assert not workers, f"chat template workers leaked: {workers}"


def template_pools(server: Server) -> list[Any]:
    """The chat template worker pools of the server's loaded llama models."""
    pools = (getattr(m.backend, "templates", None) for m in server.models.models.values())
    return [pool for pool in pools if pool is not None]


def _exists(pid: int) -> bool:
    """Whether ``pid`` is a process, a zombie (not reaped) included."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


SCHEMA = json.loads((ROOT / "docs" / "protocol.schema.json").read_text())
jsonschema.Draft202012Validator.check_schema(SCHEMA)


def _validator(definition: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(
        {"$ref": f"#/$defs/{definition}", "$defs": SCHEMA["$defs"]}
    )


SERVER_FRAME = _validator("ServerFrame")
CLIENT_FRAME = _validator("ClientFrame")


def validate_server_frame(message: str | bytes) -> dict[str, Any]:
    """Check a raw server frame against docs/protocol.schema.json; return it parsed."""
    assert isinstance(message, str), "server frames must be text frames"
    obj: dict[str, Any] = json.loads(message)
    SERVER_FRAME.validate(obj)
    return obj


@pytest.fixture
def unit() -> float:
    return UNIT


class Wire:
    """A plain websockets client that checks every server frame against the schema.

    Tests that need to see the raw protocol use this instead of the bundled
    client, so that a bug in one cannot hide a bug in the other.
    """

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.frames: list[dict[str, Any]] = []
        self.hello: dict[str, Any] | None = None

    async def send(self, frame: dict[str, Any] | str | bytes) -> None:
        if isinstance(frame, dict):
            frame = json.dumps(frame)
        await self.ws.send(frame)

    async def recv(self, units: float = 10.0) -> dict[str, Any]:
        async with asyncio.timeout(timeout(units)):
            message = await self.ws.recv()
        frame = validate_server_frame(message)
        self.frames.append(frame)
        return frame

    async def until(self, predicate: Any, units: float = 10.0) -> list[dict[str, Any]]:
        """Frames up to and including the first one matching ``predicate``."""
        seen = []
        async with asyncio.timeout(timeout(units)):
            while True:
                frame = await self.recv(units)
                seen.append(frame)
                if predicate(frame):
                    return seen

    async def done(self, request_id: str, units: float = 10.0) -> tuple[str, list[dict[str, Any]]]:
        """Read to ``request_id``'s done; return its text and its frames."""
        await self.until(lambda f: f["type"] == "done" and f["id"] == request_id, units)
        mine = [f for f in self.frames if f.get("id") == request_id]
        return text_of(mine, request_id), mine


def text_of(frames: list[dict[str, Any]], request_id: str) -> str:
    deltas = [f for f in frames if f["type"] == "delta" and f["id"] == request_id]
    assert [d["seq"] for d in deltas] == list(range(len(deltas))), "seq must count 0, 1, 2 ..."
    return "".join(d["text"] for d in deltas)


@contextlib.asynccontextmanager
async def slow_wire(
    server: Server, *, rcvbuf: int = 8192, max_queue: int = 4
) -> AsyncIterator[Wire]:
    """A :class:`Wire` with a tiny socket receive buffer and message queue.

    When the test stops reading, the server feels it within kilobytes instead
    of the megabytes that Linux would otherwise buffer on loopback.
    """
    from websockets.asyncio.client import connect

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    async with connect(server.url, sock=sock, max_queue=max_queue) as ws:
        client = Wire(ws)
        client.hello = await client.recv()
        yield client


@contextlib.asynccontextmanager
async def wire(server: Server, **connect_kwargs: Any) -> AsyncIterator[Wire]:
    from websockets.asyncio.client import connect

    async with connect(server.url, **connect_kwargs) as ws:
        client = Wire(ws)
        client.hello = await client.recv()
        assert client.hello["type"] == "hello"
        yield client


def expected_fake_text(
    prompt: str, max_tokens: int, seed: int | None = None, stop: tuple[str, ...] = ()
) -> str:
    """The fake backend's text for a request, computed without the server.

    Decodes the raw token bytes in one go — an oracle independent of the
    incremental decoder the server uses.
    """
    from wsserver.backends.base import GenerationRequest
    from wsserver.backends.fake import fake_tokens

    request = GenerationRequest(
        id="oracle",
        prompt=prompt,
        messages=None,
        max_tokens=max_tokens,
        temperature=0.8,
        top_p=0.95,
        top_k=40,
        seed=seed,
        stop=stop,
    )
    tokens = fake_tokens(request)
    data = b"".join(next(tokens) for _ in range(max_tokens))
    text = data.decode("utf-8", errors="ignore")
    for s in stop:
        cut = text.find(s)
        if cut >= 0:
            text = text[:cut]
    return text


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight llama GGUF (tests/tiny_gguf.py), written once per session."""
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


async def refuses_to_load_then_serves(
    server: Server, client: Wire, where: str, refusals: dict[str, str]
) -> None:
    """Each model of ``refusals`` (name: what its refusal must say) answers a
    generate with ``model_load_failed`` naming ``where`` and that, and stays
    unloaded; then the default model still answers — a bad model file costs
    its load, not the server."""
    hi = [{"role": "user", "content": "hi"}]
    for name, said in refusals.items():
        await client.send({"type": "generate", "id": name, "model": name, "messages": hi})
        frames = await client.until(lambda f: f["type"] in ("error", "done"), units=30)
        error = frames[-1]
        assert (error["type"], error["code"]) == ("error", "model_load_failed")
        assert where in error["message"] and said in error["message"]
        assert server.models.models[name].state == "unloaded"
    await client.send({"type": "generate", "id": "served", "messages": hi, "max_tokens": 4})
    _, frames = await client.done("served")
    assert frames[-1]["reason"] == "length"


async def producers_joined(units: float = 10.0) -> None:
    """Join (a real join, not a sleep) every producer thread still running —
    a request whose answer is complete may still be letting its engine go."""
    for thread in threading.enumerate():
        if thread.name.startswith("wsserver-producer-"):
            await asyncio.to_thread(thread.join, timeout(units))
            assert not thread.is_alive(), f"{thread.name} did not exit"


async def handlers_finished(server: Server, units: float = 20.0) -> None:
    """Wait until every connection handler of ``server`` has returned."""
    assert server._ws_server is not None
    handlers = set(server._ws_server.handler_tasks)
    if handlers:
        await asyncio.wait(handlers, timeout=timeout(units))
    assert not server.connections, "connection handlers did not finish"


@contextlib.contextmanager
def listening_at(process: subprocess.Popen[str], pattern: str, what: str) -> Iterator[str]:
    """A server process started with ``--port 0``: yields the base URL its log
    line matching ``pattern`` (one group, the URL) names, plus ``/v1``, and
    stops it afterwards. Its log (the one pipe ``process`` was given) is read
    on a thread to the end, so the pipe never fills."""
    stream = process.stdout if process.stdout is not None else process.stderr
    assert stream is not None, "the process's log must be a pipe"
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:
        for line in stream:
            lines.put(line)
        lines.put("")

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        while True:
            line = lines.get(timeout=timeout(120))
            assert line, f"{what} exited before it listened"
            match = re.search(pattern, line)
            if match:
                break
        yield match.group(1) + "/v1"
    finally:
        process.terminate()
        process.wait(timeout(10))
        reader.join(timeout(10))
        stream.close()
