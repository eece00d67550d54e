"""Section 8 — the OpenAI API over SSE: wsserver against llama_cpp.server and llama-server.

The same minimal asyncio SSE client (:class:`~bench.contenders.SseContender`)
reads ``POST /v1/completions`` with ``stream: true`` from:

* **wsserver (SSE)** — the server of sections 1-2 (``WsContender``'s
  process), on its ``/v1`` endpoint, next to its WebSocket;
* **llama_cpp.server** — llama-cpp-python's own server (sections 1-2's peer);
* **llama-server** — llama.cpp's own server, built by ``scripts/llama-tools``
  from the sources of the very llama.cpp our wheel binds (skipped if absent).

All three load the same GGUF with the same ``n_ctx``, ``n_batch`` and
threads, one slot each, and take turns (order rotated per prompt).

(a) **TTFT and decode**: short prompts, 128 tokens at temperature 0; TTFT =
request sent → first text; decode = tokens after the first over the time to
the last text (tokens from the usage chunk, else ``max_tokens`` when the
finish reason is ``length``).

(b) **Abandoning a long prompt**: a ~3,000-token prompt is sent and the
connection dropped 1 s later, in the middle of its prefill (what a browser
tab or an SDK's ``break`` does); then a short prompt is sent at once. Its
wait (drop → its first text) minus its TTFT on the idle model is how long
the abandoned request still held the model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from .common import Skip
from .contenders import Run, SseContender
from .figures import fmt
from .lineup import NEXT_PROMPTS, PROMPTS, LlamaLineup, long_prompt
from .options import Options
from .servers import Child, llama_server, llama_server_binary
from .timing import now, side_by_side, summary

TOKENS = 128
NEXT_TOKENS = 8
ABANDON_AFTER_S = 1.0


def _port(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])


async def run(opts: Options, lineup: LlamaLineup) -> dict[str, Any]:
    if lineup.ws is None or lineup.inproc is None:
        raise Skip("the lineup has no wsserver")
    contenders = [SseContender("wsserver (SSE)", _port(lineup.ws.server.url))]
    notes: list[str] = []
    if lineup.peer is not None:
        # repeat_penalty: llama_cpp.server defaults to 1.1, the others to 1.0.
        extra = {"repeat_penalty": 1.0}
        contenders.append(SseContender("llama_cpp.server", lineup.peer.port, extra))
    peer: Child | None = None
    try:
        peer = await llama_server(
            llama_server_binary(),
            lineup.model,
            *("-c", opts.n_ctx, "-b", opts.n_batch, "-ub", opts.n_batch),
            *("-t", lineup.threads, "-tb", lineup.threads, "-np", 1),
        ).start()
        extra = {"repeat_penalty": 1.0, "cache_prompt": False}
        contenders.append(SseContender("llama-server", peer.port, extra))
    except Skip as exc:
        notes.append(str(exc))
    except Exception as exc:
        notes.append(f"llama-server did not start: {exc}")
    try:
        return await _measure(opts, lineup, contenders, notes)
    finally:
        if peer is not None:
            await peer.stop()


async def _measure(
    opts: Options, lineup: LlamaLineup, contenders: list[SseContender], notes: list[str]
) -> dict[str, Any]:
    assert lineup.inproc is not None
    prompts = PROMPTS[: 3 if opts.quick else min(opts.repeats or 8, 8)]
    tokens = 16 if opts.quick else TOKENS
    for contender in contenders:  # warm-up, not counted
        await contender.complete("Hello", 4)

    async def complete(contender: SseContender, index: int) -> Run:
        opts.log(f"  section 8: {contender.name} prompt {index}")
        return await contender.complete(prompts[index], tokens, index)

    runs = await side_by_side(
        len(prompts), {c.name: functools.partial(complete, c) for c in contenders}
    )
    abandons = 1 if opts.quick else 2
    waits: dict[str, list[dict[str, float]]] = {c.name: [] for c in contenders}
    for n in range(abandons):
        for contender in contenders:
            long_text, _ = long_prompt(
                lineup.inproc, 100 + n * len(contenders) + len(waits[contender.name])
            )
            nxt = NEXT_PROMPTS[n % len(NEXT_PROMPTS)]
            idle = await contender.complete(nxt, NEXT_TOKENS)
            opts.log(f"  section 8: {contender.name} abandons a long prompt ({n + 1}/{abandons})")
            dropped = await contender.abandon(long_text, 16, ABANDON_AFTER_S)
            after = await contender.complete(nxt, NEXT_TOKENS)
            if after.first is None or after.end is None or idle.ttft_ms is None:
                continue
            # The next request was sent right after the drop; its first text
            # arrived (end - first) before complete() returned.
            wait = (now() - dropped) - (after.end - after.first)
            waits[contender.name].append(
                {"wait_ms": 1000 * wait, "busy_ms": 1000 * wait - idle.ttft_ms}
            )
    rows = []
    for contender in contenders:
        mine = runs[contender.name]
        rows.append(
            {
                "contender": contender.name,
                "n": len(mine),
                "ttft_ms": summary(r.ttft_ms for r in mine),
                "decode_tps": summary(r.decode_tps() for r in mine),
                "wait_ms": summary([w["wait_ms"] for w in waits[contender.name]]),
                "busy_ms": summary([w["busy_ms"] for w in waits[contender.name]]),
                "abandons": len(waits[contender.name]),
            }
        )
    return {
        "status": "ok",
        "params": {
            "model": lineup.model,
            "prompts": len(prompts),
            "tokens": tokens,
            "threads": lineup.threads,
        },
        "rows": rows,
        "notes": notes,
    }


def _median(stats: dict[str, Any]) -> float | None:
    return stats.get("median") if stats else None


def render(result: dict[str, Any]) -> str:
    p = result["params"]
    lines = [
        f"Model `{Path(p['model']).name}`, {p['threads']} threads, one slot per server; {p['prompts']} prompts x "
        f"{p['tokens']} tokens at temperature 0 over `POST /v1/completions` with `stream: true`, read by the same "
        "SSE client, contenders' order rotated per prompt. *Abandon*: a ~3,000-token prompt dropped "
        f"{ABANDON_AFTER_S:.0f} s after it was sent (mid-prefill), then a short prompt at once: *next waits* = drop → "
        "its first text; *model busy* = that minus its idle TTFT. Medians (worst in brackets).",
        "",
        "| contender | TTFT median (ms) | decode tokens/s median | after abandoning a long prompt: next waits (ms) | model busy (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        wait, busy = row["wait_ms"], row["busy_ms"]
        lines.append(
            f"| {row['contender']} | {fmt(_median(row['ttft_ms']))} | {fmt(_median(row['decode_tps']))} | "
            f"{fmt(_median(wait))} ({fmt(wait.get('max') if wait else None)}) | "
            f"{fmt(_median(busy))} ({fmt(busy.get('max') if busy else None)}) |"
        )
    for note in result.get("notes", []):
        lines += ["", note + "."]
    return "\n".join(lines)


def headlines(result: dict[str, Any]) -> list[str]:
    parts = [
        f"{row['contender']}: TTFT {fmt(_median(row['ttft_ms']))} ms, {fmt(_median(row['decode_tps']))} tokens/s, "
        f"next request after an abandoned long prompt waits {fmt(_median(row['wait_ms']))} ms"
        for row in result["rows"]
    ]
    return [f"| OpenAI API over SSE (section 8) | {'; '.join(parts)} |"]
