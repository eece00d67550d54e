"""Section 6 — the chat page in headless Chromium: does the UI stay responsive?

The server (its own process, fake backend) streams a markdown-heavy answer
(:mod:`bench.sample_markdown`, up to 100,000 characters, from
``backend.fake.text_file``) at 50, 500 and 5,000 tokens/s with the default
pacing, into the real page (clients/web/) in Debian's Chromium, driven by
Playwright. While it streams, a script types into the prompt and clicks the
controls like a user (a key every ~40 ms, a click every few keys). Each rate
runs twice: with the page rendering markdown, and with ``?render=plain``
(plain text) for comparison. A run ends when the text is complete, or after
``MAX_S`` seconds with a click on Stop (the slow rate would need minutes to
reach 100,000 characters; its row says how far it got).

Measured inside the page:

* **long tasks** (``PerformanceObserver`` ``longtask``: main-thread tasks of
  50 ms or more) during the stream: count, worst, sum;
* **input to next frame**: for every ``keydown`` and ``pointerdown`` while
  streaming, from the event's timestamp to a task queued by the first
  animation frame after it (``requestAnimationFrame`` then ``setTimeout 0``:
  the frame that shows the input has been produced) — p50, p99, worst;
* **Event Timing** (the browser's own input-to-paint measure, 8 ms
  granularity, entries over 16 ms): worst;
* **frame intervals** (``requestAnimationFrame`` timestamps while streaming):
  p50, p99, worst;
* **the page's own rendering cost** per animation frame (``window.chat.renderStats``:
  the markdown or plain-text render plus the layout that keeping the view at
  the bottom forces): mean and worst — what the page itself spends, as
  opposed to time the machine's other work takes from it;
* **memory at the end**, after a forced garbage collection (Chrome DevTools
  protocol ``HeapProfiler.collectGarbage``, ``Performance.getMetrics``): JS
  heap used and DOM nodes.

The first run of each browser warms up (fonts, JIT) on a short answer that
is stopped, then starts a new chat, so one-off costs are not charged to the
stream.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from .options import Options
from .sample_markdown import markdown_text
from .servers import ServerProcess
from .timing import percentile, side_by_side

CHROMIUM = os.environ.get("WSSERVER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]
RATES = (50, 500, 5000)
CHARS = 100_000
MAX_S = 60.0
#: Runs per (rendering, rate), interleaved; the row shown is the median run.
REPEATS = 3

PROBE = """() => {
    const app = document.getElementById('app');
    const streaming = () => app.dataset.state === 'streaming';
    const probe = window.__perf = { longTasks: [], events: [], inputs: [], frames: [], deltas: 0 };
    new PerformanceObserver((list) => {
        for (const e of list.getEntries()) if (streaming()) probe.longTasks.push(e.duration);
    }).observe({ type: 'longtask' });
    new PerformanceObserver((list) => {
        for (const e of list.getEntries()) if (streaming()) probe.events.push(e.duration);
    }).observe({ type: 'event', durationThreshold: 16 });
    for (const type of ['pointerdown', 'keydown']) {
        document.addEventListener(type, (event) => {
            if (!streaming()) return;
            const start = event.timeStamp;
            requestAnimationFrame(() => setTimeout(() => {
                probe.inputs.push(performance.now() - start);
            }, 0));
        }, { capture: true });
    }
    const tick = (t) => { if (streaming()) probe.frames.push(t); requestAnimationFrame(tick); };
    requestAnimationFrame(tick);
    window.chat.client.on('frame', (f) => { if (f.type === 'delta') probe.deltas++; });
    window.chat.renderStats.reset();
}"""

SHOWN = (
    "() => document.querySelector('.message.assistant:last-of-type .text')?.textContent.length ?? 0"
)


async def _interact_until_done(page: Any, max_s: float) -> int:
    """Type and click like a user while the answer streams; Stop after max_s."""
    deadline = time.monotonic() + max_s
    actions = 0
    word = "typing while it streams "
    # The temperature slider lives in the "Sampling" disclosure: open it once.
    if await page.get_attribute("#sampling", "open") is None:
        await page.click("#sampling > summary")
    while await page.get_attribute("#app", "data-state") != "idle":
        if time.monotonic() > deadline:
            await page.click("#stop")
            break
        await page.click("#prompt")
        await page.keyboard.type(word, delay=40)
        await page.click("#seed")
        await page.keyboard.type("7", delay=40)
        await page.keyboard.press("Backspace")
        await page.click("#temperature")
        await page.click("#prompt")
        await page.keyboard.press("Control+A")
        await page.keyboard.press("Delete")
        actions += len(word) + 6
    return actions


async def _one(browser: Any, url: str, render: str, rate: int, max_s: float) -> dict[str, Any]:
    context = await browser.new_context(viewport={"width": 1100, "height": 800})
    page = await context.new_page()
    try:
        cdp = await context.new_cdp_session(page)
        await cdp.send("Performance.enable")
        await page.goto(url + ("?render=plain" if render == "plain" else ""))
        await page.wait_for_selector("#app[data-connection=open]")
        await page.fill("#max-tokens", "1000000")
        # Warm-up: a stopped answer, then a new chat.
        await page.fill("#prompt", "warm up")
        await page.press("#prompt", "Enter")
        await page.wait_for_function(f"() => ({SHOWN})() > 3000")
        await page.click("#stop")
        await page.click("#new-chat")
        await page.evaluate(PROBE)
        await page.fill("#prompt", "the long answer")
        await page.press("#prompt", "Enter")
        started = time.monotonic()
        await page.wait_for_selector("#app[data-state=streaming]")
        actions = await _interact_until_done(page, max_s)
        done = await page.evaluate("() => window.chat.last().done")
        elapsed = time.monotonic() - started
        perf = await page.evaluate("() => window.__perf")
        renders = await page.evaluate("() => ({ ...window.chat.renderStats })")
        chars = await page.evaluate(SHOWN)
        await cdp.send("HeapProfiler.collectGarbage")
        metrics = {
            m["name"]: m["value"] for m in (await cdp.send("Performance.getMetrics"))["metrics"]
        }
    finally:
        await context.close()
    frames = perf["frames"]
    intervals = [b - a for a, b in itertools.pairwise(frames)]
    inputs = perf["inputs"]
    long_tasks = perf["longTasks"]
    return {
        "render": render,
        "rate": rate,
        "chars": chars,
        "reason": done["reason"],
        "seconds": round(elapsed, 1),
        "tokens_per_s": done["timings"]["tokens_per_s"],
        "deltas": perf["deltas"],
        "deltas_per_s": perf["deltas"] / max(done["timings"]["total_ms"] / 1000, 1e-9),
        "scripted_inputs": actions,
        "long_tasks": len(long_tasks),
        "long_task_worst_ms": max(long_tasks, default=0.0),
        "long_task_sum_ms": sum(long_tasks),
        "inputs": len(inputs),
        "input_p50_ms": percentile(inputs, 50),
        "input_p99_ms": percentile(inputs, 99),
        "input_worst_ms": max(inputs, default=None),
        "event_worst_ms": max(perf["events"], default=0.0),
        "frame_p50_ms": percentile(intervals, 50),
        "frame_p99_ms": percentile(intervals, 99),
        "frame_worst_ms": max(intervals, default=None),
        "render_frames": renders["frames"],
        "render_mean_ms": renders["totalMs"] / max(renders["frames"], 1),
        "render_worst_ms": renders["worstMs"],
        "heap_mib": metrics.get("JSHeapUsedSize", 0) / 2**20,
        "dom_nodes": int(metrics.get("Nodes", 0)),
    }


async def _at_rate(
    opts: Options, browser: Any, text_file: str, rate: int, repeats: int, max_s: float
) -> list[dict[str, Any]]:
    """Both renderings at one rate, each one's median run. The runs are
    interleaved, so that both meet the same moments of the machine's other work."""
    overrides = {
        "backend.kind": "fake",
        "backend.fake.text_file": text_file,
        "backend.fake.tokens_per_s": float(rate),
        "limits.max_tokens": 1_000_000,
    }
    async with ServerProcess(overrides, name=f"wsserver-page-{rate}") as server:

        async def once(render: str, attempt: int) -> dict[str, Any]:
            opts.log(f"  page: {render} at {rate} tokens/s, run {attempt + 1} …")
            return await _one(browser, server.http, render, rate, max_s)

        runs = await side_by_side(
            repeats, {r: functools.partial(once, r) for r in ("markdown", "plain")}, order="fixed"
        )
    return [_median_run(done_runs) for done_runs in runs.values()]


