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

Contenders: wsserver at its defaults (the freeze bound ``prefill_gap_ms =
200``: a step carrying prompt tokens beside decoding streams lasts at most
200 ms), with the bound at 150 and 250 ms (the default is chosen from these
rows: the others' worst gap at most 250 ms, the long prompt's first token as
early as that allows), as before issue 40 (``prefill_gap_ms = 80``: twice the
decode step bounds the step, 80 ms at least), and ``llama-server -np 4`` as a
user runs it (its defaults: flash attention ``auto``; ``scripts/llama-tools``
builds it; without it its rows read "not measured"). Section 15's earlier
rows (a fixed 64-token chunk, flash attention off) are quoted in docs/llama.md
and were in docs/benchmarks.md until 7aeb6db re-measured the section.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from .contenders import InProcess, llama_completion
from .figures import TIMES, fmt, target
from .lineup import distinct, long_prompt
from .options import Options
from .servers import llama_model, llama_server, llama_wsserver, tools_for
from .timing import Stream, median, ratio
from .wsload import generate_frame, timed_alone

N_CTX = 4096
#: Deltas each of the three streams gets before the long prompt is sent: the
#: median gap "before" is taken once all three decode (their first steps, with
#: fewer sequences in the batch, are shorter), from at least 20 gaps each.
STEADY_AFTER = 5
DELTAS_BEFORE = STEADY_AFTER + 20
LENGTHS = (1000, 3000)

#: name → extra wsserver settings (None: llama-server).
CONTENDERS: dict[str, dict[str, Any] | None] = {
    "wsserver (defaults: gap 200 ms)": {},
    "wsserver (gap 150 ms)": {"backend.llama.prefill_gap_ms": 150.0},
    "wsserver (gap 250 ms)": {"backend.llama.prefill_gap_ms": 250.0},
    "wsserver (before: 2x the decode step, 80 ms floor)": {"backend.llama.prefill_gap_ms": 80.0},
    "llama-server -np 4 (defaults)": None,
}

#: One request of a contender: (id, prompt, max_tokens, stop_on, on_piece) → its Stream.
Streamer = Callable[..., Coroutine[Any, Any, Stream]]


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
    typical = median(before)
    worst = max(during) if during else None
    ttft = first - sent
    return {
        "gap_median_ms": typical * 1000 if typical else None,
        "gap_worst_ms": worst * 1000 if worst else None,
        "worst_over_median": ratio(worst, typical),
        "ttft_ms": ttft * 1000,
        "prompt_tokens": prompt_tokens,
        "others_tokens": received,
        "work_tok_s": (prompt_tokens + received) / ttft if ttft > 0 else None,
    }


