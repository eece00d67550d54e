"""Section 9's pairs: one request through wsserver's relay and the same straight from the upstream.

:mod:`bench.upstream` (against the lean upstream) and :mod:`bench.upstream_llama`
(against llama-server) both measure with these: the relay's configuration
overrides, one request through wsserver timed on ``perf_counter``, and
:func:`side_by_side`, which alternates the contenders and pairs their runs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from .common import LOAD_TEST_LIMITS, fmt
from .common import summary as stats
from .options import Options
from .sse_upstream import MODEL, SSEUpstream, direct_stream

#: No single request of the harness may take longer (seconds): a hang is a failure.
RUN_TIMEOUT = 120.0


def relay_overrides(url: str, parallel: int = 64, **extra: Any) -> dict[str, Any]:
    return {
        "backend.kind": "openai",
        "backend.openai.urls": [url],
        "backend.openai.model": MODEL if "model" not in extra else extra.pop("model"),
        "backend.openai.parallel": parallel,
        "backend.openai.max_waiting": 100000,
        "limits.max_tokens": 1_000_000,
        **LOAD_TEST_LIMITS,
        **extra,
    }


async def ws_stream(ws: Any, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request through wsserver: send, first delta, done. Times on perf_counter."""
    sent = time.perf_counter()
    await ws.send(orjson.dumps({"type": "generate", "id": request_id, **body}).decode())
    first = None
    while True:
        frame = orjson.loads(await ws.recv())
        if frame["type"] == "error":
            raise RuntimeError(f"wsserver refused the request: {frame}")
        if frame.get("id") != request_id:
            continue
        if frame["type"] == "delta" and first is None:
            first = time.perf_counter()
        elif frame["type"] == "done":
            return {
                "sent": sent,
                "first": first,
                "end": time.perf_counter(),
                "tokens": frame["usage"]["completion_tokens"],
                "reason": frame["reason"],
            }


def _measure(run: dict[str, Any]) -> tuple[float | None, float | None]:
    """(TTFT ms, tokens/s after the first) of one run."""
    first, end, tokens = run["first"], run["end"], run["tokens"]
    if first is None:
        return None, None
    ttft = (first - run["sent"]) * 1000
    tps = (tokens - 1) / (end - first) if tokens > 1 and end > first else None
    return ttft, tps


async def side_by_side(
    opts: Options,
    ws: Any,
    session: Any,
    url: str,
    body: dict[str, Any],
    reps: int,
    label: str,
    upstream: SSEUpstream | None = None,
    inproc_ws: Any | None = None,
) -> dict[str, Any]:
    """``reps`` rounds of (direct, wsserver[, in-process]), rotating which goes first.

    With an in-process ``upstream`` the request's way there is timed too
    (sent → the upstream has its head), which splits the added TTFT in two.
    ``inproc_ws``: a wsserver on the harness's own loop, with no process hop —
    what wsserver's code costs, apart from the scheduling of one more process.
    """
    names = ["direct", "wsserver"] + (["in-process"] if inproc_ws is not None else [])
    runs: dict[str, list[tuple[float | None, float | None]]] = {n: [] for n in names}
    way_in: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for who in names[rep % len(names) :] + names[: rep % len(names)]:
            async with asyncio.timeout(RUN_TIMEOUT):
                if who == "direct":
                    run = vars(await direct_stream(session, url, body))
                else:
                    request_id = f"{rep}-{time.perf_counter_ns()}"
                    run = await ws_stream(ws if who == "wsserver" else inproc_ws, request_id, body)
            runs[who].append(_measure(run))
            if upstream is not None:
                way_in[who].append((upstream.arrivals[-1] - run["sent"]) * 1000)
    direct = runs["direct"]
    row: dict[str, Any] = {
        "label": label,
        "reps": reps,
        "direct_ttft_ms": stats(d[0] for d in direct if d[0] is not None),
        "direct_tps": stats(d[1] for d in direct if d[1] is not None),
    }
    for who, key in (("wsserver", ""), ("in-process", "inproc_")):
        if who not in runs:
            continue
        relayed = runs[who]
        pairs = list(zip(direct, relayed, strict=True))
        row[f"{key}wsserver_ttft_ms"] = stats(r[0] for r in relayed if r[0] is not None)
        row[f"{key}ttft_delta_ms"] = stats(r[0] - d[0] for d, r in pairs if r[0] and d[0])
        row[f"{key}wsserver_tps"] = stats(r[1] for r in relayed if r[1] is not None)
        row[f"{key}tps_ratio"] = stats(r[1] / d[1] for d, r in pairs if r[1] and d[1])
    if upstream is not None:
        for who in names:
            row[f"{who.replace('-', '_')}_way_in_ms"] = stats(way_in[who])
    opts.log(
        f"    {label}: TTFT direct {fmt(row['direct_ttft_ms']['median'], 2)} ms, "
        f"wsserver {fmt(row['wsserver_ttft_ms']['median'], 2)} ms "
        f"(+{fmt(row['ttft_delta_ms']['median'], 2)}); throughput ratio {fmt(row['tps_ratio']['median'], 3)}"
        + (
            f"; in-process wsserver +{fmt(row['inproc_ttft_delta_ms']['median'], 2)} ms, "
            f"{fmt(row['inproc_tps_ratio']['median'], 3)}"
            if "inproc_ttft_delta_ms" in row
            else ""
        )
    )
    return row
