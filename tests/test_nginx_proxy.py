"""A real nginx in front of two wsserver processes, sticky-free (docs/scale-out.md).

Two ``python -m wsserver serve`` processes (fake backend, ephemeral ports)
and a Debian nginx (installed by ``scripts/install --test``) with the
configuration docs/scale-out.md recommends, generated into a temporary
prefix and run as the current user in the foreground: pid file, logs and
temp paths all live under ``tmp_path``. nginx says which process took a
WebSocket in a response header of the handshake (``$upstream_addr``), and
each process's own ``/metrics`` agree.

What the proxy must not break: a stream arrives whole and in order; a
``cancel`` travels on the connection of its request, so it reaches the
process that runs it and ends that request alone; a process killed mid-run
drops its own clients at once (a close, never a hang) and nginx sends new
connections to the survivor.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from conftest import Wire, expected_fake_text, text_of, timeout
from test_shutdown import ServerProcess, scrape, server_process
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

#: The header the generated config adds to every response: the process nginx chose.
UPSTREAM_HEADER = "X-Wsserver-Upstream"


def nginx_binary() -> str:
    """nginx from the Debian package (/usr/sbin is not on every user's PATH)."""
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None
    )
    assert found, "nginx is not installed: run scripts/install --test (Debian package nginx)"
    return found


def nginx_conf(prefix: Path, port: int, backends: list[int]) -> str:
    """The config of docs/scale-out.md, with every path inside ``prefix``."""
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in backends)
    # Run as root (a container), the master would hand its workers to "nobody",
    # who cannot enter pytest's private tmp folders: keep them as ourselves.
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
    temp = "\n".join(
        f"    {kind}_temp_path {prefix / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""{user}worker_processes 1;
pid {prefix / "nginx.pid"};
error_log stderr notice;
events {{
    worker_connections 256;
}}
http {{
    access_log {prefix / "access.log"};
{temp}
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        ''      close;
    }}
    upstream wsserver {{
        # Round robin, no stickiness: any process can take any new connection.
{servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://wsserver;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_set_header Host $host;
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;
            proxy_buffering off;
            add_header {UPSTREAM_HEADER} $upstream_addr always;
        }}
    }}
}}
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.asynccontextmanager
async def nginx(prefix: Path, backends: list[int]) -> AsyncIterator[int]:
    """nginx in the foreground in front of ``backends``; yields the port it listens on."""
    binary = nginx_binary()
    prefix.mkdir(parents=True, exist_ok=True)
    for attempt in range(5):
        # nginx cannot listen on port 0 and say which it took: pick a free port,
        # and pick again if another process took it in between.
        port = _free_port()
        conf = prefix / "nginx.conf"
        conf.write_text(nginx_conf(prefix, port, backends))
        proc = await asyncio.create_subprocess_exec(
            binary,
            "-p",
            str(prefix),
            "-c",
            str(conf),
            "-e",
            "stderr",
            "-g",
            "daemon off;",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        process = ServerProcess(proc)
        try:
            # The master binds its sockets before it starts the workers.
            match = await process.wait_line(r"start worker process \d+|bind\(\) to .* failed")
            if "bind()" in match.group(0) and attempt < 4:
                continue
            assert "bind()" not in match.group(0), "\n".join(process.lines)
            yield port
            return
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGQUIT)  # graceful: the workers exit too
                try:
                    await asyncio.wait_for(proc.wait(), timeout(10))
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
            await process._reader


class Client:
    """A :class:`Wire` through nginx, with the backend port nginx chose for it."""

    def __init__(self, wire: Wire, backend: int) -> None:
        self.wire = wire
        self.backend = backend


@contextlib.asynccontextmanager
async def through(port: int) -> AsyncIterator[Client]:
    async with connect(f"ws://127.0.0.1:{port}/") as ws:
        assert ws.response is not None
        # After a failed attempt nginx lists every address it tried: the last one answered.
        chosen = ws.response.headers[UPSTREAM_HEADER].split(",")[-1].strip()
        client = Wire(ws)
        client.hello = await client.recv()
        assert client.hello["type"] == "hello"
        yield Client(client, int(chosen.rsplit(":", 1)[1]))


