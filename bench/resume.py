"""Section 11 — resumable streams: what a detached request keeps, and how
fast a resume answers.

Two measurements, both against an in-process server on the fake backend (the
registry of detached requests is read directly, so the bytes are the
server's own accounting, :meth:`wsserver.aio.resume.Resumes.held_bytes`):

* **Bytes kept per detached request, worst case.** A client with a tiny
  receive buffer asks for an endless resumable answer at an unlimited token
  rate and reads nothing, so everything the server sent is unconfirmed; once
  the server's sends wait (the socket is full) the client's TCP connection is
  aborted. When the engine has paused on the full channel, the tail (wire
  bytes of the sent deltas kept) and the channel are read, against the stated
  bound :func:`wsserver.aio.peer.detached_bound`. Then the same with a
  client that reads (a Wi-Fi blip mid-answer at 200 tokens/s).
* **Reconnect → first replayed delta.** A client reads an answer at 200
  tokens/s, is aborted, and a new connection resumes it: the time from
  starting the new connection (TCP, handshake, ``hello``) to the first
  replayed ``delta``, and from sending ``resume`` to it. Side by side, in
  alternation: a new connection sending a fresh ``generate`` to its first
  delta — what the client would have paid without resuming, before even
  regenerating the text it had lost.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from websockets.asyncio.client import connect

from wsserver.aio import Server
from wsserver.aio.peer import PeerAwareConnection, detached_bound, resume_tail_bytes

from .figures import fmt
from .options import Options
from .servers import in_process
from .timing import now, summary
from .wsload import next_frame, send


def _fake(**overrides: Any) -> dict[str, Any]:
    return {"backend.kind": "fake", "limits.max_tokens": 10**6, **overrides}


async def _parked(server: Server) -> None:
    async with asyncio.timeout(30):
        await server.resumes.parked_event.wait()
    server.resumes.parked_event.clear()


def _generate(request_id: str, **extra: Any) -> dict[str, Any]:
    return {"type": "generate", "id": request_id, "prompt": "bench", "resumable": True, **extra}


async def _worst_case(server: Server, run: int, rcvbuf: int) -> dict[str, Any]:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    async with connect(
        server.url, sock=sock, max_queue=2 if rcvbuf else 16, compression=None
    ) as ws:
        await next_frame(ws, "hello")
        await send(ws, _generate(f"w{rcvbuf}-{run}", max_tokens=10**6))
        await next_frame(ws, "started")
        ws.transport.pause_reading()  # read nothing from now on
        (connection,) = server.connections.values()
        peer = connection.ws
        assert isinstance(peer, PeerAwareConnection)
        async with asyncio.timeout(30):
            await peer.writing_paused.wait()
        ws.transport.abort()
    await _parked(server)
    (generation,) = server.resumes.detached()
    await asyncio.to_thread(generation.channel.blocked.wait, 30)
    (record,) = [r for r in server.resumes._all() if r.parked is not None]
    assert record.parked is not None
    tail = record.parked.held_bytes()
    channel = generation.channel.buffered_bytes()
    held = server.resumes.held_bytes()
    generation.stop()
    server.resumes.discard(generation)
    return {"tail_bytes": tail, "channel_bytes": channel, "held_bytes": held}


async def _blip(server: Server, run: int) -> dict[str, Any]:
    async with connect(server.url, compression=None) as ws:
        await next_frame(ws, "hello")
        await send(ws, _generate(f"b{run}", max_tokens=10**6))
        await next_frame(ws, "started")
        for _ in range(10):
            await next_frame(ws, "delta")
        ws.transport.abort()
    await _parked(server)
    (generation,) = server.resumes.detached()
    await asyncio.to_thread(generation.channel.blocked.wait, 30)
    held = server.resumes.held_bytes()
    generation.stop()
    server.resumes.discard(generation)
    return {"held_bytes": held}


async def _resume_latency(server: Server, run: int) -> dict[str, float]:
    async with connect(server.url, compression=None) as ws:
        await next_frame(ws, "hello")
        await send(ws, _generate(f"r{run}", max_tokens=10**6))
        started = await next_frame(ws, "started")
        last = -1
        for _ in range(5):
            last = (await next_frame(ws, "delta"))["seq"]
        ws.transport.abort()
    await _parked(server)
    t0 = now()
    async with connect(server.url, compression=None) as ws:
        await next_frame(ws, "hello")
        t1 = now()
        # One behind what arrived, so that there is always a delta to replay.
        resume = {"type": "resume", "id": f"r{run}", "resume_token": started["resume_token"]}
        await send(ws, {**resume, "after_seq": last - 1})
        await next_frame(ws, "delta")
        t2 = now()
        await send(ws, {"type": "cancel", "id": f"r{run}"})
        await next_frame(ws, "done")
    t3 = now()
    async with connect(server.url, compression=None) as ws:
        await next_frame(ws, "hello")
        await send(ws, _generate(f"f{run}", max_tokens=10**6))
        await next_frame(ws, "delta")
        t4 = now()
        await send(ws, {"type": "cancel", "id": f"f{run}"})
        await next_frame(ws, "done")
    return {
        "connect_to_replay_ms": (t2 - t0) * 1e3,
        "resume_to_replay_ms": (t2 - t1) * 1e3,
        "connect_to_fresh_delta_ms": (t4 - t3) * 1e3,
    }


async def run(opts: Options) -> dict[str, Any]:
    runs = 3 if opts.quick else 8
    latency_runs = 5 if opts.quick else 30
    out: dict[str, Any] = {"status": "ok"}
    async with in_process(
        _fake(**{"backend.fake.tokens_per_s": 0.0, "stream.flush_ms": 30.0})
    ) as server:
        opts.log(f"  resume: worst case, {runs} runs each …")
        worst = {}
        # A small receive buffer, then the kernel's default (which a client
        # that reads nothing keeps at its initial size).
        for rcvbuf in (4096, 0):
            found = [await _worst_case(server, i, rcvbuf) for i in range(runs)]
            worst[str(rcvbuf)] = {
                "runs": len(found),
                "max_held_bytes": max(w["held_bytes"] for w in found),
                "max_tail_bytes": max(w["tail_bytes"] for w in found),
                "max_channel_bytes": max(w["channel_bytes"] for w in found),
            }
        config = server.config
    out["worst"] = {
        **worst,
        "max_held_bytes": max(w["max_held_bytes"] for w in worst.values()),
        "tail_budget_bytes": resume_tail_bytes(config),
        "bound_bytes": detached_bound(config),
    }
    async with in_process(_fake(**{"backend.fake.tokens_per_s": 200.0})) as server:
        opts.log(f"  resume: blips and reconnect latency, {latency_runs} runs …")
        blips = [await _blip(server, i) for i in range(runs)]
        latencies = [await _resume_latency(server, i) for i in range(latency_runs)]
    out["blip"] = {"max_held_bytes": max(b["held_bytes"] for b in blips), "runs": len(blips)}
    out["latency"] = {
        key: summary(lat[key] for lat in latencies)
        for key in ("connect_to_replay_ms", "resume_to_replay_ms", "connect_to_fresh_delta_ms")
    }
    w = out["worst"]
    opts.log(
        f"    worst held {w['max_held_bytes'] / 1024:.1f} KiB (bound {w['bound_bytes'] / 1024:.0f} KiB); "
        f"resume→replay median {out['latency']['resume_to_replay_ms']['median']:.2f} ms"
    )
    return out


def headlines(rs: dict[str, Any]) -> list[str]:
    worst, latency = rs["worst"], rs["latency"]["connect_to_replay_ms"]
    return [
        "| resumable streams (section 11) | a detached request held at most "
        f"{worst['max_held_bytes'] / 1024:.1f} KiB (bound {worst['bound_bytes'] / 1024:.0f} KiB); "
        f"new connection → first replayed delta {fmt(latency['median'], 2)} ms median |"
    ]


def render(r: dict[str, Any]) -> str:
    w, b, lat = r["worst"], r["blip"], r["latency"]
    bound = w["bound_bytes"] / 1024

    def worst(key: str, label: str) -> str:
        m = w[key]
        return (
            f"| {label} | {m['runs']} | {m['max_tail_bytes'] / 1024:.1f} "
            f"| {m['max_channel_bytes'] / 1024:.1f} | **{m['max_held_bytes'] / 1024:.1f}** | {bound:.0f} |"
        )

    def row(label: str, key: str) -> str:
        s = lat[key]
        return f"| {label} | {s['median']:.2f} | {s['p99']:.2f} | {s['max']:.2f} | {s['n']} |"

    return "\n".join(
        [
            "Measured on this shared 2-core machine (other work ran beside it: see the load "
            "averages above). "
            "In-process server, fake backend, default settings (`stream.queue_tokens` 64, "
            "`server.sndbuf` 16 KiB, `server.write_limit` 16 KiB, `server.max_output_bytes` 256 KiB). "
            "Bytes are the server's own accounting: the replay tail in wire bytes, the channel in "
            "UTF-8 bytes (`Resumes.held_bytes`).",
            "",
            "| detached request | runs | tail (KiB) | channel (KiB) | **held, max (KiB)** | stated bound (KiB) |",
            "|---|---:|---:|---:|---:|---:|",
            worst(
                "4096",
                "unlimited rate, the client read nothing (4 KiB SO_RCVBUF), socket full, TCP reset",
            ),
            worst("0", "the same with the kernel's default receive buffer"),
            f"| a blip: 200 tokens/s, the client read along, then TCP reset | {b['runs']} | | "
            f"| **{b['max_held_bytes'] / 1024:.1f}** | {bound:.0f} |",
            "",
            "What a detached request holds is what the server sent and the client never read (its "
            "receive buffers, the kernel's send queue, websockets' write buffer), capped by the "
            f"tail's budget ({w['tail_budget_bytes'] / 1024:.0f} KiB), plus its full channel; nothing "
            "more is produced while it waits — its engine is paused on the full channel. A client "
            "that lost more than the budget gets `seq_out_of_range`, never a gap.",
            "",
            "| 200 tokens/s, after a TCP reset | median (ms) | p99 (ms) | max (ms) | n |",
            "|---|---:|---:|---:|---:|",
            row(
                "new connection (TCP + handshake + `hello`) → first replayed delta",
                "connect_to_replay_ms",
            ),
            row("`resume` sent → first replayed delta", "resume_to_replay_ms"),
            row(
                "side by side: new connection → first delta of a fresh `generate`",
                "connect_to_fresh_delta_ms",
            ),
        ]
    )
