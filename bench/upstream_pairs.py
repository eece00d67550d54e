"""Section 9's pairs: one request through wsserver's relay and the same straight from the upstream.

:mod:`bench.upstream` (against the lean upstream) and :mod:`bench.upstream_llama`
(against llama-server) both measure with these: the relay's configuration
overrides and :func:`relay_rounds`, which alternates the contenders and pairs
their runs.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

from .figures import fmt
from .options import Options
from .servers import LOAD_TEST_LIMITS
from .sse_upstream import MODEL, SSEUpstream, direct_stream
from .timing import Stream, pair_deltas, pair_ratios, side_by_side, summary
from .wsload import timed

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


async def relay_rounds(
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

    TTFT: request sent → first text; throughput: tokens after the first over
    the time from the first text to the end. With an in-process ``upstream``
    the request's way there is timed too (sent → the upstream has its head),
    which splits the added TTFT in two. ``inproc_ws``: a wsserver on the
    harness's own loop, with no process hop — what wsserver's code costs,
    apart from the scheduling of one more process.
    """
    sockets = {"wsserver": ws, "in-process": inproc_ws}

    async def once(who: str, rep: int) -> tuple[Stream, float | None]:
        async with asyncio.timeout(RUN_TIMEOUT):
            if who == "direct":
                run = await direct_stream(session, url, body)
            else:
                frame = {"type": "generate", "id": f"{rep}-{time.perf_counter_ns()}", **body}
                run = await timed(sockets[who], frame)
        way_in = None if upstream is None else (upstream.arrivals[-1] - run.sent) * 1000
        return run, way_in

    names = ["direct", "wsserver"] + (["in-process"] if inproc_ws is not None else [])
    runs = await side_by_side(reps, {n: functools.partial(once, n) for n in names})
    ttft = {n: [r.ttft_ms for r, _ in got] for n, got in runs.items()}
    tps = {n: [r.decode_tps(to_end=True) for r, _ in got] for n, got in runs.items()}
    row: dict[str, Any] = {
        "label": label,
        "reps": reps,
        "direct_ttft_ms": summary(ttft["direct"]),
        "direct_tps": summary(tps["direct"]),
    }
    for who, key in (("wsserver", ""), ("in-process", "inproc_")):
        if who in runs:
            row[f"{key}wsserver_ttft_ms"] = summary(ttft[who])
            row[f"{key}ttft_delta_ms"] = summary(pair_deltas(ttft[who], ttft["direct"]))
            row[f"{key}wsserver_tps"] = summary(tps[who])
            row[f"{key}tps_ratio"] = summary(pair_ratios(tps[who], tps["direct"]))
    if upstream is not None:
        for who, got in runs.items():
            row[f"{who.replace('-', '_')}_way_in_ms"] = summary(w for _, w in got)
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