def generate(request_id: str, max_tokens: int, seed: int) -> dict[str, Any]:
    return {
        "type": "generate",
        "id": request_id,
        "prompt": f"through nginx {request_id}",
        "max_tokens": max_tokens,
        "seed": seed,
    }


def expected(request_id: str, max_tokens: int, seed: int) -> str:
    return expected_fake_text(f"through nginx {request_id}", max_tokens, seed)


async def first_delta(client: Client, request_id: str) -> None:
    await client.wire.until(lambda f: f["type"] == "delta" and f["id"] == request_id)


def _requests(metrics: dict[str, float], reason: str) -> float:
    return metrics.get(f'wsserver_requests_total{{reason="{reason}"}}', 0.0)


async def test_two_processes_behind_nginx(tmp_path: Path) -> None:
    settings = ("backend.fake.tokens_per_s=200", "limits.max_tokens=1000000")
    async with (
        server_process(*settings) as one,
        server_process(*settings) as two,
        nginx(tmp_path / "nginx", [one.port, two.port]) as port,
        contextlib.AsyncExitStack() as stack,
    ):
        by_port: dict[int, ServerProcess] = {one.port: one, two.port: two}

        # Round robin: four new connections land on both processes, two each,
        # and each process counts the ones nginx says it gave it.
        clients = [await stack.enter_async_context(through(port)) for _ in range(4)]
        landed = {p: [c for c in clients if c.backend == p] for p in by_port}
        assert {p: len(cs) for p, cs in landed.items()} == {one.port: 2, two.port: 2}
        for p in by_port:
            assert (await scrape(p))["wsserver_open_connections"] == 2

        # A stream on each connection; cancel one of the two on the first
        # process: that request alone ends, cancelled, on that process alone.
        (victim, sibling), others = landed[one.port], landed[two.port]
        await victim.wire.send(generate("victim", 1_000_000, seed=1))
        lengths = {"sibling": 120, "other0": 150, "other1": 180}
        await sibling.wire.send(generate("sibling", lengths["sibling"], seed=2))
        for n, client in enumerate(others):
            await client.wire.send(generate(f"other{n}", lengths[f"other{n}"], seed=3 + n))
        for client, request_id in [(victim, "victim"), (sibling, "sibling")]:
            await first_delta(client, request_id)
        for n, client in enumerate(others):
            await first_delta(client, f"other{n}")
        await victim.wire.send({"type": "cancel", "id": "victim"})
        _, frames = await victim.wire.done("victim")
        assert frames[-1]["reason"] == "cancelled"
        streams = [(sibling, "sibling", 2)] + [
            (client, f"other{n}", 3 + n) for n, client in enumerate(others)
        ]
        for client, request_id, seed in streams:
            text, frames = await client.wire.done(request_id, units=30)
            assert frames[-1]["reason"] == "length", frames[-1]
            assert text == expected(request_id, lengths[request_id], seed)
        first, second = await scrape(one.port), await scrape(two.port)
        assert (_requests(first, "cancelled"), _requests(first, "length")) == (1, 1)
        assert (_requests(second, "cancelled"), _requests(second, "length")) == (0, 2)

        # Kill the first process mid-stream: its clients are closed at once,
        # the second's stream goes on, and new connections all go to the second.
        await victim.wire.send(generate("doomed", 1_000_000, seed=5))
        survivor = others[0]
        await survivor.wire.send(generate("survivor", 200, seed=6))
        await first_delta(victim, "doomed")
        await first_delta(survivor, "survivor")
        one.proc.send_signal(signal.SIGKILL)
        assert await one.proc.wait() == -signal.SIGKILL
        for client in (victim, sibling):
            async with asyncio.timeout(timeout(10)):
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        await client.wire.recv()
            assert client.wire.ws.close_code is not None
        late = [await stack.enter_async_context(through(port)) for _ in range(3)]
        assert {c.backend for c in late} == {two.port}
        await late[0].wire.send(generate("late", 40, seed=7))
        text, frames = await late[0].wire.done("late")
        assert frames[-1]["reason"] == "length" and text == expected("late", 40, 7)
        text, frames = await survivor.wire.done("survivor", units=30)
        assert frames[-1]["reason"] == "length" and text == expected("survivor", 200, 6)
        assert text_of(survivor.wire.frames, "survivor") == text
