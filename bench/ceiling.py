"""Section 3 — the server's ceiling with the fake backend at unlimited rate.

For 1, 8, 64 and 256 concurrent connections, each streaming back-to-back
requests as fast as the server delivers: delivered tokens/s and delta
frames/s in total, the server's event-loop lag (probe inside the server
process), and server CPU seconds per 1,000 tokens (psutil on its pid). Two
servers run side by side: coalescing on (default flush settings) and one frame
per token (``stream.flush_tokens = 1``, ``stream.flush_ms = 0``); each level
runs on both, alternately, so drift on this noisy machine hits both alike.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .common import raise_nofile
from .figures import fmt, save_plot
from .options import Options
from .servers import LOAD_TEST_LIMITS, ServerProcess, running
from .timing import cpu_seconds, now
from .wsload import Tally, close_many, open_many, stream_until

MODES = {
    "coalesced": {},
    "per-token": {"stream.flush_tokens": 1, "stream.flush_ms": 0.0},
}


async def _level(
    server: ServerProcess, concurrency: int, duration: float, max_tokens: int
) -> dict[str, Any]:
    conns = await open_many(server.url, concurrency)
    try:
        await server.stats(reset=True)
        cpu0, client0, t0 = cpu_seconds(server.pid), time.process_time(), now()
        tallies = await asyncio.gather(
            *(stream_until(ws, f"c{i}", t0 + duration, max_tokens) for i, ws in enumerate(conns))
        )
        t1 = now()
        cpu1, client1 = cpu_seconds(server.pid), time.process_time()
        stats = await server.stats(reset=True)
    finally:
        await close_many(conns)
    total = Tally()
    for tally in tallies:
        total.add(tally)
    elapsed = t1 - t0
    server_cpu = cpu1 - cpu0
    return {
        "concurrency": concurrency,
        "elapsed_s": elapsed,
        "requests": total.requests,
        "tokens": total.tokens,
        "delta_frames": total.delta_frames,
        "tokens_per_s": total.tokens / elapsed,
        "frames_per_s": total.delta_frames / elapsed,
        "tokens_per_frame": total.tokens / total.delta_frames if total.delta_frames else None,
        "lag_p50_ms": stats["lag_ms"]["p50"],
        "lag_p99_ms": stats["lag_ms"]["p99"],
        "lag_max_ms": stats["lag_ms"]["max"],
        "server_cpu_s": server_cpu,
        "server_cores": server_cpu / elapsed,
        "cpu_s_per_1k_tokens": server_cpu / total.tokens * 1000 if total.tokens else None,
        "client_cores": (client1 - client0) / elapsed,
        "tcp_nodelay": stats.get("tcp_nodelay"),
        "errors": total.errors[:5],
    }


#: A fast real model's rate, for the paced comparison of the two modes.
PACED_TOKENS_PER_S = 50


async def _sweep(
    opts: Options, rate: float, levels: list[int], duration: float, max_tokens: int
) -> list[dict[str, Any]]:
    """Every level on both modes (alternating), fake backend at ``rate`` (0 = unlimited)."""
    rows: list[dict[str, Any]] = []
    label = "unlimited" if not rate else f"{rate:g} tokens/s per connection"
    settings = {"backend.kind": "fake", "backend.fake.tokens_per_s": rate, **LOAD_TEST_LIMITS}
    modes = {
        mode: ServerProcess({**settings, **extra}, name=f"wsserver-fake-{mode}")
        for mode, extra in MODES.items()
    }
    async with running(modes) as servers:
        for concurrency in levels:
            for mode, server in servers.items():
                opts.log(f"  ceiling ({label}): {concurrency} connection(s), {mode} …")
                row = await _level(server, concurrency, duration, max_tokens)
                row["mode"] = mode
                row["rate"] = rate
                rows.append(row)
                opts.log(
                    f"    {row['tokens_per_s']:,.0f} tok/s, {row['frames_per_s']:,.0f} frames/s, "
                    f"lag p50/p99 {fmt(row['lag_p50_ms'])}/{fmt(row['lag_p99_ms'])} ms, "
                    f"{fmt(row['cpu_s_per_1k_tokens'], 3)} CPU s/1k tokens"
                )
    return rows


async def run(opts: Options) -> dict[str, Any]:
    raise_nofile()
    levels = [1, 8, 64, 256]
    duration = 0.3 if opts.quick else 5.0
    max_tokens = 200
    rows = await _sweep(opts, 0, levels, duration, max_tokens)
    # The same two modes at a real model's rate, where they do differ: one
    # frame per token against one per flush window.
    paced_levels = [8] if opts.quick else [8, 64, 256]
    paced_tokens = 10 if opts.quick else 100
    paced = await _sweep(opts, PACED_TOKENS_PER_S, paced_levels, duration, paced_tokens)
    return {
        "status": "ok",
        "params": {
            "levels": levels,
            "duration_s": duration,
            "max_tokens_per_request": max_tokens,
            "modes": {k: v or "defaults (flush_ms=30, flush_tokens=5)" for k, v in MODES.items()},
            "paced_tokens_per_s": PACED_TOKENS_PER_S,
            "paced_levels": paced_levels,
            "paced_max_tokens": paced_tokens,
        },
        "rows": rows,
        "paced": paced,
    }


def headlines(ce: dict[str, Any]) -> list[str]:
    best = max(ce["rows"], key=lambda r: r["tokens_per_s"])
    return [
        f"| server ceiling (fake backend) | {fmt(best['tokens_per_s'], 0)} tokens/s, "
        f"{fmt(best['frames_per_s'], 0)} frames/s at {best['concurrency']} connections ({best['mode']}); "
        f"{fmt(best['cpu_s_per_1k_tokens'], 4)} CPU s per 1k tokens |"
    ]


def problems(ce: dict[str, Any]) -> list[str]:
    if not ce.get("paced"):
        return []
    base = [x["cpu_s_per_1k_tokens"] for x in ce["rows"] if x["cpu_s_per_1k_tokens"]]
    paced = [x["cpu_s_per_1k_tokens"] for x in ce["paced"] if x["cpu_s_per_1k_tokens"]]
    # Above 1 CPU s per 1,000 tokens a stream at 50 tokens/s costs over 5 % of a core.
    if not (base and paced and max(paced) > 1.0):
        return []
    return [
        f"CPU per token at a real model's rate (section 3): up to {max(paced):.2f} CPU s per "
        f"1,000 tokens at 50 tokens/s per connection, {max(paced) / min(base):.0f}x the cost at "
        "unlimited rate."
    ]


def render(result: dict[str, Any]) -> str:
    p = result["params"]
    lines = [
        f"Fake backend at unlimited rate; each connection sends back-to-back requests of "
        f"{p['max_tokens_per_request']} tokens for {p['duration_s']:g} s. Server in its own process; "
        "loop lag from a 10 ms sleep probe inside it; CPU from psutil on its pid. "
        "`client cores` is the load client's own CPU use (near 1.0 would mean the client, not the server, "
        "was the limit).",
        "",
        "| connections | mode | tokens/s | delta frames/s | tokens/frame | loop lag p50 / p99 (ms) "
        "| server CPU s / 1k tokens | server cores | client cores |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['concurrency']} | {r['mode']} | {fmt(r['tokens_per_s'], 0)} | {fmt(r['frames_per_s'], 0)} "
            f"| {fmt(r['tokens_per_frame'], 1)} | {fmt(r['lag_p50_ms'], 2)} / {fmt(r['lag_p99_ms'], 2)} "
            f"| {fmt(r['cpu_s_per_1k_tokens'], 4)} | {fmt(r['server_cores'], 2)} | {fmt(r['client_cores'], 2)} |"
        )
    paced = result.get("paced") or []
    if paced:
        lines += [
            "",
            f"**The two modes at a real model's rate.** The fake backend at {p['paced_tokens_per_s']} "
            f"tokens/s per connection (a fast local model), requests of {p['paced_max_tokens']} tokens:",
            "",
            "| connections | mode | tokens/s | delta frames/s | tokens/frame | loop lag p50 / p99 (ms) "
            "| server CPU s / 1k tokens | server cores |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in paced:
            lines.append(
                f"| {r['concurrency']} | {r['mode']} | {fmt(r['tokens_per_s'], 0)} "
                f"| {fmt(r['frames_per_s'], 0)} | {fmt(r['tokens_per_frame'], 1)} "
                f"| {fmt(r['lag_p50_ms'], 2)} / {fmt(r['lag_p99_ms'], 2)} "
                f"| {fmt(r['cpu_s_per_1k_tokens'], 4)} | {fmt(r['server_cores'], 2)} |"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], plt: Any, out_dir: Any) -> list[str]:
    rows = result["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for mode in MODES:
        sel = [r for r in rows if r["mode"] == mode]
        x = [r["concurrency"] for r in sel]
        axes[0].plot(x, [r["tokens_per_s"] for r in sel], marker="o", label=mode)
        axes[1].plot(x, [r["frames_per_s"] for r in sel], marker="o", label=mode)
        axes[2].plot(x, [r["lag_p99_ms"] for r in sel], marker="o", label=f"{mode} p99")
        axes[2].plot(
            x, [r["lag_p50_ms"] for r in sel], marker=".", linestyle="--", label=f"{mode} p50"
        )
    for ax, title in zip(
        axes, ("delivered tokens/s", "delta frames/s", "event-loop lag (ms)"), strict=True
    ):
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent connections")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Server ceiling, fake backend at unlimited rate")
    return save_plot(fig, plt, out_dir, "ceiling.png")


def notes(r: dict[str, Any]) -> list[str]:
    rows = r.get("rows", [])
    notes = []
    per_frame = [x for x in rows if x["mode"] == "per-token"]
    if per_frame and all((x["tokens_per_frame"] or 0) > 2 for x in per_frame):
        notes.append(
            "With `flush_tokens = 1, flush_ms = 0` frames still carry many tokens at unlimited rate: the sender "
            "merges whatever already waits in the channel into one frame (a producer at unlimited rate fills "
            "the 64-token channel while one frame is sent). So the two modes differ little here; at a model's "
            "real rate (tens of tokens/s) the per-token setting sends one frame per token."
        )
    paced = r.get("paced") or []
    unlimited_cost = [x["cpu_s_per_1k_tokens"] for x in rows if x["cpu_s_per_1k_tokens"]]
    paced_cost = [x["cpu_s_per_1k_tokens"] for x in paced if x["cpu_s_per_1k_tokens"]]
    if unlimited_cost and paced_cost:
        base, slow = min(unlimited_cost), max(paced_cost)
        per_stream = slow * r["params"]["paced_tokens_per_s"] / 1000 * 100
        notes.append(
            f"**CPU per token at a real model's rate.** Paced at "
            f"{r['params']['paced_tokens_per_s']} tokens/s per connection the server spends up to "
            f"{slow:.3f} CPU s per 1,000 tokens ({per_stream:.1f} % of one core per stream), "
            f"{slow / base:.0f}x its cost at unlimited rate, where one frame and one wake-up of the "
            "event loop carry many tokens. At a real rate each token wakes the loop on its own: janus "
            "hands it over with a cross-thread call and a task, then the sender waits for the flush "
            "window. What would lower it: a channel that wakes the loop once per flush window rather "
            "than once per token. (An earlier version also spun while part of a character was held "
            "back; that was fixed in `Connection._pump` and this figure is after the fix.)"
        )
    hot = [x for x in rows if (x["lag_p99_ms"] or 0) > 50]
    if hot:
        notes.append(
            f"Loop lag grows past 50 ms from {min(x['concurrency'] for x in hot)} connections: the server "
            "process is at one core (Python's GIL), shared by the event loop and every producer thread, "
            "each producing as fast as it can. A real model produces tens of tokens/s per connection, far "
            "below this ceiling."
        )
    return notes
