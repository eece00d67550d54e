"""Faults found by attacking 0.1.0 (issue: Hardening II), each over real sockets.

Each test here failed before its fix. The scheduler's interleavings are in
test_scheduler.py and test_scheduler_states.py, the parser's in
test_properties.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Wire, handlers_finished, running_server, slow_wire, timeout, wire
from test_metrics import scrape
from test_security import http, refused_status
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from wsserver.aio import Server
from wsserver.aio.peer import PeerAwareConnection, memory_bound
from wsserver.aio.socket_connection import SocketConnection
from wsserver.logs import RepeatFilter, TextFormatter, escape_controls, setup_logging
from wsserver.security import ConnectionLimiter, client_group

# ---------------------------------------------------------------- log injection


@pytest.fixture
def server_log() -> Iterator[io.StringIO]:
    """The server's log, as the CLI sets it up, written to a buffer."""
    loggers = [logging.getLogger(n) for n in ("wsserver", "websockets", "asyncio")]
    saved = [(lg.handlers[:], lg.propagate, lg.level) for lg in loggers]
    buffer = io.StringIO()
    setup_logging(level="info", stream=buffer)
    try:
        yield buffer
    finally:
        for logger, (handlers, propagate, level) in zip(loggers, saved, strict=True):
            logger.handlers[:] = handlers
            logger.propagate = propagate
            logger.setLevel(level)


def test_escape_controls() -> None:
    assert escape_controls("a\x1b[2Jb\rc\x07d\x7f\x9be") == "a\\x1b[2Jb\\x0dc\\x07d\\x7f\\x9be"
    assert escape_controls("line\nnext", keep_newlines=True) == "line\nnext"
    assert escape_controls("line\nnext") == "line\\x0anext"
    assert escape_controls("héllo → 日本 🙂") == "héllo → 日本 🙂"


