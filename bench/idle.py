"""Section 5 — memory per idle connection.

Open N WebSocket connections (each completes the handshake and reads
``hello``, then does nothing) and divide the server's RSS growth by N. The
server runs in its own process; a few connections are opened and closed first
so that one-time allocations (imports, first handshake) are not counted.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .common import raise_nofile
from .options import Options
from .servers import LOAD_TEST_LIMITS, ServerProcess
from .wsload import close_many, open_many


async def _wait_connections(
    server: ServerProcess, count: int, timeout: float = 30.0
) -> dict[str, Any]:
    """Poll the server until it reports ``count`` connections (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await server.stats()
        if stats["connections"] == count or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def run(opts: Options) -> dict[str, Any]:
    count = 200 if opts.quick else 1000
    limit = raise_nofile(count * 2 + 256)
    if limit < count + 64:
        return {
            "status": "skipped",
            "reason": f"open-files limit {limit} is too low for {count} connections",
        }
    out: dict[str, Any] = {"status": "ok", "connections": count}
    # First as the bundled client connects (permessage-deflate negotiated),
    # then without compression, to show what the deflate state costs. A fresh
    # server each time: freed memory stays in the allocator and would be reused.
    clients: dict[str, dict[str, Any]] = {"deflate": {}, "no_compression": {"compression": None}}
    for label, kwargs in clients.items():
        overrides = {"backend.kind": "fake", **LOAD_TEST_LIMITS}
        async with ServerProcess(overrides, name=f"wsserver-fake-idle-{label}") as server:
            warm = await open_many(server.url, 16, **kwargs)
            await close_many(warm)
            before = await _wait_connections(server, 0)
            opts.log(f"  idle: opening {count} connections ({label}) …")
            t0 = time.perf_counter()
            conns = await open_many(server.url, count, **kwargs)
            open_s = time.perf_counter() - t0
            negotiated = bool(getattr(conns[0].protocol, "extensions", None))
            after = await _wait_connections(server, count)
            await close_many(conns)
            closed = await _wait_connections(server, 0)
        delta = after["rss_bytes"] - before["rss_bytes"]
        out[label] = {
            "connections_seen": after["connections"],
            "rss_before_bytes": before["rss_bytes"],
            "rss_after_bytes": after["rss_bytes"],
            "rss_after_close_bytes": closed["rss_bytes"],
            "bytes_per_connection": delta / count,
            "open_seconds": open_s,
            "deflate_negotiated": negotiated,
        }
        opts.log(f"    {delta / count / 1024:.1f} KiB per idle connection ({label})")
        if not negotiated:
            break  # the server declines compression: a second run would measure the same
    out["bytes_per_connection"] = out["deflate"]["bytes_per_connection"]
    return out


def headlines(il: dict[str, Any]) -> list[str]:
    extra = ""
    if "no_compression" in il:
        extra = f" ({il['no_compression']['bytes_per_connection'] / 1024:.1f} KiB without permessage-deflate)"
    return [f"| memory per idle connection | {il['bytes_per_connection'] / 1024:.1f} KiB{extra} |"]


def render(r: dict[str, Any]) -> str:
    lines = [
        f"{r['connections']:,} idle connections (handshake + `hello`, then nothing), server in its own "
        "process, clients offering permessage-deflate as the bundled client does"
        + (
            " (the server accepted it); then again with compression off on the client side, to show "
            "what the per-connection deflate state costs."
            if r.get("deflate", {}).get("deflate_negotiated")
            else " (the server declines it, so connections carry no compression state)."
        )
        + " RSS after close stays high because the allocator keeps freed memory for reuse.",
        "",
        "| client | RSS before (MiB) | RSS with all open (MiB) | **RSS per idle connection (KiB)** "
        "| RSS after close (MiB) | time to open, 64 at a time (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, name in (
        ("deflate", "as the bundled client"),
        ("no_compression", "compression off"),
    ):
        m = r.get(label)
        if m is None:
            continue
        lines.append(
            f"| {name} | {m['rss_before_bytes'] / 2**20:.1f} | {m['rss_after_bytes'] / 2**20:.1f} "
            f"| **{m['bytes_per_connection'] / 1024:.1f}** | {m['rss_after_close_bytes'] / 2**20:.1f} "
            f"| {m['open_seconds']:.2f} |"
        )
    return "\n".join(lines)


def notes(r: dict[str, Any]) -> list[str]:
    if "no_compression" not in r:
        return []
    d, n = r["deflate"]["bytes_per_connection"], r["no_compression"]["bytes_per_connection"]
    if d - n < 8192:
        return []
    return [
        f"permessage-deflate accounts for about {(d - n) / 1024:.0f} KiB of each connection's "
        f"{d / 1024:.0f} KiB: websockets keeps a zlib compressor and decompressor per connection once "
        "the extension is negotiated. Token deltas are short and compress poorly; a server that expects "
        "thousands of idle tabs could turn compression off (`serve(compression=None)`)."
    ]
