"""Fixtures for the browser tests: a live wsserver and headless Chromium.

The server runs in a background thread with its own event loop, so that the
tests can drive Playwright's synchronous API from the main thread while the
server keeps serving. Helpers wait on events and on the page (Playwright's
auto-waiting locators, ``wait_for_function``), never on sleeps; every timeout
derives from ``WSSERVER_TEST_UNIT`` like the rest of the suite.

Chromium comes from Debian (/usr/bin/chromium, or ``WSSERVER_CHROMIUM``):
Playwright's own browser download cannot work here. If it cannot start, the
tests are skipped with the reason, except in CI (``CI=true``), where they fail
loudly: a browser suite that silently skips proves nothing.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

from wsserver.aio import Server
from wsserver.backends.base import Backend
from wsserver.config import load_config

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
UNIT = float(os.environ.get("WSSERVER_TEST_UNIT", "1.0"))
CHROMIUM = os.environ.get("WSSERVER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]

T = TypeVar("T")


def timeout(units: float = 10.0) -> float:
    """A generous timeout in seconds, scaled by WSSERVER_TEST_UNIT."""
    return units * UNIT


def ms(units: float = 10.0) -> float:
    """The same, in milliseconds (Playwright's unit)."""
    return timeout(units) * 1000.0


class LiveServer:
    """A wsserver on 127.0.0.1 in a thread with its own event loop.

    ``stop()`` and ``start()`` again reuse the same port, so a client can
    reconnect to "the same server" after an outage.
    """

    def __init__(
        self, overrides: dict[str, Any], backend: Callable[[], Backend] | None = None
    ) -> None:
        values: dict[str, Any] = {
            "server.host": "127.0.0.1",
            "server.port": 0,
            "backend.kind": "fake",
            "backend.fake.tokens_per_s": 200,
            # Long outputs are the point of several tests.
            "limits.max_tokens": 1_000_000,
        }
        values.update(overrides)
        self._values = values
        #: Makes the engine (default: the configured one), afresh on each start.
        self._backend = backend
        self.port = 0
        self.server: Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/"

    def start(self) -> LiveServer:
        values = dict(self._values)
        if self.port:
            values["server.port"] = self.port
        config = load_config(env={}, overrides=values).config
        started: Future[int] = Future()

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            server = Server(config, self._backend() if self._backend else None)
            try:
                await server.start()
                await server.wait_ready()
            except BaseException as exc:
                started.set_exception(exc)
                await server.stop(grace=0)
                return
            self.server = server
            started.set_result(server.port)
            try:
                await self._stop.wait()
            finally:
                await server.stop(grace=0)

        self._thread = threading.Thread(
            target=asyncio.run, args=(main(),), name="wsserver-browser-tests", daemon=True
        )
        self._thread.start()
        self.port = started.result(timeout(30))
        return self

    def stop(self) -> None:
        """Stop the server (connections close with 1001) and join its thread."""
        if self._thread is None:
            return
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout(30))
        assert not self._thread.is_alive(), "the server thread did not stop"
        self._thread = None
        self.server = None

    def call(self, factory: Callable[[], Coroutine[Any, Any, T]], units: float = 20.0) -> T:
        """Run a coroutine on the server's loop and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(factory(), self._loop).result(timeout(units))

    def drop_connections(self) -> int:
        """Abort every client connection from the server side (as a crash would)."""

        async def drop() -> int:
            assert self.server is not None
            connections = list(self.server.connections.values())
            for connection in connections:
                connection.ws.transport.abort()
            return len(connections)

        return self.call(drop)


@pytest.fixture
def live_server_factory() -> Iterator[Callable[..., LiveServer]]:
    """``live_server_factory(**{"backend.fake.tokens_per_s": 0})`` → a started
    server; ``backend=`` a callable that makes its engine instead."""
    servers: list[LiveServer] = []

    def make(backend: Callable[[], Backend] | None = None, **overrides: Any) -> LiveServer:
        server = LiveServer(overrides, backend).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def live_server(live_server_factory: Callable[..., LiveServer]) -> LiveServer:
    """The fake backend at 200 tokens/s."""
    return live_server_factory()


def reference_text(server: LiveServer, **request: Any) -> tuple[str, dict[str, Any]]:
    """What the bundled Python client receives for ``request``: (text, done)."""
    from wsserver_client.client import Client

    async def run() -> tuple[str, dict[str, Any]]:
        async with Client(server.ws_url) as client:
            result = await client.generate(**request).result()
        done = result.done
        return result.text, {
            "reason": done.reason,
            "completion_tokens": done.usage.completion_tokens,
        }

    return server.call(run, units=60)


# ---------------------------------------------------------------------- browser


def _launch_failure(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"Chromium is required in CI and could not start: {reason}", pytrace=False)
    pytest.skip(f"Chromium could not start ({reason}); install the Debian package 'chromium'")


@pytest.fixture(scope="package")
def browser() -> Iterator[Any]:
    # Package scope, not session: Playwright's sync API marks its event loop
    # as running in the main thread while it is started, and pytest-asyncio
    # cannot run the rest of the suite's async tests under it.
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        _launch_failure(f"Playwright is not installed: {exc}")
    if not Path(CHROMIUM).exists():
        _launch_failure(f"{CHROMIUM} does not exist")
    manager = sync_playwright()
    playwright = manager.start()
    try:
        instance = playwright.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=ms(30)
        )
    except PlaywrightError as exc:
        manager.__exit__(None, None, None)
        _launch_failure(str(exc).splitlines()[0])
    try:
        yield instance
    finally:
        instance.close()
        manager.__exit__(None, None, None)


@pytest.fixture
def context(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A fresh browser context; parametrize indirectly with {"color_scheme": "dark"},
    {"csp": True} (enforce the page's Content-Security-Policy), {"permissions": True}
    (the clipboard may be read and written)."""
    options = getattr(request, "param", {})
    ctx = browser.new_context(
        viewport={"width": 1000, "height": 760},
        device_scale_factor=1,
        color_scheme=options.get("color_scheme", "light"),
        reduced_motion="reduce",
        # Playwright's wait_for_function evaluates its predicate with eval(),
        # which the page's CSP forbids; one test runs with the CSP enforced.
        bypass_csp=not options.get("csp", False),
        permissions=["clipboard-read", "clipboard-write"] if options.get("permissions") else [],
    )
    ctx.set_default_timeout(ms(10))
    try:
        yield ctx
    finally:
        ctx.close()


@pytest.fixture
def page(context: Any) -> Iterator[Any]:
    """A page whose uncaught JavaScript errors fail the test."""
    from playwright.sync_api import expect

    expect.set_options(timeout=ms(10))
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))

    def on_console(message: Any) -> None:
        # A refused or dropped WebSocket is logged by Chromium itself; the
        # reconnect tests cause those on purpose.
        if message.type != "error" or "WebSocket connection to" in message.text:
            return
        # Chromium asks for /favicon.ico on pages that name no icon (/healthz).
        if message.location.get("url", "").endswith("/favicon.ico"):
            return
        errors.append(f"{message.text} ({message.location.get('url')})")

    page.on("console", on_console)
    yield page
    assert not errors, f"JavaScript errors on the page: {errors}"


def save_artifact(name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS / name
