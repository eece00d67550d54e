"""Section 7 — adversarial clients: memory under a ping flood and maximal frames.

    python -m bench --sections adversaries     (or: python -m bench.adversaries --seconds 14)

One attacker connection at a time, against a fake-backend server in its own
process, for ``--seconds``:

* **ping sender** — sends WebSocket pings as fast as it can and reads
  nothing, not even the pongs (0.1.0: pongs piled up without limit);
* **maximal frames** — starts a long request, stops reading, then sends
  maximum-size frames (0.1.0: websockets queued 16 of them while the
  receive loop waited on a reply).

Each runs twice in the same session, side by side: with the defaults, and
with 0.1.0's settings (no output ceiling, websockets' ``max_queue`` 16).
Reported: the server's RSS growth (peak over the window, sampled every 50 ms
in the server), the most any one connection held (send + receive side), when
the server aborted the attacker, and the time to first token of a well-behaved
client that keeps making small requests meanwhile.

Run alone, prints the Markdown table and the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import time
from typing import Any

from .figures import fmt
from .options import Options
from .servers import LOAD_TEST_LIMITS, ServerProcess
from .timing import percentile
from .wsload import open_connection, request

MIB = 1024 * 1024

#: 0.1.0's effective settings: no ceiling on unsent output, websockets' default queue.
OLD = {"server.max_output_bytes": 1 << 28, "server.max_queue": 16}


def _handshake(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(10)
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
    if not head.startswith(b"HTTP/1.1 101"):
        raise RuntimeError(head)
    return sock


def _frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        header = bytes([0x80 | opcode, 0x80 | n])
    elif n < 65536:
        header = bytes([0x80 | opcode, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        header = bytes([0x80 | opcode, 0x80 | 127]) + n.to_bytes(8, "big")
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload[:4096]))
    if n > 4096:  # a repeated pattern keeps masking cheap: mask the 4 KiB block once
        masked = (masked * (n // 4096 + 1))[:n]
    return header + mask + masked


def _attack(port: int, kind: str, seconds: float, result: dict[str, Any]) -> None:
    """Run in a thread: attack until ``seconds`` pass or the server aborts us."""
    sock = _handshake(port)
    start = time.monotonic()
    if kind == "ping":
        data = _frame(0x9, b"p" * 125) * 512
    else:
        sock.sendall(_frame(0x1, b'{"type":"generate","id":"g","prompt":"p","max_tokens":1000000}'))
        data = _frame(0x1, b'{"type":"nope","pad":"' + b"x" * ((1 << 20) - 200) + b'"}')
    sent = 0
    sock.settimeout(0.5)
    try:
        while time.monotonic() - start < seconds:
            try:
                sock.sendall(data)
                sent += len(data)
            except TimeoutError:
                continue  # the server is not reading us: keep trying
        result["aborted_after_s"] = None
    except OSError:
        result["aborted_after_s"] = time.monotonic() - start
    finally:
        result["sent_mib"] = sent / 2**20
        sock.close()


async def _control(url: str, stop: asyncio.Event) -> list[float]:
    """A well-behaved client: small requests one after another; their TTFTs."""
    ttfts: list[float] = []
    ws = await open_connection(url)
    try:
        n = 0
        while not stop.is_set():
            n += 1
            frame = {"type": "generate", "id": f"c{n}", "prompt": "p", "max_tokens": 8}
            done = await request(ws, frame)
            ttfts.append(done["timings"]["ttft_ms"] or 0.0)
    finally:
        await ws.close()
    return ttfts


async def _scenario(kind: str, settings: dict[str, Any], seconds: float) -> dict[str, Any]:
    overrides = {
        **LOAD_TEST_LIMITS,
        "backend.kind": "fake",
        "backend.fake.tokens_per_s": 0.0,
        "server.send_timeout_s": 10.0,
        "server.ping_interval_s": 0.0,
        "stream.stall_timeout_s": 0.0,
        **settings,
    }
    async with ServerProcess(overrides, name=f"{kind}") as server:
        port = int(server.url.rsplit(":", 1)[1].strip("/"))
        await server.command("sample", on=True)
        before = await server.stats(reset=True)
        stop = asyncio.Event()
        control = asyncio.create_task(_control(server.url, stop))
        result: dict[str, Any] = {}
        await asyncio.to_thread(_attack, port, kind, seconds, result)
        stop.set()
        ttfts = await control
        after = await server.stats()
        return {
            "rss_growth_mib": (after["rss_max_bytes"] - before["rss_bytes"]) / 2**20,
            "max_held_mib": after["max_held_bytes"] / 2**20,
            "control_ttft_p50_ms": percentile(ttfts, 50),
            "control_ttft_p99_ms": percentile(ttfts, 99),
            **result,
        }


async def main(seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("ping", "frames"):
        for label, settings in (("0.1.0 settings", OLD), ("defaults", {})):
            out[f"{kind} / {label}"] = await _scenario(kind, settings, seconds)
    return out


async def run(opts: Options) -> dict[str, Any]:
    """The harness's entry point: 14 s per attack (3 s with ``--quick``)."""
    seconds = 3.0 if opts.quick else 14.0
    return {"status": "ok", "seconds": seconds, "rows": await main(seconds)}


def render(r: dict[str, Any]) -> str:
    """Section 7 of docs/benchmarks.md."""
    from wsserver.aio.peer import memory_bound
    from wsserver.config import load_config

    bound = memory_bound(load_config(env={}).config)
    total = sum(bound.values()) / MIB
    return "\n".join(
        [
            "One attacker connection at a time against a fake-backend server (its own process), "
            "run twice side by side: with the defaults, and with 0.1.0's settings (no ceiling on "
            "unsent output, websockets' `max_queue` 16). *Ping sender*: WebSocket pings as fast "
            "as it can, reading nothing, not even the pongs. *Maximal frames*: a long request, "
            "then 1 MiB frames, reading nothing. RSS growth is the peak over the window (sampled "
            "every 50 ms in the server); *most held* is the largest `held_bytes()` of one "
            "connection, both directions; a well-behaved client makes small requests meanwhile. "
            "`server.send_timeout_s` = 10 s.",
            "",
            table(r["rows"], r["seconds"]),
            "",
            f"The documented per-connection bound with the defaults is ≈ {total:.1f} MiB "
            "(docs/operations.md, *Memory per connection*; `memory_bound()`): "
            f"{bound['send'] / MIB:.1f} MiB on the send side, {bound['receive'] / MIB:.2f} MiB "
            "on the receive side. With 0.1.0's settings the ping flood grows the "
            "server without limit (its pongs are written without flow control) and slows every "
            "other client; with the defaults the server stops reading the attacker once "
            "256 KiB of output wait, and aborts it after the send timeout.",
        ]
    )


def table(results: dict[str, Any], seconds: float) -> str:
    lines = [
        f"| attacker ({seconds:.0f} s) / settings | server RSS growth | most held by the connection | aborted after | other client's TTFT p50 / p99 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        aborted = (
            "not within the window"
            if r["aborted_after_s"] is None
            else fmt(r["aborted_after_s"], 1, " s")
        )
        lines.append(
            f"| {name} | {fmt(r['rss_growth_mib'], 1, ' MiB')} | {fmt(r['max_held_mib'], 2, ' MiB')} "
            f"| {aborted} | {fmt(r['control_ttft_p50_ms'], 1)} / {fmt(r['control_ttft_p99_ms'], 1)} ms |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.adversaries")
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    figures = asyncio.run(main(args.seconds))
    print(table(figures, args.seconds))
    print(json.dumps(figures, indent=2))
