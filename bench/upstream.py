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
import time
from typing import Any

import aiohttp
import orjson

from . import upstream_llama
from .common import Skip
from .figures import fmt, target
from .options import Options
from .servers import ServerProcess, in_process, sse_upstream
from .sse_upstream import SSEUpstream, direct_stream
from .timing import cpu_seconds, now, summary
from .upstream_pairs import RUN_TIMEOUT, relay_overrides, relay_rounds
from .upstream_report import headlines, render
from .wsload import cancel, close_many, generate_frame, next_frame, open_connection, open_many, send

__all__ = ["headlines", "render", "run", "targets"]

#: The relay ceiling's per-stream rate and its limit on the loop's lag.
CEILING_RATE = 50.0
LAG_LIMIT_MS = 20.0


async def _overhead(opts: Options) -> list[dict[str, Any]]:
    rows = []
    reps = 6 if opts.quick else 30
    for rate, tokens in ((1000.0, 40 if opts.quick else 300), (0.0, 200 if opts.quick else 3000)):
        async with (
            SSEUpstream(rate) as upstream,
            ServerProcess(relay_overrides(upstream.url), name="wsserver-openai") as server,
            in_process(relay_overrides(upstream.url)) as inproc,
            aiohttp.ClientSession() as session,
        ):
            ws = await open_connection(server.url)
            inproc_ws = await open_connection(inproc.url)
            body = {"prompt": "bench", "max_tokens": tokens, "temperature": 0}
            label = f"{rate:g} tokens/s" if rate else "unlimited"
            args = (opts, ws, session, upstream.url, body)
            # One unmeasured round warms every path (connections, imports).
            await relay_rounds(*args, 3, "warm-up", upstream, inproc_ws)
            row = await relay_rounds(*args, reps, label, upstream, inproc_ws)
            row.update(upstream="lean SSE upstream", rate=rate, tokens=tokens)
            rows.append(row)
            await ws.close()
            await inproc_ws.close()
    return rows


async def _cancel_once(
    ws: Any, session: Any, upstream: SSEUpstream, request_id: str
) -> tuple[float, float, float]:
    """Cancel → the upstream sees its client leave: via wsserver (and the
    client's ``done``), and a client closing the SSE response itself; in ms."""
    upstream.left.clear()
    await send(ws, generate_frame(request_id, "cancel me", 100000))
    await next_frame(ws, "delta")
    sent = now()
    await cancel(ws, request_id)
    done = (now() - sent) * 1000
    await upstream.left.wait()
    via = (upstream.disconnects[-1] - sent) * 1000
    # The same Stop by a client that reads the SSE itself: it closes the response.
    upstream.left.clear()
    run = await direct_stream(
        session, upstream.url, {"prompt": "x", "max_tokens": 100000}, stop_after=0.05
    )
    await upstream.left.wait()
    assert run.end is not None
    return via, done, (upstream.disconnects[-1] - run.end) * 1000


async def _cancel(opts: Options) -> dict[str, Any]:
    reps = 5 if opts.quick else 40
    found: list[tuple[float, float, float]] = []
    async with (
        SSEUpstream(200.0) as upstream,
        ServerProcess(relay_overrides(upstream.url), name="wsserver-openai") as server,
        aiohttp.ClientSession() as session,
    ):
        ws = await open_connection(server.url)
        for rep in range(reps):
            async with asyncio.timeout(RUN_TIMEOUT):
                found.append(await _cancel_once(ws, session, upstream, f"c{rep}"))
        await ws.close()
    out: dict[str, Any] = {
        "reps": reps,
        "wsserver_disconnect_ms": summary(f[0] for f in found),
        "wsserver_done_ms": summary(f[1] for f in found),
        "direct_disconnect_ms": summary(f[2] for f in found),
    }
    opts.log(
        f"    cancel → upstream disconnect: wsserver {fmt(out['wsserver_disconnect_ms']['median'], 2)} ms "
        f"(done {fmt(out['wsserver_done_ms']['median'], 2)} ms), direct close "
        f"{fmt(out['direct_disconnect_ms']['median'], 2)} ms"
    )
    return out


async def _reader(ws: Any, counts: list[int], index: int) -> None:
    with contextlib.suppress(Exception):
        while True:
            frame = orjson.loads(await ws.recv())
            if frame["type"] == "delta":
                counts[index] += 1


async def _level(
    server: ServerProcess, upstream_pid: int, level: int, duration: float
) -> dict[str, Any]:
    """``level`` endless streams, measured for ``duration`` once every one runs."""
    conns = await open_many(server.url, level)
    counts = [0] * level
    readers = []
    try:
        for i, ws in enumerate(conns):
            await send(ws, generate_frame(f"s{i}", "relay", 1_000_000))
        readers = [asyncio.create_task(_reader(ws, counts, i)) for i, ws in enumerate(conns)]
        async with asyncio.timeout(60):
            while min(counts) == 0:
                await asyncio.sleep(0.05)  # sleep-ok: the harness polls its own counters
        await server.stats(reset=True)
        cpu0, up0, client0 = cpu_seconds(server.pid), cpu_seconds(upstream_pid), time.process_time()
        frames0, t0 = sum(counts), now()
        await asyncio.sleep(duration)  # sleep-ok: the measurement window
        elapsed = now() - t0
        frames = sum(counts) - frames0
        st = await server.stats(reset=True)
        return {
            "streams": level,
            "elapsed_s": elapsed,
            "delta_frames_per_s": frames / elapsed,
            "lag_p50_ms": st["lag_ms"]["p50"],
            "lag_p99_ms": st["lag_ms"]["p99"],
            "lag_max_ms": st["lag_ms"]["max"],
            "server_cores": (cpu_seconds(server.pid) - cpu0) / elapsed,
            "upstream_cores": (cpu_seconds(upstream_pid) - up0) / elapsed,
            "client_cores": (time.process_time() - client0) / elapsed,
        }
    finally:
        for task in readers:
            task.cancel()
        await close_many(conns)


async def _ceiling(opts: Options) -> list[dict[str, Any]]:
    levels = [10, 40] if opts.quick else [25, 50, 100, 200, 300, 400, 600]
    duration = 1.0 if opts.quick else 5.0
    rows: list[dict[str, Any]] = []
    async with sse_upstream(CEILING_RATE) as upstream:
        overrides = relay_overrides(upstream.url + "/v1", parallel=4096)
        async with ServerProcess(overrides, name="wsserver-relay") as server:
            for level in levels:
                row = await _level(server, upstream.pid, level, duration)
                rows.append(row)
                opts.log(
                    f"    relay ceiling: {level} streams at {CEILING_RATE:g} tokens/s: lag p50/p99 "
                    f"{fmt(row['lag_p50_ms'], 2)}/{fmt(row['lag_p99_ms'], 2)} ms, wsserver "
                    f"{fmt(row['server_cores'], 2)} cores, upstream {fmt(row['upstream_cores'], 2)}, "
                    f"client {fmt(row['client_cores'], 2)}"
                )
                if (row["lag_p99_ms"] or 0) > LAG_LIMIT_MS:
                    break
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
        name = f"openai relay, {row['upstream']} at {row['label']}"
        delta, ratio = row["ttft_delta_ms"]["median"], row["tps_ratio"]["median"]
        targets += [
            target(f"{name}: added TTFT ≤ +3 ms", delta, lambda v: v <= 3.0, "{:+.2f} ms"),
            target(f"{name}: throughput ≥ 0.98x", ratio, lambda v: v >= 0.98, "{:.3f}x"),
        ]
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


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result["targets"])
