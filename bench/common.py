"""What every part of the harness stands on: paths, child processes, machine facts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


class Skip(Exception):
    """A section (or part of one) cannot run here; the message says why."""


# ------------------------------------------------------------------ processes


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


async def end_process(proc: asyncio.subprocess.Process, timeout: float = 30.0) -> None:
    """Terminate a child, and kill it if it has not exited within ``timeout``."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()


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


def log_tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# ------------------------------------------------------------------ machine


def _cpuinfo(cpuinfo: str, key: str) -> list[str]:
    return [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith(key)]


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
        models = _cpuinfo(cpuinfo, "model name")
        flags = next(iter(_cpuinfo(cpuinfo, "flags")), "").split()
        mhz = _cpuinfo(cpuinfo, "cpu MHz")
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
    for module, key in (("llama_cpp", "llama_cpp_python"), ("websockets", "websockets")):
        with contextlib.suppress(ImportError):
            info[key] = __import__(module).__version__
    return info


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages: other work on the machine."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
