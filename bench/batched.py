"""Section 10: the batched llama engine, side by side with llama.cpp's own tools.

Default model, temperature 0, distinct prompts (no shared prefix);
contenders alternate in every round (``--repeats``, default 2; medians) so
drift on this noisy machine hits all:

* **Aggregate decode tokens/s** at N = 1, 2, 4, 8, 16 concurrent streams of
  128 tokens: wsserver with ``parallel = N`` at its defaults (pacing on;
  N WebSocket connections, completion tokens from the done frames), the same
  with flash attention on, ``llama-server -np N`` at its defaults (flash
  attention ``auto``; N concurrent streamed ``/completion`` requests), and
  ``llama-batched-bench``'s S_TG for ``-npl N`` with flash attention off and
  on — the ceiling: one ``llama_decode`` per step over N sequences, no
  sampling, no server. Rate = completion tokens / (last end - first send).
* **The others' gap while a long prompt is ingested:** section 15
  (``bench/freeze.py``).
* **Prompt cache:** time to first token of turn 1 and turn 5 of a chat whose
  history starts at ~2,000 tokens (the next turn's prompt = history + answer +
  new message), and the prompt tokens each turn decoded.
* **Single stream:** wsserver (``parallel = 4`` and ``1``) vs in-process
  llama-cpp-python (``create_completion``) vs ``llama-bench -n 128`` (tg128).

llama.cpp's tools come from ``scripts/llama-tools`` (built once into a
cache from llama-cpp-python's sdist, ~15-20 minutes on 2 cores; never in the
test suite). Without them those columns read "not measured". ``llama-bench``
runs with flash attention on (wsserver's default ``auto`` is on, on a CPU);
the in-process llama-cpp-python run keeps its default (off).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson

from .common import ROOT, ServerProcess, Skip, fmt, free_port, ratio
from .lineup import PROMPTS, _default_model
from .options import Options
from .wsload import open_connection

STREAMS = (1, 2, 4, 8, 16)
TOKENS = 128
#: Per sequence: a short prompt + 128 tokens fit; 16 x 1,024 cells stay small.
N_CTX = 1024
TIMES = "\u00d7"


def tools_dir() -> Path | None:
    """llama.cpp's bin folder (scripts/llama-tools builds it once), or None."""
    script = ROOT / "scripts" / "llama-tools"
    try:
        out = subprocess.run(
            [str(script)], capture_output=True, text=True, timeout=3600, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line for line in out.splitlines() if line.strip()]
    path = Path(lines[-1].strip()) if lines else None
    return path if path and (path / "llama-server").exists() else None


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} {i}. {PROMPTS[i % len(PROMPTS)]}" for i in range(n)]


# ------------------------------------------------------------------ wsserver


def _ws_server(
    model: str,
    threads: int,
    parallel: int,
    *,
    root: Path = ROOT,
    name: str = "wsserver",
    paced: bool = False,
    **extra: Any,
) -> ServerProcess:
    """wsserver on the llama engine, frames unpaced unless ``paced`` (its
    defaults); ``root``: the tree it runs from (this checkout, or a
    ``--baseline`` export)."""
    pacing = {} if paced else {"stream.flush_ms": 0.0, "stream.flush_tokens": 1}
    return ServerProcess(
        {
            "backend.kind": "llama",
            "backend.llama.model": model,
            "backend.llama.n_ctx": extra.pop("n_ctx", N_CTX),
            "backend.llama.n_threads": threads,
            "backend.llama.parallel": parallel,
            "limits.max_tokens": 4096,
            "limits.max_prompt_chars": 1_000_000,
            **pacing,
            **extra,
        },
        name=f"{name}-p{parallel}",
        root=root,
    )


