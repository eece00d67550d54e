"""Section 9's text: the tables and prose of docs/benchmarks.md (see :mod:`bench.upstream`)."""

from __future__ import annotations

from typing import Any

from .figures import fmt, paragraphs


def _overhead_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| upstream | rate, tokens | TTFT direct / via wsserver (median ms) | added TTFT (median, p99 of pairs) "
        "| tokens/s direct / via wsserver | throughput ratio (median of pairs) | pairs |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['upstream']} | {r['label']}, {r['tokens']} | {fmt(r['direct_ttft_ms']['median'], 2)} / "
            f"{fmt(r['wsserver_ttft_ms']['median'], 2)} | {fmt(r['ttft_delta_ms']['median'], 2, ' ms')}, "
            f"{fmt(r['ttft_delta_ms']['p99'], 2, ' ms')} | {fmt(r['direct_tps']['median'], 0)} / "
            f"{fmt(r['wsserver_tps']['median'], 0)} | **{fmt(r['tps_ratio']['median'], 3)}x** | {r['reps']} |"
        )
    inproc = [r for r in rows if "inproc_ttft_delta_ms" in r]
    if inproc:
        lines += [
            "",
            "**The same wsserver without the process hop** — a third contender, a wsserver on the "
            "harness's own event loop, in the same rotation. What it adds is what wsserver's code "
            "costs; the rest of the row above is one more process to wake and schedule on each way, "
            "which on this loaded 2-core machine is most of it (the way in: request sent until the "
            "upstream has its head, noted by the upstream; medians, ms). At the unlimited rate the "
            "in-process contender shares one loop and one core with the upstream and the client, so "
            "its throughput there says nothing about wsserver:",
            "",
            "| rate | added TTFT: own process / in-process | throughput ratio: own process / in-process "
            "| way in: direct / own process / in-process |",
            "|---|---:|---:|---:|",
        ]
        for r in inproc:
            lines.append(
                f"| {r['label']} | {fmt(r['ttft_delta_ms']['median'], 2)} / "
                f"{fmt(r['inproc_ttft_delta_ms']['median'], 2)} | {fmt(r['tps_ratio']['median'], 3)}x / "
                f"{fmt(r['inproc_tps_ratio']['median'], 3)}x | {fmt(r['direct_way_in_ms']['median'], 2)} / "
                f"{fmt(r['wsserver_way_in_ms']['median'], 2)} / {fmt(r['in_process_way_in_ms']['median'], 2)} |"
            )
    return lines


def _overhead_notes(rows: list[dict[str, Any]]) -> list[str]:
    notes = []
    fast = [r for r in rows if r.get("rate") == 0.0 and (r["tps_ratio"]["median"] or 0) > 1.02]
    if fast:
        notes.append(
            "At the unlimited rate the ratio above 1 measures the clients, not the relay: the direct "
            "client parses one JSON event per token in Python, while wsserver's client receives one "
            "frame per 30 ms flush window holding many tokens, so it is the faster reader. Paced "
            "rows (a real engine's rates) are the comparison that matters."
        )
    slow = [
        r
        for r in rows
        if (r["ttft_delta_ms"]["median"] or 0) > 3.0
        and (r.get("inproc_ttft_delta_ms", {}).get("median") or 99) <= 3.0
    ]
    if slow:
        notes.append(
            "Where the added TTFT misses +3 ms while the in-process wsserver meets it, the difference "
            "is the second process: each way the request or its first token waits for the wsserver "
            "process to be woken and given a core, which on this loaded 2-core machine (see the load "
            "averages) costs milliseconds. Not measured here: the same on a machine with a core to "
            "spare."
        )
    return paragraphs(notes)