def _after(n: int, event: asyncio.Event) -> Callable[[Any], Awaitable[None]]:
    """A per-piece hook that sets ``event`` at the ``n``-th piece."""
    seen = 0

    async def count(_: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == n:
            event.set()

    return count


async def _scenario(stream: Streamer, text: str, prompt_tokens: Callable[[Stream], int]) -> Any:
    """A warm-up; three streams decoding; the long prompt once each has had
    ``DELTAS_BEFORE`` deltas; the gaps and work rate."""
    await stream("warm", "Warm up.", 8)
    done = asyncio.Event()
    ready = [asyncio.Event() for _ in range(3)]
    decoding = [
        asyncio.create_task(stream(f"d{i}", p, 3000, done, _after(DELTAS_BEFORE, ready[i])))
        for i, p in enumerate(distinct(3, "freeze"))
    ]
    for event in ready:
        await event.wait()
    long = await stream("long", text, 1)
    done.set()
    runs = await asyncio.gather(*decoding)
    assert long.first is not None
    others = [r.arrivals or [] for r in runs]
    return _summary(others, long.sent, long.first, prompt_tokens(long))


async def scenario_wsserver(model: str, threads: int, extra: dict[str, Any], text: str) -> Any:
    settings = {"n_ctx": N_CTX, "unpaced": True, **extra}
    async with llama_wsserver(model, threads=threads, parallel=4, **settings) as server:

        def stream(rid: str, prompt: str, n: int, stop_on: Any = None, hook: Any = None) -> Any:
            frame = generate_frame(rid, prompt, n)
            return timed_alone(server.url, frame, arrivals=True, cancel_on=stop_on, on_delta=hook)

        return await _scenario(stream, text, lambda r: int(r.final["usage"]["prompt_tokens"]))


async def scenario_llama_server(tools: Path, model: str, threads: int, text: str) -> Any:
    body = {"temperature": 0, "cache_prompt": False}
    args = ("-np", 4, "-c", N_CTX * 4, "-t", threads)
    async with llama_server(tools / "llama-server", model, *args) as peer:

        def stream(rid: str, prompt: str, n: int, stop_on: Any = None, hook: Any = None) -> Any:
            request = {"prompt": prompt, "n_predict": n, **body}
            return llama_completion(peer.port, request, stop_on=stop_on, on_piece=hook)

        return await _scenario(stream, text, lambda r: int(r.final["timings"]["prompt_n"]))


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in rounds[0]:
        out[key] = median(r.get(key) for r in rounds)
    return out


async def run(opts: Options) -> dict[str, Any]:
    model = llama_model(opts)
    threads = opts.n_threads
    tools = await tools_for(opts)
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
                    assert tools is not None
                    row = await scenario_llama_server(tools, model, threads, texts[n])
                else:
                    row = await scenario_wsserver(model, threads, extra, texts[n])
                rounds[name].setdefault(n, []).append(row)
    table = [
        {"contender": name, "prompt": n, **_median(rows)}
        for name, by_length in rounds.items()
        for n, rows in by_length.items()
    ]
    return {"status": "ok", "threads": threads, "rows": table, "repeats": repeats}


#: Issue 40's bound: the others' worst gap, and the prompt the targets are read at.
WORST_GAP_MS = 250.0
TARGET_PROMPT = 3000
DEFAULTS = "wsserver (defaults: gap 200 ms)"


def _cell(result: dict[str, Any], contender: str, key: str) -> Any:
    """``key`` of ``contender``'s row at the longest prompt (None: not measured)."""
    rows = [r for r in result["rows"] if r["contender"] == contender]
    longest = max(rows, key=lambda r: r["prompt"], default=None)
    return None if longest is None else longest.get(key)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 40's freeze targets at the ~3,000-token prompt: the three streams'
    worst gap at most 250 ms, the long prompt's first token at most 1.5x
    llama-server's."""
    peer = next((r["contender"] for r in result["rows"] if r["contender"].startswith("llama")), "")
    return [
        target(
            f"freeze: three streams' worst gap <= {WORST_GAP_MS:g} ms beside a 3,000-token prompt",
            _cell(result, DEFAULTS, "gap_worst_ms"),
            lambda v: v <= WORST_GAP_MS,
            "{:,.0f} ms",
            missing="not measured",
        ),
        target(
            f"freeze: the 3,000-token prompt's TTFT <= 1.5{TIMES} llama-server's",
            ratio(_cell(result, DEFAULTS, "ttft_ms"), _cell(result, peer, "ttft_ms")),
            lambda v: v <= 1.5,
            f"{{:,.2f}}{TIMES}",
            missing="not measured",
        ),
    ]


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
        "| long prompt's TTFT, ms | TTFT vs llama-server | work rate, tok/s "
        "| work vs llama-server |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    peers = [r for r in result["rows"] if r["contender"].startswith("llama")]
    peer = {r["prompt"]: r["work_tok_s"] for r in peers}
    peer_ttft = {r["prompt"]: r["ttft_ms"] for r in peers}
    for r in sorted(result["rows"], key=lambda r: r["prompt"]):
        lines.append(
            f"| {fmt(r['prompt_tokens'], 0)} | {r['contender']} | {fmt(r['gap_median_ms'])} | "
            f"{fmt(r['gap_worst_ms'])} | {fmt(r['worst_over_median'], 1, TIMES)} | "
            f"{fmt(r['ttft_ms'], 0)} | "
            f"{fmt(ratio(r['ttft_ms'], peer_ttft.get(r['prompt'])), 2, TIMES)} | "
            f"{fmt(r['work_tok_s'])} | "
            f"{fmt(ratio(r['work_tok_s'], peer.get(r['prompt'])), 2, TIMES)} |"
        )
    return "\n".join(lines)