async def _ws_stream(
    url: str,
    rid: str,
    prompt: str,
    max_tokens: int,
    t0: float,
    stop_on: asyncio.Event | None = None,
    decoding: asyncio.Event | None = None,
    decoding_after: int = 5,
    **extra: Any,
) -> dict[str, Any]:
    """One request on its own connection: delta arrival times and the done frame.

    With ``stop_on``, the request is cancelled once that event is set;
    ``decoding`` is set once ``decoding_after`` deltas arrived.
    """
    ws = await open_connection(url)
    canceller = None
    if stop_on is not None:

        async def cancel_when_told() -> None:
            await stop_on.wait()
            await ws.send(orjson.dumps({"type": "cancel", "id": rid}).decode())

        canceller = asyncio.create_task(cancel_when_told())
    try:
        frame = {"type": "generate", "id": rid, "prompt": prompt, "max_tokens": max_tokens}
        frame.update({"temperature": 0, **extra})
        sent = time.perf_counter()
        await ws.send(orjson.dumps(frame).decode())
        arrivals: list[float] = []
        parts: list[str] = []
        while True:
            msg = orjson.loads(await ws.recv())
            if msg["type"] == "delta":
                arrivals.append(time.perf_counter() - t0)
                parts.append(msg["text"])
                if decoding is not None and len(arrivals) == decoding_after:
                    decoding.set()
            elif msg["type"] == "done":
                text = "".join(parts)
                return {"sent": sent - t0, "arrivals": arrivals, "done": msg, "text": text}
            elif msg["type"] == "error":
                raise RuntimeError(f"wsserver refused {rid}: {msg}")
    finally:
        if canceller is not None:
            canceller.cancel()
        await ws.close()


async def ws_aggregate(model: str, threads: int, n: int, **extra: Any) -> dict[str, Any]:
    """N streams at wsserver's defaults (pacing on): tokens from the done frames."""
    server = await _ws_server(model, threads, n, paced=True, **extra).start(timeout=300)
    try:
        # One request first: the model's pages are warm for every contender.
        await _ws_stream(server.url, "warm", "Warm up.", 8, time.perf_counter())
        t0 = time.perf_counter()
        runs = await asyncio.gather(
            *(
                _ws_stream(server.url, f"s{i}", p, TOKENS, t0)
                for i, p in enumerate(prompts(n, "ws"))
            )
        )
    finally:
        await server.stop()
    tokens = sum(r["done"]["usage"]["completion_tokens"] for r in runs)
    end = max(r["arrivals"][-1] if r["arrivals"] else r["sent"] for r in runs)
    ttft = [r["arrivals"][0] - r["sent"] for r in runs if r["arrivals"]]
    out = {"tok_s": tokens / end, "tokens": tokens, "ttft_ms": statistics.median(ttft) * 1000}
    if n == 1:
        out["decode"] = _decode_rate(runs[0])
    return out


# ------------------------------------------------------------------ llama.cpp


async def _sse_completion(port: int, prompt: str, t0: float) -> dict[str, Any]:
    import aiohttp

    body = {
        "prompt": prompt,
        "n_predict": TOKENS,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/completion", json=body) as resp,
    ):
        sent = time.perf_counter() - t0
        first = last = None
        tokens = 0
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            now = time.perf_counter() - t0
            if data.get("content"):
                first = first if first is not None else now
            last = now
            if data.get("stop"):
                tokens = int(data.get("tokens_predicted") or data["timings"]["predicted_n"])
    return {"sent": sent, "first": first, "last": last, "tokens": tokens}


async def server_aggregate(tools: Path, model: str, threads: int, n: int) -> dict[str, Any]:
    """llama-server as a user runs it: its defaults (flash attention ``auto``)."""
    port = free_port()
    args = [str(tools / "llama-server"), "-m", model, "-np", str(n), "-c", str(N_CTX * n)]
    args += ["-t", str(threads), "--port", str(port), "--host", "127.0.0.1"]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        await _wait_health(port)
        t0 = time.perf_counter()
        await _sse_completion(port, "Warm up.", t0)
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(_sse_completion(port, p, t0) for p in prompts(n, "ls")))
    finally:
        proc.terminate()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), 30)
    tokens = sum(r["tokens"] for r in runs)
    end = max(r["last"] for r in runs)
    ttft = [r["first"] - r["sent"] for r in runs if r["first"] is not None]
    return {"tok_s": tokens / end, "tokens": tokens, "ttft_ms": statistics.median(ttft) * 1000}


