"""Section 4 — slow consumers.

Sixteen clients each read one long request at a tenth of the rate the fake
backend produces it. Reported: the server's RSS growth, the largest number of
bytes any one connection held server-side (channel + websockets write buffer,
sampled every 50 ms inside the server process), how long the producers were
blocked and how much CPU they burned while blocked, and whether every slow
reader's text equals a fast reader's text for the same request.

Every buffer between the model and the reader hides some backlog: the
server's channel and write buffer (what we measure), the server's kernel send
buffer (``server.sndbuf``, doubled by Linux), the client's kernel receive
buffer and the client library's frame queue. The slow clients shrink the last
two (``SO_RCVBUF`` 4 KiB, ``max_queue`` 1) so that backpressure reaches the
producer within seconds rather than after the whole answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .figures import fmt, save_plot
from .options import Options
from .servers import LOAD_TEST_LIMITS, ServerProcess
from .timing import Stream, cpu_seconds, now, summary
from .wsload import close_many, generate_frame, open_connection, request, timed_alone

CLIENTS = 16
PRODUCE_TOKENS_PER_S = 10_000
READ_FRACTION = 0.1


async def _fast_reader(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    stream = await timed_alone(url, generate_frame("fast", prompt, max_tokens))
    return stream.text, stream.tokens


async def _slow_reader(ws: Any, prompt: str, max_tokens: int, bytes_per_s: float) -> dict[str, Any]:
    """Read one request, consuming text at ``bytes_per_s``: after each frame,
    wait until the reader would have finished with what it holds."""
    stream = Stream()
    consumed = 0

    async def busy(frame: dict[str, Any]) -> None:
        nonlocal consumed
        consumed += len(frame["text"].encode())
        lag = stream.sent + consumed / bytes_per_s - now()
        if lag > 0:
            await asyncio.sleep(lag)  # the reader is busy with what it got

    done = await request(
        ws, generate_frame("slow", prompt, max_tokens), stream=stream, on_delta=busy
    )
    return {
        "text": stream.text,
        "frames": stream.pieces,
        "seconds": now() - stream.sent,
        "done": done,
    }


async def run(opts: Options) -> dict[str, Any]:
    duration = 2.0 if opts.quick else 30.0
    out = await _scenario(opts, duration, {})
    if out["texts_complete"] < out["texts_total"] and not opts.quick:
        # Show the other properties with the stall guard out of the way, so
        # that the figures cover the whole run and every text.
        opts.log("  slow consumers: again with stream.stall_timeout_s = 0 …")
        out["no_stall_timeout"] = await _scenario(opts, duration, {"stream.stall_timeout_s": 0.0})
    return out


async def _scenario(opts: Options, duration: float, extra: dict[str, Any]) -> dict[str, Any]:
    read_tokens_per_s = PRODUCE_TOKENS_PER_S * READ_FRACTION
    max_tokens = int(read_tokens_per_s * duration)
    overrides = {
        "backend.kind": "fake",
        "backend.fake.tokens_per_s": PRODUCE_TOKENS_PER_S,
        "limits.max_tokens": max(4096, max_tokens),
        **LOAD_TEST_LIMITS,
        **extra,
    }
    async with ServerProcess(overrides, name="wsserver-fake-slow") as server:
        prompts = [f"slow consumer {i}" for i in range(CLIENTS)]
        opts.log(f"  slow consumers: {CLIENTS} fast reference readers …")
        reference = await asyncio.gather(
            *(_fast_reader(server.url, p, max_tokens) for p in prompts)
        )
        await server.stats(reset=True)
        conns = [await open_connection(server.url, rcvbuf=4096, max_queue=1) for _ in prompts]
        await server.command("sample", on=True)
        before = await server.stats(reset=True)
        cpu0 = cpu_seconds(server.pid)
        opts.log(
            f"  slow consumers: {CLIENTS} clients reading {read_tokens_per_s:g} of "
            f"{PRODUCE_TOKENS_PER_S} tokens/s for ~{duration:g} s …"
        )
        t0 = now()
        results = await asyncio.gather(
            *(
                _slow_reader(
                    ws, p, max_tokens, bytes_per_s=len(text.encode()) / tokens * read_tokens_per_s
                )
                for ws, p, (text, tokens) in zip(conns, prompts, reference, strict=True)
            )
        )
        elapsed = now() - t0
        cpu1 = cpu_seconds(server.pid)
        after = await server.stats(reset=True, series=True)
        await server.command("sample", on=False)
        await close_many(conns)
    complete = [r["text"] == ref[0] for r, ref in zip(results, reference, strict=True)]
    reasons = sorted({_reason(r["done"]) for r in results})
    blocked_s = after["producer_blocked_s"]
    out = {
        "status": "ok",
        "params": {
            "clients": CLIENTS,
            "produce_tokens_per_s": PRODUCE_TOKENS_PER_S,
            "read_tokens_per_s": read_tokens_per_s,
            "max_tokens": max_tokens,
            "client_rcvbuf": 4096,
            "client_max_queue": 1,
        },
        "elapsed_s": elapsed,
        "reader_seconds": summary(r["seconds"] for r in results),
        "rss_before_bytes": before["rss_bytes"],
        "rss_max_bytes": after["rss_max_bytes"],
        "rss_growth_bytes": max(0, after["rss_max_bytes"] - before["rss_bytes"]),
        "max_buffered_bytes": after["max_buffered_bytes"],
        "buffer_samples": after["buffered_samples"],
        "producer_blocked_s": blocked_s,
        "producer_blocked_fraction": blocked_s / (CLIENTS * elapsed) if elapsed else None,
        "producer_blocked_cpu_s": after["producer_blocked_cpu_s"],
        "server_cpu_s": cpu1 - cpu0,
        "texts_complete": sum(complete),
        "texts_total": len(complete),
        "done_reasons": reasons,
        "server_overrides": extra,
        "received_fraction": summary(
            len(r["text"]) / max(1, len(ref[0])) for r, ref in zip(results, reference, strict=True)
        ),
        "text_bytes_per_client": summary(len(ref[0].encode()) for ref in reference),
        "frames_per_client": summary(r["frames"] for r in results),
        "series": after.get("series", []),
    }
    opts.log(
        f"    RSS growth {out['rss_growth_bytes'] / 1024:.0f} KiB, largest buffer "
        f"{out['max_buffered_bytes'] / 1024:.1f} KiB, blocked {blocked_s:.1f} s "
        f"(CPU {out['producer_blocked_cpu_s']:.3f} s), complete {sum(complete)}/{len(complete)}"
    )
    return out


def _reason(done: dict[str, Any]) -> str:
    reason = str(done.get("reason", done.get("code", "?")))
    error = done.get("error")
    if isinstance(error, dict) and error.get("code"):
        reason += f" ({error['code']})"
    return reason


def headlines(sl: dict[str, Any]) -> list[str]:
    return [
        f"| 16 slow consumers | largest server-side buffer {sl['max_buffered_bytes'] / 1024:.1f} KiB per "
        f"connection, RSS +{sl['rss_growth_bytes'] / 1024:,.0f} KiB, producer CPU while blocked "
        f"{sl['producer_blocked_cpu_s']:.3f} s over {fmt(sl['producer_blocked_s'])} s blocked, "
        f"texts complete {sl['texts_complete']}/{sl['texts_total']}"
        + (
            f" (with the stall guard off: {sl['no_stall_timeout']['texts_complete']}/"
            f"{sl['no_stall_timeout']['texts_total']})"
            if sl.get("no_stall_timeout")
            else ""
        )
        + " |"
    ]


def problems(sl: dict[str, Any]) -> list[str]:
    if sl["texts_complete"] >= sl["texts_total"]:
        return []
    return [
        f"Slow consumers (section 4): with the default settings only {sl['texts_complete']} of "
        f"{sl['texts_total']} slow but live readers received their whole text "
        f"(done: {', '.join(sl['done_reasons'])})."
    ]


def render(r: dict[str, Any]) -> str:
    p = r["params"]
    runs = [("server defaults", r)]
    if r.get("no_stall_timeout"):
        runs.append(("`stream.stall_timeout_s = 0`", r["no_stall_timeout"]))

    def row(label: str, cell: Any) -> str:
        return f"| {label} | " + " | ".join(cell(x) for _, x in runs) + " |"

    def texts(x: dict[str, Any]) -> str:
        mark = "yes" if x["texts_complete"] == x["texts_total"] else "**no**"
        return (
            f"{x['texts_complete']}/{x['texts_total']} {mark} (done: {', '.join(x['done_reasons'])}; "
            f"median share received {100 * (x['received_fraction']['median'] or 0):.0f} %)"
        )

    return "\n".join(
        [
            f"{p['clients']} clients, each reading one {p['max_tokens']:,}-token request at "
            f"{p['read_tokens_per_s']:g} tokens/s while the fake backend produces "
            f"{p['produce_tokens_per_s']:,} tokens/s (a tenth). Slow clients use SO_RCVBUF "
            f"{p['client_rcvbuf']} and websockets max_queue {p['client_max_queue']} so the backlog "
            "reaches the server within seconds. Server defaults otherwise (sndbuf 16 KiB, write_limit "
            "16 KiB, queue_tokens 64, stall_timeout_s as configured).",
            "",
            "| measure | " + " | ".join(name for name, _ in runs) + " |",
            "|---|" + "---:|" * len(runs),
            row("run time (s)", lambda x: fmt(x["elapsed_s"])),
            row(
                "server RSS before → peak (MiB)",
                lambda x: f"{x['rss_before_bytes'] / 2**20:.1f} → {x['rss_max_bytes'] / 2**20:.1f}",
            ),
            row("**server RSS growth (KiB)**", lambda x: f"{x['rss_growth_bytes'] / 1024:,.0f}"),
            row(
                "**largest per-connection buffered bytes, server-side (KiB)**",
                lambda x: f"{x['max_buffered_bytes'] / 1024:.1f}",
            ),
            row(
                "producers blocked, total (s) / share of run",
                lambda x: (
                    f"{fmt(x['producer_blocked_s'])} / "
                    f"{fmt(100 * (x['producer_blocked_fraction'] or 0), 0)} %"
                ),
            ),
            row(
                "**producer CPU while blocked, total (s)**",
                lambda x: f"{x['producer_blocked_cpu_s']:.4f}",
            ),
            row("server CPU during the run (s)", lambda x: fmt(x["server_cpu_s"], 2)),
            row("**texts identical to a fast reader's**", texts),
        ]
    )


def plot(result: dict[str, Any], plt: Any, out_dir: Any) -> list[str]:
    # The run without the stall guard covers the whole 30 s; prefer it.
    variant = result.get("no_stall_timeout")
    label = " (stall_timeout_s = 0)" if variant else ""
    result = variant or result
    series = result.get("series") or []
    if not series:
        return []
    t = [row[0] for row in series]
    fig, ax = plt.subplots(figsize=(9, 3.4))
    ax.plot(t, [row[1] / 1024 for row in series], label="largest per-connection buffer (KiB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("KiB, server-side")
    ax.grid(alpha=0.3)
    rss = ax.twinx()
    rss.plot(t, [row[2] / 2**20 for row in series], color="#c63", label="server RSS (MiB)")
    rss.set_ylabel("RSS, MiB")
    low = min(row[2] for row in series) / 2**20
    rss.set_ylim(low - 1, low + 9)
    lines = ax.get_lines() + rss.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper right")
    p = result["params"]
    ax.set_title(
        f"{p['clients']} clients reading at a tenth of the production rate{label}, sampled every 50 ms",
        fontsize=10,
    )
    return save_plot(fig, plt, out_dir, "slow_consumers.png")


def notes(r: dict[str, Any]) -> list[str]:
    notes = []
    if r["texts_complete"] != r["texts_total"]:
        stalled = any("stalled" in x for x in r["done_reasons"])
        text = (
            f"**Problem: texts incomplete with the default settings.** Only {r['texts_complete']} of "
            f"{r['texts_total']} slow readers received the whole text (done: {', '.join(r['done_reasons'])})."
        )
        if stalled:
            text += (
                " These clients never stop reading; they read slowly. The stall guard "
                "(`stream.stall_timeout_s`) times one blocked `put()` of the producer, and that put "
                "waits for the sender, which waits in websockets' `send()` until the write buffer drains "
                "from its high-water mark (`write_limit`, 16 KiB) to the low one (a quarter of it): "
                "about 12 KiB at the client's read rate, i.e. several seconds at a few KiB/s, longer than "
                "the stall timeout. So a slow but live reader is cut off as if it had stalled. What would "
                "close it: judge a stall by the client's progress (bytes taken off the socket in the last "
                "N seconds) rather than by one blocked put, or lower the low-water mark so the sender "
                "resumes after each frame leaves."
            )
        if r.get("no_stall_timeout"):
            v = r["no_stall_timeout"]
            text += (
                f" With the guard off (second column) {v['texts_complete']}/{v['texts_total']} texts "
                "arrived complete and identical to a fast reader's, with the same bounded buffers."
            )
        notes.append(text)
    notes.append(
        "The server-side buffer is the request's channel (at most `queue_tokens` = 64 tokens) plus the "
        "websockets write buffer; the rest of a slow reader's backlog sits in the two kernels' socket "
        "buffers (16 KiB `SO_SNDBUF`, doubled by Linux, and the client's receive buffer), which is why "
        "the producers are not blocked for the whole run."
    )
    return notes