async def run(opts: Options) -> dict[str, Any]:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        return {
            "status": "skipped",
            "reason": "Playwright is not installed (scripts/install --test)",
        }
    if not Path(CHROMIUM).exists():
        return {
            "status": "skipped",
            "reason": f"{CHROMIUM} does not exist (Debian package chromium)",
        }
    chars = 8_000 if opts.quick else CHARS
    rates = (500,) if opts.quick else RATES
    max_s = 5.0 if opts.quick else MAX_S
    text = markdown_text(chars)
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False, encoding="utf-8") as f:
        f.write(text)
    repeats = 1 if opts.quick else REPEATS
    rows = []
    try:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                for rate in rates:
                    rows += await _at_rate(opts, browser, f.name, rate, repeats, max_s)
            finally:
                await browser.close()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(f.name)
    targets = []
    for row in rows:
        if row["render"] != "markdown":
            continue
        targets.append(
            {
                "name": f"page at {row['rate']:,} tokens/s: no long task ≥ 50 ms",
                "shown": f"{row['long_tasks']} (worst {row['long_task_worst_ms']:.0f} ms)",
                "met": row["long_tasks"] == 0,
            }
        )
        p99 = row["input_p99_ms"]
        targets.append(
            {
                "name": f"page at {row['rate']:,} tokens/s: input → next frame p99 ≤ 50 ms",
                "shown": "-" if p99 is None else f"{p99:.1f} ms ({row['inputs']} inputs)",
                "met": p99 is not None and p99 <= 50,
            }
        )
    return {"status": "ok", "rows": rows, "targets": targets, "text_chars": len(text)}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median long-task time, with every run's key figures beside it."""
    ordered = sorted(runs, key=lambda row: (row["long_task_sum_ms"], row["input_p99_ms"] or 0.0))
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["runs"] = [
        {k: run[k] for k in ("long_tasks", "long_task_worst_ms", "input_p99_ms", "render_worst_ms")}
        for run in runs
    ]
    return row


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render(r: dict[str, Any]) -> str:
    lines = [
        f"A markdown-heavy answer of {r['text_chars']:,} characters (headings, paragraphs with "
        "emphasis, inline code and links, lists, fenced code, tables, quotes) streamed by the fake "
        "backend into the chat page in headless Chromium, default pacing (`flush_ms = 30`), with "
        "scripted typing and clicking throughout; each rate rendered as markdown and, for "
        f"comparison, as plain text (`?render=plain`). Runs stop after {MAX_S:.0f} s. Each row is "
        "the median of its runs by long-task time (the runs of both renderings interleaved); the "
        'last column lists every run. "Characters shown" is the rendered text: markdown '
        "shows fewer than its source (no `**`, fences, table pipes). Method: `bench/page.py`.",
        "",
        "| render | tokens/s | characters shown | deltas/s | long tasks (worst, sum ms) "
        "| input → frame p50 / p99 / worst ms (n) | Event Timing worst ms "
        "| frame interval p50 / p99 / worst ms | page's render per frame mean / worst ms "
        "| JS heap MiB | DOM nodes | every run: long tasks (worst ms), input p99 ms |",
        "|---|---:|---:|---:|---|---|---:|---|---|---:|---:|---|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['render']} | {row['tokens_per_s']:,.0f} (set {row['rate']:,}) | {row['chars']:,} "
            f"| {row['deltas_per_s']:.1f} | {row['long_tasks']} ({row['long_task_worst_ms']:.0f}, "
            f"{row['long_task_sum_ms']:.0f}) | {_ms(row['input_p50_ms'])} / {_ms(row['input_p99_ms'])} "
            f"/ {_ms(row['input_worst_ms'])} ({row['inputs']}) | {row['event_worst_ms']:.0f} "
            f"| {_ms(row['frame_p50_ms'])} / {_ms(row['frame_p99_ms'])} / {_ms(row['frame_worst_ms'])} "
            f"| {row['render_mean_ms']:.2f} / {row['render_worst_ms']:.1f} "
            f"| {row['heap_mib']:.1f} | {row['dom_nodes']:,} | "
            + "; ".join(
                f"{run['long_tasks']} ({run['long_task_worst_ms']:.0f}), {_ms(run['input_p99_ms'])}"
                for run in row.get("runs", [])
            )
            + " |"
        )
    return "\n".join(lines)


