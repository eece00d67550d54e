"""clients/js under Node.js: its own tests on Node's test runner, and its types.

``node --test clients/js/test/`` runs against a real server started here, on
this test's event loop, with a small HTTP control endpoint beside it so the
Node side can make the server misbehave (abort every connection, shut down,
come back on the same port) and ask what the server saw. Node's output is
shown when it fails.

``clients/js/test/tools.test.js`` runs against a server whose fake engine
echoes the last user message, so that its tests can script reasoning and
tool calls.

``clients/js/test/reconnect-policy.test.js`` needs no server: it checks the
JS client's reconnect/resume policy against clients/reconnect-policy.json, the
table tests/test_reconnect_policy.py checks the Python clients against.

``tsc -p clients/js`` checks wsserver.js against wsserver.d.ts (TypeScript is
a pinned dev dependency in clients/js/package.json, installed by
``scripts/install --test``); scripts/lint runs it too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import urllib.parse
from typing import Any, NoReturn

import pytest
from conftest import ROOT, expected_fake_text, make_config, timeout

from wsserver.aio import Server

JS = ROOT / "clients" / "js"
TSC = JS / "node_modules" / ".bin" / "tsc"
#: The oldest Node the module supports: 20 has WebSocket behind a flag.
MIN_NODE = 20


def _unavailable(reason: str) -> NoReturn:
    # scripts/install puts node and TypeScript on the machine, so in CI a
    # missing one is a broken install, not a reason to skip.
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (scripts/install --test should have installed it)", pytrace=False)
    pytest.skip(f"{reason}; run scripts/install --test")


def node_command() -> list[str]:
    """``node`` with the flags this version needs for a global WebSocket."""
    node = shutil.which("node")
    if node is None:
        _unavailable("Node.js is not installed")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    major = int(version.stdout.strip().lstrip("v").split(".")[0])
    if major < MIN_NODE:
        pytest.fail(f"Node {version.stdout.strip()} is too old: the JS client needs Node >= 20")
    return [node, "--experimental-websocket"] if major < 22 else [node]


class ControlledServer:
    """A wsserver plus an HTTP endpoint through which the Node tests steer it."""

    def __init__(self, **overrides: Any) -> None:
        self._overrides = overrides
        self.server: Server | None = None
        self.port = 0
        self._http: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    @property
    def control_url(self) -> str:
        assert self._http is not None
        return f"http://127.0.0.1:{self._http.sockets[0].getsockname()[1]}/"

    async def start(self) -> None:
        # After a stop, the same port again: the client reconnects to "the same server".
        server = Server(make_config(server__port=self.port, **self._overrides))
        await server.start()
        async with asyncio.timeout(timeout(60)):
            await server.wait_ready()
        self.server, self.port = server, server.port

    async def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop(grace=0)

    async def __aenter__(self) -> ControlledServer:
        await self.start()
        self._http = await asyncio.start_server(self._serve_control, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._http is not None
        self._http.close()
        await self._http.wait_closed()
        await self.stop()

    async def _control(self, method: str, path: str, query: dict[str, str]) -> dict[str, Any]:
        if (method, path) == ("POST", "/drop"):
            assert self.server is not None
            connections = list(self.server.connections.values())
            for connection in connections:
                connection.ws.transport.abort()
            return {"dropped": len(connections)}
        if (method, path) == ("POST", "/stop"):
            await self.stop()
            return {"stopped": True}
        if (method, path) == ("POST", "/start"):
            await self.start()
            return {"port": self.port}
        if (method, path) == ("GET", "/cancelled"):
            assert self.server is not None
            count = self.server.metrics.registry.get_sample_value(
                "wsserver_requests_total", {"reason": "cancelled"}
            )
            return {"count": count or 0}
        if (method, path) == ("GET", "/expected"):
            seed = int(query["seed"]) if "seed" in query else None
            return {"text": expected_fake_text(query["prompt"], int(query["max_tokens"]), seed)}
        raise LookupError(f"no control {method} {path}")

    async def _serve_control(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Just enough HTTP/1.1 for fetch(): one request per connection, no body."""
        try:
            method, target, _ = (await reader.readline()).decode("latin-1").split(" ", 2)
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            parts = urllib.parse.urlsplit(target)
            query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
            try:
                body, status = await self._control(method, parts.path, query), "200 OK"
            except Exception as exc:
                body, status = {"error": repr(exc)}, "500 Internal Server Error"
            data = json.dumps(body).encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        finally:
            writer.close()


async def test_the_js_client_under_node_against_a_real_server() -> None:
    command = node_command()
    async with ControlledServer(backend__fake__tokens_per_s=200.0) as server:
        returncode, output = await run_node_tests(command, server, "wsserver.test.js")
    assert_all_passed(returncode, output)


async def test_the_js_client_types_reasoning_and_tool_calls() -> None:
    """clients/js/test/tools.test.js: the fake engine echoes the last user
    message, so each test writes a think block and calls for "the model"."""
    command = node_command()
    async with ControlledServer(
        backend__fake__echo=True, backend__fake__tokens_per_s=300.0
    ) as server:
        returncode, output = await run_node_tests(command, server, "tools.test.js")
    assert_all_passed(returncode, output)


async def run_node_tests(
    command: list[str], server: ControlledServer, name: str, **more_env: str
) -> tuple[int | None, str]:
    """``node --test`` on clients/js/test/``name`` against ``server``."""
    env = {
        **os.environ,
        "WSSERVER_URL": server.url,
        "WSSERVER_CONTROL": server.control_url,
        "WSSERVER_TEST_UNIT": str(timeout(1.0)),
        **more_env,
    }
    node = await asyncio.create_subprocess_exec(
        *command,
        "--test",
        "--test-reporter=spec",
        str(JS / "test" / name),
        cwd=JS,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(timeout(180)):
            output, _ = await node.communicate()
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()
    return node.returncode, output.decode(errors="replace")


def test_the_js_client_follows_the_reconnect_policy_table() -> None:
    result = subprocess.run(
        [
            *node_command(),
            "--test",
            "--test-reporter=spec",
            str(JS / "test" / "reconnect-policy.test.js"),
        ],
        cwd=JS,
        capture_output=True,
        text=True,
        timeout=timeout(60),
    )
    assert_all_passed(result.returncode, result.stdout + result.stderr)


def assert_all_passed(returncode: int | None, text: str) -> None:
    """A ``node --test`` run (its exit code and spec report) passed every test it had."""
    print(text)
    assert returncode == 0, f"node --test failed ({returncode}):\n{text}"
    # Every test ran and passed: none skipped, cancelled or left as todo.
    counts = dict(re.findall(r"^\S+ (tests|pass|fail|cancelled|skipped|todo) (\d+)$", text, re.M))
    assert int(counts["tests"]) > 0 and counts["pass"] == counts["tests"], text


def test_the_declarations_match_the_module() -> None:
    """tsc fails if wsserver.d.ts and wsserver.js drift apart (see clients/js/tsconfig.json)."""
    node = node_command()[0]
    if not TSC.exists():
        _unavailable(f"{TSC.relative_to(ROOT)} is missing")
    result = subprocess.run(
        [node, str(TSC), "-p", str(JS), "--pretty", "false"],
        capture_output=True,
        text=True,
        timeout=timeout(120),
    )
    assert result.returncode == 0, result.stdout + result.stderr