def render(result: dict[str, Any]) -> str:
    p = result["params"]
    c = result["cancel"]
    llama = result["llama"]
    rows = result["overhead"] + (llama.get("rows", []) if llama.get("status") == "ok" else [])
    lines = [
        'wsserver with `backend.kind = "openai"` in its own process, against a client that POSTs the '
        "same request and reads the upstream's server-sent events itself (aiohttp, JSON-parsing every "
        "event). Rounds rotate which contender goes first. TTFT: request sent → first text; "
        "throughput: tokens after the first over the time from the first to the last. The lean upstream "
        "(`bench/sse_upstream.py`, raw asyncio) runs in the harness process; llama-server in its own. "
        "**Measured on a shared, noisy 2-core machine** (see the load averages above): read the ratios, "
        "not the absolute figures.",
        "",
        *_overhead_table(rows),
        "",
        *_overhead_notes(rows),
        f"**Cancel → upstream disconnect** ({c['reps']} cancels mid-stream at 200 tokens/s): from the "
        "client's `cancel` frame to the upstream's read side seeing EOF (one process, one clock): "
        f"median **{fmt(c['wsserver_disconnect_ms']['median'], 2)} ms**, p99 "
        f"{fmt(c['wsserver_disconnect_ms']['p99'], 2)} ms, worst {fmt(c['wsserver_disconnect_ms']['max'], 2)} ms; "
        f"the client had its `done` after {fmt(c['wsserver_done_ms']['median'], 2)} ms (median). A client "
        "closing the SSE response itself: the upstream saw it "
        f"{fmt(c['direct_disconnect_ms']['median'], 2)} ms after the close (median).",
        "",
    ]
    ceiling = result["ceiling"]
    best = result.get("ceiling_streams")
    lines += [
        f"**Relay ceiling per core**: N streams at {p['ceiling_rate']:g} tokens/s each (an upstream in "
        "its own process, `python -m bench.sse_upstream`), each WebSocket client reading everything; "
        f"N rises until the wsserver process's event-loop lag p99 passes {p['lag_limit_ms']:g} ms "
        "(10 ms sleep probe inside it). "
        + (
            f"Highest N within the limit: **{best} streams**."
            if best is not None
            else "No level stayed within the limit."
        ),
        "",
        "| streams | delta frames/s delivered | loop lag p50 / p99 / max (ms) | wsserver cores | upstream cores | client cores |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in ceiling:
        lines.append(
            f"| {r['streams']} | {fmt(r['delta_frames_per_s'], 0)} | {fmt(r['lag_p50_ms'], 2)} / "
            f"{fmt(r['lag_p99_ms'], 2)} / {fmt(r['lag_max_ms'], 1)} | {fmt(r['server_cores'], 2)} "
            f"| {fmt(r['upstream_cores'], 2)} | {fmt(r['client_cores'], 2)} |"
        )
    lines += [""]
    if ceiling:
        top = ceiling[-1]
        total = top["server_cores"] + top["upstream_cores"] + top["client_cores"]
        if total > 1.6:
            lines.append(
                f"At {top['streams']} streams wsserver, the upstream and the client together used "
                f"{total:.2f} of this machine's 2 cores: past that point the three processes compete for "
                "the CPU, so the figure is a floor for what one wsserver core relays on a machine of "
                "its own, not its limit."
            )
            lines.append("")
    lines += _llama_lines(llama)
    return "\n".join(lines).rstrip()


def _llama_lines(result: dict[str, Any]) -> list[str]:
    if result.get("status") != "ok":
        return [f"llama-server as the upstream: not measured in this run: {result.get('reason')}."]
    s = result["stop"]
    return [
        f"**The next request's wait after a Stop mid-prefill**, llama-server (`-np 1`) on "
        f"`{result['model']}`: a prompt of ~{s['long_words']} words (new each time; its whole prefill "
        f"took {s['prefill_s'] * 1000:.0f} ms) is stopped after {s['stop_after_s'] * 1000:.0f} ms, then a "
        f"short request is sent at once; its time to first token ({s['reps']} each, alternating):",
        "",
        "| Stop by | next request's first token (median / worst ms) |",
        "|---|---:|",
        f"| wsserver: `cancel` frame (it closes the upstream stream) | "
        f"{fmt(s['wsserver_next_ttft_ms']['median'])} / {fmt(s['wsserver_next_ttft_ms']['max'])} |",
        f"| a client closing llama-server's SSE response itself | "
        f"{fmt(s['direct_next_ttft_ms']['median'])} / {fmt(s['direct_next_ttft_ms']['max'])} |",
        f"| (no Stop: an idle server's TTFT for that request) | "
        f"{fmt(s['idle_ttft_ms']['median'])} / {fmt(s['idle_ttft_ms']['max'])} |",
        "",
        *_stop_note(s),
    ]


def _stop_note(s: dict[str, Any]) -> list[str]:
    via, direct = s["wsserver_next_ttft_ms"]["median"], s["direct_next_ttft_ms"]["median"]
    idle = s["idle_ttft_ms"]["median"]
    if via is None or direct is None or idle is None:
        return []
    same = abs(via - direct) <= max(0.2 * direct, 20.0)
    return [
        "wsserver closes the upstream connection the moment the `cancel` arrives, which is all a "
        "client of llama-server can do. What the next request waits beyond an idle server's TTFT "
        f"({via - idle:+.0f} ms via wsserver, {direct - idle:+.0f} ms closing directly) is "
        "llama-server noticing the closed connection and leaving the abandoned prefill"
        + (", the same either way." if same else "; here the two differ by more than the noise.")
    ]


def headlines(result: dict[str, Any]) -> list[str]:
    """Rows of the report's summary table."""
    llama = result["llama"]
    rows = result["overhead"] + (llama.get("rows", []) if llama.get("status") == "ok" else [])
    parts = [
        f"{r['upstream']} at {r['label']}: TTFT {r['ttft_delta_ms']['median']:+.2f} ms, "
        f"throughput {fmt(r['tps_ratio']['median'], 3)}x"
        for r in rows
        if r["ttft_delta_ms"]["median"] is not None
    ]
    c = result["cancel"]
    lines = [
        f"| openai relay vs reading the upstream's SSE directly | {'; '.join(parts)} |",
        f"| openai relay: cancel → upstream disconnect | median "
        f"{fmt(c['wsserver_disconnect_ms']['median'], 2)} ms (direct close: "
        f"{fmt(c['direct_disconnect_ms']['median'], 2)} ms) |",
        f"| openai relay ceiling ({result['params']['ceiling_rate']:g} tokens/s streams, loop lag p99 ≤ "
        f"{result['params']['lag_limit_ms']:g} ms) | {result.get('ceiling_streams') or '-'} streams |",
    ]
    if llama.get("status") == "ok":
        s = llama["stop"]
        lines.append(
            f"| next request after a Stop mid-prefill, llama-server | via wsserver "
            f"{fmt(s['wsserver_next_ttft_ms']['median'])} ms; closing the SSE directly "
            f"{fmt(s['direct_next_ttft_ms']['median'])} ms |"
        )
    return lines
