"""Section 9 — the openai backend: what wsserver costs in front of an engine.

    python -m bench --sections upstream     (needs scripts/llama-tools for llama-server)

wsserver (``backend.kind = "openai"``, in its own process, ``bench.probe_server``)
relays an upstream; the contender is a client that reads the same upstream's
server-sent events itself (:func:`bench.sse_upstream.direct_stream`). Side by
side, alternating which goes first, short runs — this machine is shared:

* **Added TTFT and throughput** against the lean upstream of
  :mod:`bench.sse_upstream` at high rates (1,000 tokens/s and unlimited) and
  against a real llama-server (:mod:`bench.upstream_llama`). TTFT is from
  sending the request to the first text; throughput is tokens over the time
  from the first text to the end.
* **Cancel → upstream disconnect**: from the client's ``cancel`` frame to the
  moment the upstream's read side sees its client leave (same process, same
  clock), against closing the SSE response directly.
* **The next request's wait after a Stop mid-prefill** (llama-server only):
  see :mod:`bench.upstream_llama`.
* **The relay ceiling per core**: N streams at 50 tokens/s each from an
  upstream in a process of its own, for N rising until the wsserver process's
  event-loop lag p99 passes 20 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import aiohttp
import orjson
import psutil

from wsserver.aio import Server
from wsserver.config import load_config

from . import upstream_llama
from .common import PYTHON, ROOT, ServerProcess, Skip, die_with_parent, fmt
from .common import summary as stats
from .options import Options
from .sse_upstream import SSEUpstream, direct_stream
from .upstream_pairs import RUN_TIMEOUT, relay_overrides, side_by_side
from .upstream_report import render, summary_lines
from .wsload import close_many, generate_frame, open_connection, open_many

__all__ = ["render", "run", "summary_lines"]

#: The relay ceiling's per-stream rate and its limit on the loop's lag.
CEILING_RATE = 50.0
LAG_LIMIT_MS = 20.0


async def _overhead(opts: Options) -> list[dict[str, Any]]:
    rows = []
    reps = 6 if opts.quick else 30
    for rate, tokens in ((1000.0, 40 if opts.quick else 300), (0.0, 200 if opts.quick else 3000)):
        upstream = await SSEUpstream(rate).start()
        server = await ServerProcess(relay_overrides(upstream.url), name="wsserver-openai").start()
        values = {"server.host": "127.0.0.1", "server.port": 0, **relay_overrides(upstream.url)}
        inproc = Server(load_config(env={}, overrides=values).config)
        await inproc.start()
        try:
            await inproc.wait_ready()
            ws = await open_connection(server.url)
            inproc_ws = await open_connection(inproc.url)
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "bench", "max_tokens": tokens, "temperature": 0}
                label = f"{rate:g} tokens/s" if rate else "unlimited"
                args = (opts, ws, session, upstream.url, body)
                # One unmeasured round warms every path (connections, imports).
                await side_by_side(*args, 3, "warm-up", upstream, inproc_ws)
                row = await side_by_side(*args, reps, label, upstream, inproc_ws)
                row.update(upstream="lean SSE upstream", rate=rate, tokens=tokens)
                rows.append(row)
            await ws.close()
            await inproc_ws.close()
        finally:
            await server.stop()
            await inproc.stop(grace=0)
            await upstream.stop()
    return rows


async def _cancel_once(
    ws: Any,
    session: Any,
    upstream: SSEUpstream,
    request_id: str,
    via: list[float],
    via_done: list[float],
    direct: list[float],
) -> None:
    upstream.left.clear()
    await ws.send(generate_frame(request_id, "cancel me", 100000).decode())
    while orjson.loads(await ws.recv())["type"] != "delta":
        pass
    sent = time.perf_counter()
    await ws.send(json.dumps({"type": "cancel", "id": request_id}))
    while True:
        frame = orjson.loads(await ws.recv())
        if frame["type"] == "done" and frame["id"] == request_id:
            via_done.append((time.perf_counter() - sent) * 1000)
            break
    await upstream.left.wait()
    via.append((upstream.disconnects[-1] - sent) * 1000)
    # The same Stop by a client that reads the SSE itself: it closes the response.
    upstream.left.clear()
    run = await direct_stream(
        session, upstream.url, {"prompt": "x", "max_tokens": 100000}, stop_after=0.05
    )
    await upstream.left.wait()
    assert run.end is not None
    direct.append((upstream.disconnects[-1] - run.end) * 1000)


async def _cancel(opts: Options) -> dict[str, Any]:
    """Cancel → the upstream sees its client leave: via wsserver, and closing directly."""
    reps = 5 if opts.quick else 40
    upstream = await SSEUpstream(200.0).start()
    server = await ServerProcess(relay_overrides(upstream.url), name="wsserver-openai").start()
    via, via_done, direct = [], [], []
    try:
        ws = await open_connection(server.url)
        async with aiohttp.ClientSession() as session:
            for rep in range(reps):
                async with asyncio.timeout(RUN_TIMEOUT):
                    await _cancel_once(ws, session, upstream, f"c{rep}", via, via_done, direct)
        await ws.close()
    finally:
        await server.stop()
        await upstream.stop()
    out = {
        "reps": reps,
        "wsserver_disconnect_ms": stats(via),
        "wsserver_done_ms": stats(via_done),
        "direct_disconnect_ms": stats(direct),
    }
    opts.log(
        f"    cancel → upstream disconnect: wsserver {fmt(out['wsserver_disconnect_ms']['median'], 2)} ms "
        f"(done {fmt(out['wsserver_done_ms']['median'], 2)} ms), direct close "
        f"{fmt(out['direct_disconnect_ms']['median'], 2)} ms"
    )
    return out


async def _upstream_process(rate: float) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        PYTHON,
        "-m",
        "bench.sse_upstream",
        str(rate),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
        preexec_fn=die_with_parent,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    return proc, json.loads(line)["url"]


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


async def _reader(ws: Any, counts: list[int], index: int) -> None:
    with contextlib.suppress(Exception):
        while True:
            frame = orjson.loads(await ws.recv())
            if frame["type"] == "delta":
                counts[index] += 1


async def _ceiling(opts: Options) -> list[dict[str, Any]]:
    levels = [10, 40] if opts.quick else [25, 50, 100, 200, 300, 400, 600]
    duration = 1.0 if opts.quick else 5.0
    proc, url = await _upstream_process(CEILING_RATE)
    assert proc.pid is not None
    server = await ServerProcess(relay_overrides(url, parallel=4096), name="wsserver-relay").start()
    rows: list[dict[str, Any]] = []
    try:
        for level in levels:
            conns = await open_many(server.url, level)
            counts = [0] * level
            readers = []
            try:
                for i, ws in enumerate(conns):
                    await ws.send(generate_frame(f"s{i}", "relay", 1_000_000).decode())
                readers = [
                    asyncio.create_task(_reader(ws, counts, i)) for i, ws in enumerate(conns)
                ]
                # Measure once every stream runs.
                async with asyncio.timeout(60):
                    while min(counts) == 0:
                        await asyncio.sleep(0.05)  # sleep-ok: the harness polls its own counters
                await server.stats(reset=True)
                cpu0, up0, client0 = _cpu(server.pid), _cpu(proc.pid), time.process_time()
                frames0, t0 = sum(counts), time.perf_counter()
                await asyncio.sleep(duration)  # sleep-ok: the measurement window
                elapsed = time.perf_counter() - t0
                frames = sum(counts) - frames0
                st = await server.stats(reset=True)
                row = {
                    "streams": level,
                    "elapsed_s": elapsed,
                    "delta_frames_per_s": frames / elapsed,
                    "lag_p50_ms": st["lag_ms"]["p50"],
                    "lag_p99_ms": st["lag_ms"]["p99"],
                    "lag_max_ms": st["lag_ms"]["max"],
                    "server_cores": (_cpu(server.pid) - cpu0) / elapsed,
                    "upstream_cores": (_cpu(proc.pid) - up0) / elapsed,
                    "client_cores": (time.process_time() - client0) / elapsed,
                }
                rows.append(row)
                opts.log(
                    f"    relay ceiling: {level} streams at {CEILING_RATE:g} tokens/s: lag p50/p99 "
                    f"{fmt(row['lag_p50_ms'], 2)}/{fmt(row['lag_p99_ms'], 2)} ms, wsserver "
                    f"{fmt(row['server_cores'], 2)} cores, upstream {fmt(row['upstream_cores'], 2)}, "
                    f"client {fmt(row['client_cores'], 2)}"
                )
            finally:
                for task in readers:
                    task.cancel()
                await close_many(conns)
            if (row["lag_p99_ms"] or 0) > LAG_LIMIT_MS:
                break
    finally:
        await server.stop()
        assert proc.stdin is not None
        proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return rows


def ceiling_streams(rows: list[dict[str, Any]]) -> int | None:
    """The most streams measured with the loop's lag p99 within the limit."""
    ok = [r["streams"] for r in rows if (r["lag_p99_ms"] or 0) <= LAG_LIMIT_MS]
    return max(ok) if ok else None