def notes(r: dict[str, Any]) -> list[str]:
    """What the figures say, written from them."""
    out = []
    md = [row for row in r["rows"] if row["render"] == "markdown"]
    plain = {row["rate"]: row for row in r["rows"] if row["render"] == "plain"}
    worst_render = max((row["render_worst_ms"] for row in md), default=0.0)
    mean_render = max((row["render_mean_ms"] for row in md), default=0.0)
    out.append(
        f"The page's own work per frame stays small at every rate: rendering markdown (lexing and "
        f"re-rendering only the open block, sanitizing it, and the layout that keeping the view at "
        f"the bottom forces) took at most {mean_render:.2f} ms per frame on average and "
        f"{worst_render:.1f} ms in the worst frame of the runs shown — the cost of a frame does not grow "
        "with the answer (finished blocks are never rendered again), and the frame ceiling kept "
        f"deltas at {max((row['deltas_per_s'] for row in md), default=0.0):.0f} a second or fewer "
        "at every token rate, so a faster model only makes each delta longer."
    )
    runs = {
        render: [
            run for row in r["rows"] if row["render"] == render for run in row.get("runs", [row])
        ]
        for render in ("markdown", "plain")
    }
    if runs["markdown"]:
        counts = {
            render: (
                sum(1 for run in rr if run["long_tasks"]),
                len(rr),
                max((run["long_task_worst_ms"] for run in rr), default=0.0),
            )
            for render, rr in runs.items()
        }
        out.append(
            "Single runs vary with the machine's other work: "
            + " and ".join(
                f"{with_tasks} of {total} {render} runs had any long task (worst {worst:.0f} ms)"
                for render, (with_tasks, total, worst) in counts.items()
            )
            + ". The rows above are the median runs; every run is in the last column."
        )
    slow = [row for row in md if row["long_tasks"] or (row["input_p99_ms"] or 0) > 50]
    if slow:
        cases = "; ".join(
            f"{row['rate']:,} tokens/s: {row['long_tasks']} long tasks (worst "
            f"{row['long_task_worst_ms']:.0f} ms), input p99 {_ms(row['input_p99_ms'])} ms, plain text "
            f"{plain[row['rate']]['long_tasks']} long tasks, p99 {_ms(plain[row['rate']]['input_p99_ms'])} ms"
            for row in slow
            if row["rate"] in plain
        )
        smallest = min(
            (row["long_task_worst_ms"] for row in slow if row["long_tasks"]), default=0.0
        )
        why = (
            f"the page's worst frame of rendering ({worst_render:.1f} ms) is far below the long tasks "
            "seen, so those tasks are mostly time the browser's main thread did not get: "
            if worst_render < smallest / 2
            else "part of it is the page's own rendering, and part "
        )
        out.append(
            f"Where a target was missed ({cases}), {why}the run shares 2 cores with the server, the "
            "fake model, the Playwright driver and the machine's other work (see the load average "
            "above). Rendering plain text in the same conditions shows how much of it is the machine."
        )
    return out


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    return list(result["targets"])


def headlines(r: dict[str, Any]) -> list[str]:
    md = [row for row in r["rows"] if row["render"] == "markdown"]
    worst_task = max((row["long_task_worst_ms"] for row in md), default=0.0)
    tasks = sum(row["long_tasks"] for row in md)
    p99 = max((row["input_p99_ms"] or 0.0 for row in md), default=0.0)
    rates = "/".join(f"{row['rate']:,}" for row in md)
    return [
        f"| chat page, markdown at {rates} tokens/s | {tasks} long tasks (worst {worst_task:.0f} ms); "
        f"input → next frame p99 ≤ {p99:.1f} ms |"
    ]
