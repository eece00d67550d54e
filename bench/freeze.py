"""Section 15: the freeze table — a long prompt arrives while three streams decode.

Default model, 2 threads (``--threads``), temperature 0. Three streams decode
(each token its own frame: wsserver with ``flush_ms = 0``, llama-server's SSE
one token per event); then a fourth request brings a ~1,000- or ~3,000-token
prompt. Per contender, alternating rounds (``--repeats``, default 2; the
median of the rounds is reported):

* the three streams' median gap between tokens before the long prompt (once
  all three decode, at least 20 gaps each), and
  their **worst gap** while it is ingested (from its send to its first token);
* the long prompt's **time to first token**;
* the **work rate** during the ingest: prompt tokens ingested plus the tokens
  the three streams received, per second of the ingest.

Contenders: wsserver at its defaults (``prefill_budget = 2.0``), with
``prefill_budget = 4.0`` (the prompt gets more of the machine), with the old
fixed 64-token chunk (``prefill_budget = 0``), with flash attention off
(its default is ``auto``: on, on a CPU), and ``llama-server -np 4`` as a user runs it (its
defaults: flash attention ``auto``; ``scripts/llama-tools`` builds it; without
it its rows read "not measured").
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import time
from typing import Any

from .batched import _wait_health, _ws_server, _ws_stream, prompts, tools_dir
from .common import Skip, fmt, free_port, ratio
from .lineup import _default_model, long_prompt
from .options import Options

N_CTX = 4096
#: Deltas each of the three streams gets before the long prompt is sent: the
#: median gap "before" is taken once all three decode (their first steps, with
#: fewer sequences in the batch, are shorter), from at least 20 gaps each.
STEADY_AFTER = 5
DELTAS_BEFORE = STEADY_AFTER + 20
LENGTHS = (1000, 3000)
TIMES = "\u00d7"

#: name → extra wsserver settings (None: llama-server).
CONTENDERS: dict[str, dict[str, Any] | None] = {
    "wsserver (budget 2.0)": {},
    "wsserver (budget 4.0)": {"backend.llama.prefill_budget": 4.0},
    "wsserver (fixed 64-token chunk)": {"backend.llama.prefill_budget": 0.0},
    "wsserver (budget 2.0, flash attention off)": {"backend.llama.flash_attn": "off"},
    "llama-server -np 4 (defaults)": None,
}


def _summary(
    others: list[list[float]], sent: float, first: float, prompt_tokens: int
) -> dict[str, Any]:
    """Gaps and work rate from the three streams' token arrival times: the
    median gap before the long prompt once all three decode, the worst while
    it is ingested."""
    steady = max(arrivals[STEADY_AFTER - 1] for arrivals in others)
    before: list[float] = []
    during: list[float] = []
    received = 0
    for arrivals in others:
        received += sum(1 for a in arrivals if sent < a <= first)
        for x, y in itertools.pairwise(arrivals):
            if y <= sent:
                if x >= steady:
                    before.append(y - x)
            elif x < first:
                during.append(y - x)
    median = statistics.median(before) if before else None
    worst = max(during) if during else None
    ttft = first - sent
    return {
        "gap_median_ms": median * 1000 if median else None,
        "gap_worst_ms": worst * 1000 if worst else None,
        "worst_over_median": ratio(worst, median),
        "ttft_ms": ttft * 1000,
        "prompt_tokens": prompt_tokens,
        "others_tokens": received,
        "work_tok_s": (prompt_tokens + received) / ttft if ttft > 0 else None,
    }


async def _wsserver(model: str, threads: int, extra: dict[str, Any], text: str) -> dict[str, Any]:
    server = await _ws_server(model, threads, 4, n_ctx=N_CTX, **extra).start(timeout=300)
    try:
        await _ws_stream(server.url, "warm", "Warm up.", 8, time.perf_counter())
        t0 = time.perf_counter()
        done = asyncio.Event()
        ready = [asyncio.Event() for _ in range(3)]
        decoding = [
            asyncio.create_task(
                _ws_stream(
                    server.url,
                    f"d{i}",
                    p,
                    3000,
                    t0,
                    stop_on=done,
                    decoding=ready[i],
                    decoding_after=DELTAS_BEFORE,
                )
            )
            for i, p in enumerate(prompts(3, "freeze"))
        ]
        for event in ready:
            await event.wait()
        long = await _ws_stream(server.url, "long", text, 1, t0)
        done.set()
        runs = await asyncio.gather(*decoding)
    finally:
        await server.stop()
    first = long["arrivals"][0]
    n_prompt = int(long["done"]["usage"]["prompt_tokens"])
    return _summary([r["arrivals"] for r in runs], long["sent"], first, n_prompt)


async def _llama_server_stream(
    port: int,
    prompt: str,
    n_predict: int,
    t0: float,
    stop_on: asyncio.Event | None = None,
    decoding: asyncio.Event | None = None,
) -> dict[str, Any]:
    import aiohttp

    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
    }
    arrivals: list[float] = []
    prompt_n = 0
    async with aiohttp.ClientSession() as session:
        sent = time.perf_counter() - t0
        async with session.post(f"http://127.0.0.1:{port}/completion", json=body) as resp:

            async def read() -> None:
                nonlocal prompt_n
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = json.loads(line[6:])
                    if data.get("content"):
                        arrivals.append(time.perf_counter() - t0)
                        if decoding is not None and len(arrivals) == DELTAS_BEFORE:
                            decoding.set()
                    if data.get("stop"):
                        prompt_n = int((data.get("timings") or {}).get("prompt_n") or 0)
                        return

            reader = asyncio.create_task(read())
            if stop_on is None:
                await reader
            else:
                stopper = asyncio.create_task(stop_on.wait())
                await asyncio.wait({reader, stopper}, return_when=asyncio.FIRST_COMPLETED)
                reader.cancel()  # closing the connection cancels the slot
                stopper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
    return {"sent": sent, "arrivals": arrivals, "prompt_n": prompt_n}


async def _llama_server(tools: Any, model: str, threads: int, text: str) -> dict[str, Any]:
    port = free_port()
    args = [str(tools / "llama-server"), "-m", model, "-np", "4", "-c", str(N_CTX * 4)]
    args += ["-t", str(threads), "--port", str(port), "--host", "127.0.0.1"]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        await _wait_health(port)
        await _llama_server_stream(port, "Warm up.", 8, time.perf_counter())
        t0 = time.perf_counter()
        done = asyncio.Event()
        ready = [asyncio.Event() for _ in range(3)]
        decoding = [
            asyncio.create_task(
                _llama_server_stream(port, p, 3000, t0, stop_on=done, decoding=ready[i])
            )
            for i, p in enumerate(prompts(3, "freeze"))
        ]
        for event in ready:
            await event.wait()
        long = await _llama_server_stream(port, text, 1, t0)
        done.set()
        runs = await asyncio.gather(*decoding)
    finally:
        proc.terminate()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), 30)
    first = long["arrivals"][0]
    return _summary([r["arrivals"] for r in runs], long["sent"], first, long["prompt_n"])


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in rounds[0]:
        values = [r[key] for r in rounds if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


async def run(opts: Options) -> dict[str, Any]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise Skip(f"llama-cpp-python is not installed ({exc})") from None
    from .contenders import InProcess

    model = opts.model or _default_model()
    threads = opts.threads or os.cpu_count() or 1
    tools = None if opts.quick else await asyncio.to_thread(tools_dir)
    opts.log(f"  llama.cpp tools: {tools or 'not available'}")
    lengths = (300,) if opts.quick else LENGTHS
    inproc = InProcess(model, n_ctx=N_CTX, n_batch=512, threads=threads)
    try:
        texts = {n: long_prompt(inproc, 5 + i, n)[0] for i, n in enumerate(lengths)}
    finally:
        inproc.close()
    repeats = 1 if opts.quick else (opts.repeats or 2)
    rounds: dict[str, dict[int, list[dict[str, Any]]]] = {name: {} for name in CONTENDERS}
    for n in lengths:
        for r in range(repeats):
            for name, extra in CONTENDERS.items():  # alternating: drift hits every contender
                if extra is None and tools is None:
                    continue
                if opts.quick and extra:
                    continue
                opts.log(f"  {n}-token prompt, round {r + 1}: {name}")
                if extra is None:
                    row = await _llama_server(tools, model, threads, texts[n])
                else:
                    row = await _wsserver(model, threads, extra, texts[n])
                rounds[name].setdefault(n, []).append(row)
    table = [
        {"contender": name, "prompt": n, **_median(rows)}
        for name, by_length in rounds.items()
        for n, rows in by_length.items()
    ]
    return {"status": "ok", "threads": threads, "rows": table, "repeats": repeats}


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Default model, {result['threads']} thread(s), temperature 0, three streams decoding "
        "(one token per frame), then a long prompt; the median of "
        f"{result['repeats']} alternating round(s) per cell. Gaps are the three streams' "
        "(median before the long prompt, once all three decode; worst while it is ingested); "
        "work rate = (prompt tokens ingested + tokens the three received) / the long "
        "prompt's time to first token.",
        "",
        "| prompt tokens | contender | median gap, ms | worst gap, ms | worst / median "
        "| long prompt's TTFT, ms | work rate, tok/s | work vs llama-server |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    peer = {
        r["prompt"]: r["work_tok_s"] for r in result["rows"] if r["contender"].startswith("llama")
    }
    for r in sorted(result["rows"], key=lambda r: r["prompt"]):
        lines.append(
            f"| {fmt(r['prompt_tokens'], 0)} | {r['contender']} | {fmt(r['gap_median_ms'])} | "
            f"{fmt(r['gap_worst_ms'])} | {fmt(r['worst_over_median'], 1, TIMES)} | "
            f"{fmt(r['ttft_ms'], 0)} | {fmt(r['work_tok_s'])} | "
            f"{fmt(ratio(r['work_tok_s'], peer.get(r['prompt'])), 2, TIMES)} |"
        )
    return "\n".join(lines)