async def run(opts: Options) -> dict[str, Any]:
    opts.log("  relay overhead against the lean upstream …")
    overhead = await _overhead(opts)
    opts.log("  cancel → upstream disconnect …")
    cancel = await _cancel(opts)
    opts.log("  relay ceiling …")
    ceiling = await _ceiling(opts)
    try:
        llama: dict[str, Any] = await upstream_llama.run(opts)
    except Skip as exc:
        llama = {"status": "skipped", "reason": str(exc)}
    rows = overhead + (llama.get("rows", []) if llama.get("status") == "ok" else [])
    targets = []
    for row in rows:
        delta, ratio = row["ttft_delta_ms"]["median"], row["tps_ratio"]["median"]
        targets.append(
            {
                "name": f"openai relay, {row['upstream']} at {row['label']}: added TTFT ≤ +3 ms",
                "value": delta,
                "shown": f"{delta:+.2f} ms" if delta is not None else "-",
                "met": None if delta is None else bool(delta <= 3.0),
            }
        )
        targets.append(
            {
                "name": f"openai relay, {row['upstream']} at {row['label']}: throughput ≥ 0.98x",
                "value": ratio,
                "shown": f"{ratio:.3f}x" if ratio is not None else "-",
                "met": None if ratio is None else bool(ratio >= 0.98),
            }
        )
    return {
        "status": "ok",
        "params": {"ceiling_rate": CEILING_RATE, "lag_limit_ms": LAG_LIMIT_MS},
        "overhead": overhead,
        "cancel": cancel,
        "ceiling": ceiling,
        "ceiling_streams": ceiling_streams(ceiling),
        "llama": llama,
        "targets": targets,
    }
