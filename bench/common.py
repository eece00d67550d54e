"""Shared pieces of the harness: statistics, subprocesses, machine facts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def _resolve_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved here, in the parent: the child of a fork in a threaded process
# should not load libraries before exec.
_PRCTL = _resolve_prctl()
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGKILL if the harness dies first.

    A harness killed by a timeout must not leave model servers behind,
    generating on a 2-core machine that other runs share.
    """
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


class Skip(Exception):
    """A section (or part of one) cannot run here; the message says why."""


# ------------------------------------------------------------------ statistics


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: Iterable[float]) -> dict[str, Any]:
    """Median, p99, min, max and count of a list of measurements."""
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "median": None, "p99": None, "min": None, "max": None}
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "p99": percentile(vals, 99),
        "min": min(vals),
        "max": max(vals),
    }


def fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


# ------------------------------------------------------------------ processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile(want: int = 65536) -> int:
    """Raise this process's open-files soft limit as far as allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


@dataclass
class ServerProcess:
    """``bench.probe_server`` in a subprocess, driven over stdin/stdout."""

    overrides: dict[str, Any]
    name: str = "wsserver"
    proc: asyncio.subprocess.Process | None = None
    url: str = ""
    pid: int = 0
    log_path: Path = field(
        default_factory=lambda: Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1])
    )
    #: The checkout whose wsserver runs (another commit's, for ``--baseline``).
    root: Path = ROOT

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

    async def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited early; log:\n{self.log_tail()}")
        return dict(json.loads(line))

    async def command(self, cmd: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._line(timeout)

    async def stats(self, reset: bool = False, series: bool = False) -> dict[str, Any]:
        return await self.command("stats", reset=reset, series=series)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

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


# ------------------------------------------------------------------ machine


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(OSError, ValueError, subprocess.CalledProcessError):
        info["nproc"] = int(
            subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout
        )
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        models = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.splitlines()
            if line.startswith("model name")
        ]
        flags = next(
            (
                line.split(":", 1)[1].split()
                for line in cpuinfo.splitlines()
                if line.startswith("flags")
            ),
            [],
        )
        mhz = [
            line.split(":", 1)[1].strip()
            for line in cpuinfo.splitlines()
            if line.startswith("cpu MHz")
        ]
        info["cpu_model"] = models[0] if models else platform.processor()
        info["cpu_logical"] = len(models)
        info["cpu_mhz"] = mhz[0] if mhz else None
        info["cpu_flags"] = [
            f for f in ("avx2", "avx512f", "fma", "f16c", "amx_tile") if f in flags
        ]
    except OSError:
        pass
    try:
        meminfo = Path("/proc/meminfo").read_text()
        total_kb = int(
            next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemTotal"))
        )
        info["memory_gib"] = round(total_kb / 1024 / 1024, 1)
    except (OSError, StopIteration, ValueError):
        pass
    try:
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
    except ImportError:
        pass
    try:
        import websockets

        info["websockets"] = websockets.__version__
    except ImportError:
        pass
    return info


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


#: Limits a load test must lift: the defaults protect a desktop server from a
#: runaway page (connections per IP, total connections, client frame rate),
#: and the harness deliberately opens hundreds of connections from one address.
LOAD_TEST_LIMITS = {
    "limits.max_connections": 0,
    "limits.max_connections_per_ip": 0,
    "limits.frames_per_s": 0.0,
}


def server_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` restricted to keys this wsserver version knows.

    The configuration grows while the project does; a key the server does
    not have yet (or no longer has) is dropped rather than fatal.
    """
    from wsserver.config import KEYS

    known = {".".join(k) for k in KEYS}
    return {k: v for k, v in overrides.items() if k in known or k.startswith("bench.")}