async def _wait_health(port: int, timeout: float = 300) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{port}/health") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.25)  # sleep-ok: polling a process we do not own
    raise RuntimeError("llama-server did not become healthy")


def batched_bench(tools: Path, model: str, threads: int, fa: str) -> dict[int, float]:
    """S_TG tokens/s per N from one ``llama-batched-bench`` run (``fa``: on/off)."""
    npl = ",".join(str(n) for n in STREAMS)
    args = [str(tools / "llama-batched-bench"), "-m", model, "-c", str(N_CTX * max(STREAMS))]
    args += ["-b", "2048", "-ub", "512", "-npp", "16", "-ntg", str(TOKENS), "-npl", npl]
    args += ["-t", str(threads), "-fa", fa, "--output-format", "jsonl"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=3600, check=True)
    rates: dict[int, float] = {}
    for line in (out.stdout + out.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and "speed_tg" in line:
            row = json.loads(line)
            rates[int(row["pl"])] = float(row["speed_tg"])
    return rates


def llama_bench_tg(tools: Path, model: str, threads: int) -> float | None:
    args = [str(tools / "llama-bench"), "-m", model, "-p", "0", "-n", str(TOKENS)]
    args += ["-t", str(threads), "-fa", "1", "-r", "3", "-o", "json"]  # as our default
    out = subprocess.run(args, capture_output=True, text=True, timeout=3600, check=True)
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"]) if rows else None


# ------------------------------------------------------------------ chat turns


async def chat_turns(model: str, threads: int, history: str) -> list[dict[str, Any]]:
    server = await _ws_server(model, threads, 4, n_ctx=4096).start(timeout=300)
    turns = []
    try:
        prompt = history + "\nUser: Summarise the record in one line.\nAssistant:"
        for turn in range(1, 6):
            t0 = time.perf_counter()
            run = await _ws_stream(server.url, f"turn{turn}", prompt, 32, t0, stop=["\nUser:"])
            text = run["text"]
            ttft = (run["arrivals"][0] - run["sent"]) * 1000 if run["arrivals"] else None
            turns.append(
                {
                    "turn": turn,
                    "prompt_tokens": run["done"]["usage"]["prompt_tokens"],
                    "ttft_ms": ttft,
                    "server_ttft_ms": run["done"]["timings"]["ttft_ms"],
                }
            )
            prompt += text + f" Point {turn}.\nUser: And then what happened?\nAssistant:"
    finally:
        await server.stop()
    return turns


# ------------------------------------------------------------------ the section


async def run(opts: Options) -> dict[str, Any]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise Skip(f"llama-cpp-python is not installed ({exc})") from None
    model = opts.model or _default_model()
    threads = opts.threads or os.cpu_count() or 1
    streams = (1, 4) if opts.quick else STREAMS
    tools = None if opts.quick else await asyncio.to_thread(tools_dir)
    opts.log(f"  llama.cpp tools: {tools or 'not available'}")
    repeats = 1 if opts.quick else (opts.repeats or 2)
    result: dict[str, Any] = {
        "status": "ok",
        "threads": threads,
        "tokens": TOKENS,
        "repeats": repeats,
        "rows": [],
    }
    ceilings = {}
    if tools:
        for fa in ("off", "on"):
            ceilings[fa] = await asyncio.to_thread(batched_bench, tools, model, threads, fa)
    for n in streams:
        row: dict[str, Any] = {
            "streams": n,
            "batched_bench": ceilings.get("off", {}).get(n),
            "batched_bench_fa": ceilings.get("on", {}).get(n),
        }
        rounds: dict[str, list[dict[str, Any]]] = {}
        for r in range(repeats):  # alternating rounds: drift hits every contender
            opts.log(f"  {n} stream(s), round {r + 1}")
            rounds.setdefault("wsserver", []).append(await ws_aggregate(model, threads, n))
            if not opts.quick:
                rounds.setdefault("wsserver_fa_off", []).append(
                    await ws_aggregate(model, threads, n, **{"backend.llama.flash_attn": "off"})
                )
            if tools is not None:
                rounds.setdefault("llama_server", []).append(
                    await server_aggregate(tools, model, threads, n)
                )
        for name, runs in rounds.items():
            row[name] = _median_run(runs)
        result["rows"].append(row)
    from .contenders import InProcess

    inproc = InProcess(model, n_ctx=N_CTX, n_batch=opts.n_batch, threads=threads)
    try:
        single = await inproc.complete(prompts(1, "inproc")[0], TOKENS)
        result["inprocess"] = {
            "tok_s": single.decode_tps(TOKENS),
            "ttft_ms": (single.first or 0.0) * 1000,
        }
        from .lineup import long_prompt

        history, n_hist = long_prompt(inproc, 2, 2000)
    finally:
        inproc.close()
    result["single_p4"] = await _single(model, threads)
    if tools is not None:
        result["llama_bench_tg"] = await asyncio.to_thread(llama_bench_tg, tools, model, threads)
    result["history_tokens"] = n_hist
    result["turns"] = await chat_turns(model, threads, history)
    return result


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median rate (its TTFT and decode figures with it)."""
    ranked = sorted(runs, key=lambda r: r["tok_s"])
    out = dict(ranked[len(ranked) // 2])
    out["rounds"] = [r["tok_s"] for r in runs]
    out["tok_s"] = statistics.median(r["tok_s"] for r in runs)
    return out


async def _single(model: str, threads: int) -> dict[str, Any]:
    """One stream alone on the default ``parallel = 4`` (the row N = 1 has ``parallel = 1``)."""
    server = await _ws_server(model, threads, 4).start(timeout=300)
    try:
        await _ws_stream(server.url, "warm", "Warm up.", 8, time.perf_counter())
        t0 = time.perf_counter()
        r = await _ws_stream(server.url, "one", prompts(1, "single")[0], TOKENS, t0)
    finally:
        await server.stop()
    return _decode_rate(r)


def _decode_rate(r: dict[str, Any]) -> dict[str, Any]:
    """A single stream's decode rate (first to last token, as tg128 counts) and TTFT."""
    a = r["arrivals"]
    tokens = r["done"]["usage"]["completion_tokens"]
    rate = (tokens - 1) / (a[-1] - a[0]) if len(a) > 1 and a[-1] > a[0] else None
    return {"tok_s": rate, "ttft_ms": (a[0] - r["sent"]) * 1000 if a else None}


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Default model, {result['threads']} thread(s) everywhere, {result['tokens']} tokens per "
        "stream, temperature 0. wsserver at its defaults (pacing on: frames merge tokens; "
        "tokens counted from the done frames; flash attention `auto`, on here), and with flash "
        "attention off; llama-server at its defaults (flash attention `auto`); "
        "`llama-batched-bench` S_TG (no sampling, no server) with flash attention on and off. "
        f"Each rate is the median of {result.get('repeats', 1)} alternating round(s).",
        "",
        "| streams | wsserver tok/s | llama-server -np N | ceiling fa on | vs llama-server "
        "| vs ceiling | wsserver fa off | ceiling fa off | fa off vs ceiling | wsserver TTFT ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        ws = row["wsserver"]["tok_s"]
        off = (row.get("wsserver_fa_off") or {}).get("tok_s")
        ls = (row.get("llama_server") or {}).get("tok_s")
        con, coff = row.get("batched_bench_fa"), row.get("batched_bench")
        lines.append(
            f"| {row['streams']} | {fmt(ws)} | {fmt(ls)} | {fmt(con)} | "
            f"{fmt(ratio(ws, ls), 2, TIMES)} | {fmt(ratio(ws, con), 2, TIMES)} | {fmt(off)} | "
            f"{fmt(coff)} | {fmt(ratio(off, coff), 2, TIMES)} | "
            f"{fmt(row['wsserver']['ttft_ms'])} |"
        )
    lines += ["", *_targets(result)]
    first = result["rows"][0]["wsserver"].get("decode") or {}
    inproc = result.get("inprocess") or {}
    tg = result.get("llama_bench_tg")
    p4 = result.get("single_p4") or {}
    lines += [
        "",
        "Single stream, decode rate (first to last token, as tg128 counts it): "
        f"wsserver `parallel = 1` {fmt(first.get('tok_s'))} tok/s "
        f"(TTFT {fmt(first.get('ttft_ms'))} ms), `parallel = 4` {fmt(p4.get('tok_s'))} tok/s "
        f"({fmt(ratio(p4.get('tok_s'), first.get('tok_s')), 3, TIMES)}); "
        f"in-process llama-cpp-python {fmt(inproc.get('tok_s'))} tok/s "
        f"(TTFT {fmt(inproc.get('ttft_ms'))} ms); `llama-bench` tg{result['tokens']} {fmt(tg)} tok/s "
        f"→ wsserver {fmt(ratio(first.get('tok_s'), tg), 2, TIMES)} of llama-bench, "
        f"{fmt(ratio(first.get('tok_s'), inproc.get('tok_s')), 2, TIMES)} of in-process.",
        "",
        "The others' gap while a long prompt is ingested: section 15 (the freeze table).",
    ]
    lines += [
        "",
        f"Chat turns on a {result['history_tokens']}-token history (each turn's prompt = "
        "the previous prompt + answer + a new message; the cached prefix is reused):",
        "",
        "| turn | prompt tokens | TTFT at the client, ms | server ttft_ms |",
        "|---:|---:|---:|---:|",
    ]
    for t in result["turns"]:
        lines.append(
            f"| {t['turn']} | {t['prompt_tokens']} | {fmt(t['ttft_ms'])} | "
            f"{fmt(t['server_ttft_ms'])} |"
        )
    return "\n".join(lines)


def _targets(result: dict[str, Any]) -> list[str]:
    """The issue's targets against this run's figures, as a table."""
    out = ["| target | this run | met |", "|---|---|:-:|"]
    for t in targets(result):
        met = "-" if t["met"] is None else ("yes" if t["met"] else "no")
        out.append(f"| {t['name']} | {t['shown']} | {met} |")
    return out


def summary_line(result: dict[str, Any]) -> str:
    """The report's summary row: aggregate decode at 4 and 8 streams against llama-server."""
    parts = []
    for row in result["rows"]:
        if row["streams"] in (1, 4, 8):
            ws = row["wsserver"]["tok_s"]
            peer = (row.get("llama_server") or {}).get("tok_s")
            parts.append(
                f"{row['streams']} streams {fmt(ws, 1)} tok/s"
                + (f" (llama-server {fmt(peer, 1)})" if peer else "")
            )
    turns = result.get("turns") or []
    if len(turns) >= 5:
        parts.append(
            f"chat turn 5 TTFT {fmt(turns[4]['ttft_ms'], 0)} ms vs turn 1 "
            f"{fmt(turns[0]['ttft_ms'], 0)} ms"
        )
    return f"| batched llama engine (section 10) | {'; '.join(parts)} |"


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against this run's figures (for the report's summary too)."""
    rows = {r["streams"]: r for r in result["rows"]}
    out: list[dict[str, Any]] = []

    def line(name: str, value: float | None, goal: float) -> None:
        out.append(
            {
                "name": f"batched engine: {name}",
                "shown": fmt(value, 2, TIMES),
                "met": None if value is None else value >= goal,
            }
        )

    for n in STREAMS:
        row = rows.get(n) or {}
        if not row:
            continue
        ws = (row.get("wsserver") or {}).get("tok_s")
        line(
            f">= 1.0{TIMES} llama-server at {n} stream(s)",
            ratio(ws, (row.get("llama_server") or {}).get("tok_s")),
            1.0,
        )
    worst = [
        ratio(r["wsserver"]["tok_s"], r.get("batched_bench_fa"))
        for r in result["rows"]
        if r.get("batched_bench_fa")
    ]
    line(
        f">= 0.95{TIMES} the batched-bench ceiling, same flash attention (worst N)",
        min(worst) if worst else None,
        0.95,
    )
    decode = (rows.get(1) or {}).get("wsserver", {}).get("decode") or {}
    line(
        f">= 0.95{TIMES} llama-bench tg{result['tokens']}, one stream",
        ratio(decode.get("tok_s"), result.get("llama_bench_tg")),
        0.95,
    )
    return out
