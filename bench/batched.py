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
import functools
import json
import subprocess
from pathlib import Path
from typing import Any

from .contenders import InProcess, llama_completion
from .figures import TIMES, fmt, target, target_rows
from .lineup import distinct, long_prompt
from .options import Options
from .servers import llama_model, llama_server, llama_wsserver, tools_for
from .timing import Stream, aggregate, median, median_round, now, ratio, side_by_side
from .wsload import at_once, generate_frame, timed_alone

STREAMS = (1, 2, 4, 8, 16)
TOKENS = 128
#: Per sequence: a short prompt + 128 tokens fit; 16 x 1,024 cells stay small.
N_CTX = 1024


async def ws_aggregate(model: str, threads: int, n: int, **extra: Any) -> dict[str, Any]:
    """N streams at wsserver's defaults (pacing on): tokens from the done frames."""
    server = llama_wsserver(model, threads=threads, parallel=n, n_ctx=N_CTX, **extra)
    async with server:
        # One request first: the model's pages are warm for every contender.
        await timed_alone(server.url, generate_frame("warm", "Warm up.", 8))
        runs, t0 = await at_once(server.url, distinct(n, "ws"), TOKENS)
    ttft = median(r.ttft_ms for r in runs)
    out = {**aggregate(runs, t0), "ttft_ms": ttft}
    if n == 1:
        out["decode"] = _decode_rate(runs[0])
    return out


#: llama-server's ``/completion`` body for section 10's streams.
PEER_BODY = {"n_predict": TOKENS, "temperature": 0, "cache_prompt": False}


async def peer_at_once(port: int, prompts: list[str]) -> tuple[list[Stream], float]:
    """llama-server's side of :func:`~bench.wsload.at_once`: a ``/completion``
    per prompt, all at once; their streams, and when they were started."""
    t0 = now()
    runs = await asyncio.gather(
        *(llama_completion(port, {"prompt": p, **PEER_BODY}) for p in prompts)
    )
    return list(runs), t0


async def server_aggregate(tools: Path, model: str, threads: int, n: int) -> dict[str, Any]:
    """llama-server as a user runs it: its defaults (flash attention ``auto``)."""
    args = ("-np", n, "-c", N_CTX * n, "-t", threads)
    async with llama_server(tools / "llama-server", model, *args) as peer:
        await llama_completion(peer.port, {"prompt": "Warm up.", **PEER_BODY})
        runs, t0 = await peer_at_once(peer.port, distinct(n, "ls"))
    # Timed from the response's head, as llama-server's streams always were here.
    ttft = median(1000 * (r.first - r.head) for r in runs if r.first is not None and r.head)
    return {**aggregate(runs, t0, to_end=True), "ttft_ms": ttft}


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
    turns = []
    async with llama_wsserver(
        model, threads=threads, parallel=4, n_ctx=4096, unpaced=True
    ) as server:
        prompt = history + "\nUser: Summarise the record in one line.\nAssistant:"
        for turn in range(1, 6):
            frame = generate_frame(f"turn{turn}", prompt, 32, stop=["\nUser:"])
            run = await timed_alone(server.url, frame)
            turns.append(
                {
                    "turn": turn,
                    "prompt_tokens": run.final["usage"]["prompt_tokens"],
                    "ttft_ms": run.ttft_ms,
                    "server_ttft_ms": run.final["timings"]["ttft_ms"],
                }
            )
            prompt += run.text + f" Point {turn}.\nUser: And then what happened?\nAssistant:"
    return turns


# ------------------------------------------------------------------ the section


async def run(opts: Options) -> dict[str, Any]:
    model = llama_model(opts)
    threads = opts.n_threads
    streams = (1, 4) if opts.quick else STREAMS
    tools = await tools_for(opts)
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
        contenders = {"wsserver": functools.partial(ws_aggregate, model, threads, n)}
        if not opts.quick:
            contenders["wsserver_fa_off"] = functools.partial(
                ws_aggregate, model, threads, n, **{"backend.llama.flash_attn": "off"}
            )
        if tools is not None:
            contenders["llama_server"] = functools.partial(
                server_aggregate, tools, model, threads, n
            )

        def logged(name: str, measure: Any, r: int, n: int = n) -> Any:
            opts.log(f"  {n} stream(s), round {r + 1}: {name}")
            return measure()

        # Alternating rounds: drift hits every contender.
        rounds = await side_by_side(
            repeats,
            {name: functools.partial(logged, name, m) for name, m in contenders.items()},
            order="fixed",
        )
        row: dict[str, Any] = {
            "streams": n,
            "batched_bench": ceilings.get("off", {}).get(n),
            "batched_bench_fa": ceilings.get("on", {}).get(n),
        }
        for name, runs in rounds.items():
            row[name] = median_round(runs, "tok_s")
        result["rows"].append(row)
    inproc = InProcess(model, n_ctx=N_CTX, n_batch=opts.n_batch, threads=threads)
    try:
        single = await inproc.complete(distinct(1, "inproc")[0], TOKENS)
        result["inprocess"] = {"tok_s": single.decode_tps(TOKENS), "ttft_ms": single.ttft_ms or 0.0}
        history, n_hist = long_prompt(inproc, 2, 2000)
    finally:
        inproc.close()
    result["single_p4"] = await _single(model, threads)
    if tools is not None:
        result["llama_bench_tg"] = await asyncio.to_thread(llama_bench_tg, tools, model, threads)
    result["history_tokens"] = n_hist
    result["turns"] = await chat_turns(model, threads, history)
    return result


async def _single(model: str, threads: int) -> dict[str, Any]:
    """One stream alone on the default ``parallel = 4`` (the row N = 1 has ``parallel = 1``)."""
    async with llama_wsserver(
        model, threads=threads, parallel=4, n_ctx=N_CTX, unpaced=True
    ) as server:
        await timed_alone(server.url, generate_frame("warm", "Warm up.", 8))
        r = await timed_alone(server.url, generate_frame("one", distinct(1, "single")[0], TOKENS))
    return _decode_rate(r)


def _decode_rate(r: Stream) -> dict[str, Any]:
    """A single stream's decode rate (first to last token, as tg128 counts) and TTFT."""
    return {"tok_s": r.decode_tps(), "ttft_ms": r.ttft_ms}


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
    lines += [
        "",
        "| target | this run | met |",
        "|---|---|:-:|",
        *target_rows(targets(result), "no"),
    ]
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


def headlines(result: dict[str, Any]) -> list[str]:
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
    return [f"| batched llama engine (section 10) | {'; '.join(parts)} |"]


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets against this run's figures (for the report's summary too)."""
    rows = {r["streams"]: r for r in result["rows"]}
    out: list[dict[str, Any]] = []

    def line(name: str, value: float | None, goal: float) -> None:
        out.append(
            target(f"batched engine: {name}", value, lambda v: v >= goal, f"{{:,.2f}}{TIMES}")
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