async def test_a_refused_path_with_terminal_controls_is_logged_escaped(
    server_log: io.StringIO,
) -> None:
    async with running_server() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /\x1b[2Jx\x07y\rz HTTP/1.1\r\nHost: evil.example\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(timeout()):
            answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 403")
    text = server_log.getvalue()
    assert "refused request /\\x1b[2Jx\\x07y\\x0dz" in text
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", text), "a raw control character"


async def test_client_chosen_close_reason_and_ids_are_escaped(server_log: io.StringIO) -> None:
    async with running_server() as server:
        async with wire(server) as client:
            await client.send({"type": "cancel", "id": "x\x1by"})  # refused: bad id
            await client.recv()
            await client.ws.close(4000, "bye\x1b]0;pwned\x07")
        await handlers_finished(server)
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", server_log.getvalue())


# ---------------------------------------------------------------- traceback storms


def test_repeat_filter_lets_one_through_per_interval_and_counts_the_rest() -> None:
    now = [0.0]
    repeat = RepeatFilter(interval=10.0, clock=lambda: now[0])
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(TextFormatter())
    handler.addFilter(repeat)
    logger = logging.getLogger("wsserver.test-repeat")
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for _ in range(500):
            logger.error("handshake failed from %s", "1.2.3.4")
        logger.info("info is never limited")
        logger.info("info is never limited")
        now[0] = 10.5
        logger.error("handshake failed from %s", "5.6.7.8")
        logger.warning("another kind passes")
    finally:
        logger.removeHandler(handler)
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 5, lines
    assert lines[3].endswith(
        "handshake failed from 5.6.7.8 (499 similar suppressed in the last 10s)"
    )


def test_setup_logging_rate_limits_websockets_and_asyncio_too(server_log: io.StringIO) -> None:
    for name in ("websockets.server", "asyncio"):
        for _ in range(200):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logging.getLogger(name).error(
                    "socket.accept() out of system resource", exc_info=True
                )
    text = server_log.getvalue()
    assert text.count("out of system resource") == 2
    assert text.count("Traceback") == 2


def test_running_out_of_file_descriptors_logs_little_and_recovers(tmp_path: Path) -> None:
    """A server limited to 64 descriptors, then flooded with half-open requests:
    a handful of log lines, and /healthz answers again once the flood ends."""
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "from wsserver.cli import main\n"
        "sys.exit(main(['serve', '--backend', 'fake', '--port', '0']))\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert process.stderr is not None
    lines: list[str] = []
    try:
        port = _wait_for_port(process, lines)
        flood: list[socket.socket] = []
        try:
            # More connections than descriptors: the server runs out while they hang.
            for _ in range(120):
                s = socket.create_connection(("127.0.0.1", port), timeout=timeout())
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
                flood.append(s)
            _read_until(process, lines, "out of system resource")
        finally:
            for s in flood:
                s.close()
        # The listening socket is retried by asyncio; a probe queued in the
        # backlog is answered as soon as the server accepts again.
        with socket.create_connection(("127.0.0.1", port), timeout=timeout(20)) as probe:
            probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert probe.recv(200).startswith(b"HTTP/1.1 200")
    finally:
        process.terminate()
        rest = process.communicate(timeout=timeout(20))[1]
        lines.extend(rest.splitlines())
    storm = [line for line in lines if "out of system resource" in line]
    assert 1 <= len(storm) <= 3, storm
    assert sum(len(line) for line in lines) < 20_000


def _wait_for_port(process: subprocess.Popen[str], lines: list[str]) -> int:
    line = _read_until(process, lines, "listening on ws://")
    match = re.search(r"ws://[^:]+:(\d+)/", line)
    assert match, line
    return int(match.group(1))


def _read_until(process: subprocess.Popen[str], lines: list[str], needle: str) -> str:
    assert process.stderr is not None
    while True:  # bounded by pytest's timeout; readline blocks on the child's output
        line = process.stderr.readline()
        if not line:
            raise AssertionError(f"server exited before logging {needle!r}: {lines[-20:]}")
        lines.append(line)
        if needle in line:
            return line


# ---------------------------------------------------------------- metric labels


async def test_close_codes_the_client_chooses_do_not_mint_series() -> None:
    async with running_server() as server:
        for code in range(3000, 3020):
            async with wire(server) as client:
                await client.ws.close(code, "mine")
        await handlers_finished(server)
        samples = await scrape(server)
    closes = {k: v for k, v in samples.items() if k.startswith("wsserver_connection_closes_total")}
    assert closes == {'wsserver_connection_closes_total{code="other"}': 20.0}


async def test_a_close_the_server_began_counts_the_code_it_sent() -> None:
    """Oversize frame → the server closes with 1009; this client never echoes it."""
    async with running_server(server__max_frame_bytes=1024) as server:
        async with connect(server.url) as ws:
            await ws.recv()  # hello
            ws.transport.pause_reading()  # never see the server's close frame
            await ws.send("x" * 4096)
            ws.transport.abort()
        await handlers_finished(server)
        samples = await scrape(server)
    assert samples.get('wsserver_connection_closes_total{code="1009"}') == 1.0
    assert 'wsserver_connection_closes_total{code="1006"}' not in samples


# ---------------------------------------------------------------- per-client limit


def test_client_groups() -> None:
    assert client_group("127.0.0.1") == client_group("127.0.0.2") == client_group("::1")
    assert client_group("::ffff:127.0.0.5") == "loopback"
    assert client_group("10.0.0.1") != client_group("10.0.0.2")
    assert client_group("::ffff:10.0.0.1") == "10.0.0.1"
    assert client_group("2001:db8::1") == client_group("2001:db8::ffff:1") == "2001:db8::/64"
    assert client_group("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert client_group("fe80::1%eth0") == "fe80::/64"
    assert client_group("?") == "?"
    limiter = ConnectionLimiter(max_total=0, max_per_ip=2)
    assert limiter.admit("a", "2001:db8::1", lambda: True) is None
    assert limiter.admit("b", "2001:db8::2", lambda: True) is None
    refusal = limiter.admit("c", "2001:db8::3", lambda: True)
    assert refusal is not None and refusal.status == 429
    assert limiter.admit("c", "2001:db8:1::3", lambda: True) is None


async def test_loopback_sources_share_one_per_client_limit() -> None:
    async with running_server(limits__max_connections_per_ip=2) as server:
        async with (
            connect(server.url, local_addr=("127.0.0.2", 0)),
            connect(server.url, local_addr=("127.0.0.3", 0)),
        ):
            assert await refused_status(server.url, local_addr=("127.0.0.4", 0)) == 429
        await handlers_finished(server)
        async with connect(server.url, local_addr=("127.0.0.5", 0)):
            pass  # room again once they left


# ---------------------------------------------------------------- memory ceilings


def _connection(server: Server) -> SocketConnection:
    """The newest connection (an earlier one may still be winding down)."""
    return list(server.connections.values())[-1]


def _raw_ws_socket(port: int) -> socket.socket:
    """A blocking client socket after a WebSocket handshake, reading nothing more."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(timeout())
    sock.connect(("127.0.0.1", port))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        (
            "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    # The hello frame: once it is here, the server has registered the connection.
    header = _recv_exactly(sock, 2)
    length = header[1] & 0x7F
    if length == 126:
        length = int.from_bytes(_recv_exactly(sock, 2), "big")
    assert b'"hello"' in _recv_exactly(sock, length)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "server closed the connection"
        data += chunk
    return data


def _masked(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        header = bytes([0x80 | opcode, 0x80 | n])
    elif n < 65536:
        header = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        header = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _send_until_refused(sock: socket.socket, data: bytes, stop: threading.Event) -> int:
    """Send ``data`` over and over until the server stops reading or aborts."""
    sent = 0
    sock.settimeout(None)
    with contextlib.suppress(OSError):
        while not stop.is_set():
            sock.sendall(data)
            sent += len(data)
    return sent


async def test_a_never_reading_ping_sender_is_capped_then_aborted() -> None:
    """Found by attacking 0.1.0: pongs piled up at ~17 MiB/s without limit."""
    async with running_server(server__send_timeout_s=2.0, server__ping_interval_s=0) as server:
        sock = await asyncio.to_thread(_raw_ws_socket, server.port)
        stop = threading.Event()
        pings = _masked(0x9, b"p" * 125) * 512  # 66 KB of pings per write
        flood = asyncio.create_task(asyncio.to_thread(_send_until_refused, sock, pings, stop))
        try:
            connection = _connection(server)
            ws = connection.ws
            assert isinstance(ws, PeerAwareConnection)
            async with asyncio.timeout(timeout(20)):
                await ws.reading_paused.wait()
            held = connection.held_bytes()
            bound = memory_bound(server.config)
            assert ws.output_overflows >= 1
            assert held["send"] <= bound["send"], (held, bound)
            assert held["receive"] <= bound["receive"], (held, bound)
            # Nothing drains: after send_timeout_s the connection is aborted.
            await handlers_finished(server)
        finally:
            stop.set()
            sock.close()
            await flood


async def test_a_never_reading_client_sending_maximal_frames_stays_within_the_bound() -> None:
    """Found by attacking 0.1.0: while the receive loop waited on a reply to a
    client that does not read, websockets queued 16 more 1 MiB messages."""
    async with running_server(
        backend__fake__tokens_per_s=0,
        server__send_timeout_s=timeout(30),  # the test ends it; see the ping test for the abort
        stream__stall_timeout_s=0,
    ) as server:
        async with slow_wire(server) as client:
            await client.send({"type": "generate", "id": "g", "prompt": "p", "max_tokens": 10**6})
            await client.until(lambda f: f["type"] == "started")
            client.ws.transport.pause_reading()  # from now on, read nothing
            connection = _connection(server)
            ws = connection.ws
            assert isinstance(ws, PeerAwareConnection)
            async with asyncio.timeout(timeout(20)):
                await ws.writing_paused.wait()  # backed up: every reply now waits
            size = server.config.server.max_frame_bytes - 100
            frame = json.dumps({"type": "nope", "pad": "x" * (size - 30)})
            sending = asyncio.create_task(_send_many(client, frame, 32))
            async with asyncio.timeout(timeout(20)):
                await ws.reading_paused.wait()
            held = connection.held_bytes()
            bound = memory_bound(server.config)
            assert held["receive"] <= bound["receive"], (held, bound)
            assert held["send"] <= bound["send"], (held, bound)
            assert sum(held.values()) <= sum(bound.values())
            client.ws.transport.abort()
            await handlers_finished(server)
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionClosed):
                await sending


async def _send_many(client: Wire, frame: str, count: int) -> None:
    for _ in range(count):
        await client.send(frame)


async def test_closed_connections_are_freed_without_the_cyclic_gc() -> None:
    """Found by attacking 0.1.0: Connection → websocket → bound callback →
    Connection kept every closed connection until the cyclic GC ran."""
    gc.collect()
    gc.disable()
    try:
        async with running_server() as server:
            refs = []
            for n in range(5):
                async with wire(server) as client:
                    refs.append(weakref.ref(_connection(server)))
                    await client.send(
                        {"type": "generate", "id": f"r{n}", "prompt": "p", "max_tokens": 3}
                    )
                    await client.done(f"r{n}")
                    await client.send({"type": "generate", "id": f"s{n}", "prompt": "p"})
                    await client.until(lambda f: f["type"] == "delta")
                    if n % 2:  # ... and leave mid-stream, half of them without a close frame
                        client.ws.transport.abort()
            await handlers_finished(server)
            alive = [ref() for ref in refs if ref() is not None]
            assert not alive, f"{len(alive)} of {len(refs)} closed connections still alive"
    finally:
        gc.enable()


# ---------------------------------------------------------------- health


async def test_readyz_reports_a_slot_held_by_no_request() -> None:
    """The last line of defence: a leaked slot (made here by hand) is not hidden."""
    async with running_server(backend__fake__parallel=1) as server:
        status, _, _ = await http(server, "/readyz")
        assert status == 200
        reported = asyncio.Event()
        watcher = _OnRecord("do not balance", reported)
        logging.getLogger("wsserver.metrics").addHandler(watcher)
        try:
            leaked = await server.scheduler.acquire("nobody", lambda p: None)
            now = asyncio.get_running_loop().time()
            assert server.orphaned_slots(now) == []  # between owners for a moment: fine
            async with asyncio.timeout(timeout(20)):
                await reported.wait()  # the periodic probe logs it after the grace
        finally:
            logging.getLogger("wsserver.metrics").removeHandler(watcher)
        status, _, body = await http(server, "/readyz")
        assert status == 503 and b"do not balance" in body
        server.scheduler.release(leaked)
        status, _, _ = await http(server, "/readyz")
        assert status == 200


class _OnRecord(logging.Handler):
    def __init__(self, needle: str, event: asyncio.Event) -> None:
        super().__init__(logging.DEBUG)
        self.needle, self.event = needle, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.event.set()


async def test_a_wild_role_while_a_request_runs_leaves_both_usable() -> None:
    async with running_server() as server:
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "a", "prompt": "p", "max_tokens": 20})
            await client.send(
                {"type": "generate", "id": "b", "messages": [{"role": ["x"], "content": "c"}]}
            )
            await client.send(
                {
                    "type": "restart",
                    "id": "a",
                    "new_id": "c",
                    "messages": [{"role": {}, "content": "c"}],
                }
            )
            errors = await client.until(lambda f: f["type"] == "error" and f["id"] == "c")
            assert [f["code"] for f in errors if f["type"] == "error"] == ["bad_request"] * 2
            text, frames = await client.done("a")
            assert frames[-1]["reason"] == "length" and text
            await client.send({"type": "generate", "id": "d", "prompt": "p", "max_tokens": 2})
            assert (await client.done("d"))[1][-1]["reason"] == "length"


async def test_a_websocket_failed_with_its_output_unsent_is_released_at_a_deadline() -> None:
    """Hardening III, fault 4 on the WebSocket side: a connection that
    websockets ended (here: its keepalive ping got no pong) while a client that
    never reads leaves output unsent is released within a deadline. Two
    mechanisms bound it — websockets' ``close_timeout`` and, after its EOF,
    ``PeerAwareConnection``'s output deadline — so this test fails only if
    both do (it passes with either one removed)."""
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        server__sndbuf=1024,
        server__ping_interval_s=timeout(0.5),
        server__send_timeout_s=timeout(1),
    ) as server:
        async with slow_wire(server, rcvbuf=1024, max_queue=1) as client:
            # A request whose frames fit in the server's write buffer but not in
            # the sockets': it ends, and its last bytes wait for the client.
            await client.send({"type": "generate", "id": "a", "prompt": "p", "max_tokens": 1500})
            (connection,) = server.connections.values()
            websocket = connection.ws
            # The keepalive fails the connection (its close frame queued behind
            # the unsent bytes); the client still reads nothing.
            async with asyncio.timeout(timeout(20)):
                await websocket.wait_closed()
            assert websocket.transport.is_closing()
