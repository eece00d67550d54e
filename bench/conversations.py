"""Section 17: six conversations on two slots — a returning conversation's time to first token.

An agent host or a chat server has more conversations open than the engine
has sequences. Six conversations, each opening with its own ~1,200-token
history (``--quick``: ~150), take turns on two slots, one request at a time:
round 1 is every conversation's first turn (cold), then each later round
sends every conversation again — its history, the model's last answer and a
new user line — in the same order, so that each returning conversation finds
its slot taken by another (issue 40, item 1). Default model, temperature 0,
16 tokens an answer (``--quick``: 4).

Contenders, alternating per repeat (``--repeats``, default 2; medians):

* wsserver at its defaults (``parallel = 2``: the prompt cache in host
  memory on, ``prompt_cache_bytes = -1``, the KV cache's size);
* wsserver with ``prompt_cache_bytes = 0`` (only the in-slot prefix cache):
  the "without the cache" of the issue's 5x target;
* ``llama-server -np 2`` at its defaults (``--cache-ram`` 8 GiB, prompt
  caching on; ``scripts/llama-tools`` builds it; without it its rows read
  "not measured"), on its own ``/completion`` API.

Per contender: the median time to first token of the cold first turns and
of the returning turns, and the prompt tokens each returning turn took from
a cache (wsserver's ``usage.cached_tokens``, llama-server's
``timings.cache_n``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .contenders import InProcess, llama_completion
from .figures import TIMES, fmt, target, target_rows
from .lineup import long_prompt
from .options import Options
from .servers import llama_model, llama_server, llama_wsserver, tools_for
from .timing import Stream, median, ratio
from .wsload import generate_frame, timed_alone

N_CTX = 4096
PARALLEL = 2
CONVERSATIONS = 6
HISTORY_TOKENS = 1200
ROUNDS = 3

CACHE_ON = "wsserver (defaults: prompt cache on)"
CACHE_OFF = "wsserver (prompt_cache_bytes = 0)"
PEER = "llama-server -np 2 (defaults: --cache-ram 8192)"
#: name → extra wsserver settings (None: llama-server).
CONTENDERS: dict[str, dict[str, Any] | None] = {
    CACHE_ON: {},
    CACHE_OFF: {"backend.llama.prompt_cache_bytes": 0},
    PEER: None,
}


def _turn(history: str, answer: str, round_: int) -> str:
    """The next prompt of a conversation: what was said, the answer, a new line."""
    return f"{history}{answer}\nUser: and what came of item {round_}?\nAssistant:"


async def _scenario(stream: Any, histories: list[str], rounds: int, max_tokens: int) -> Any:
    """Every conversation's turns, one request at a time, round by round:
    each turn's time to first token and cached prompt tokens."""
    histories = list(histories)
    cold: list[float] = []
    back: list[float] = []
    cached: list[int] = []
    for r in range(rounds):
        for i in range(len(histories)):
            run, reused = await stream(f"c{i}r{r}", histories[i], max_tokens)
            assert run.first is not None, "no token came"
            (cold if r == 0 else back).append(run.first - run.sent)
            if r:
                cached.append(reused)
            histories[i] = _turn(histories[i], "".join(run.parts), r + 1)
    return {
        "cold_ttft_ms": median(cold) * 1000,
        "returning_ttft_ms": median(back) * 1000,
        "returning_worst_ms": max(back) * 1000,
        "returning_cached_tokens": median(cached),
        "turns": len(cold) + len(back),
    }


async def _wsserver(
    model: str, threads: int, extra: dict[str, Any], texts: list[str], **kw: Any
) -> Any:
    settings = {"n_ctx": N_CTX, "unpaced": True, **extra}
    async with llama_wsserver(model, threads=threads, parallel=PARALLEL, **settings) as server:

        async def stream(rid: str, prompt: str, n: int) -> tuple[Stream, int]:
            run = await timed_alone(server.url, generate_frame(rid, prompt, n))
            return run, int(run.final["usage"].get("cached_tokens", 0))

        return await _scenario(stream, texts, **kw)


async def _llama_server(tools: Path, model: str, threads: int, texts: list[str], **kw: Any) -> Any:
    args = ("-np", PARALLEL, "-c", N_CTX * PARALLEL, "-t", threads)
    async with llama_server(tools / "llama-server", model, *args) as peer:

        async def stream(rid: str, prompt: str, n: int) -> tuple[Stream, int]:
            body = {"prompt": prompt, "n_predict": n, "temperature": 0}
            run = await llama_completion(peer.port, body)
            return run, int(run.final.get("timings", {}).get("cache_n", 0))

        return await _scenario(stream, texts, **kw)


def _median(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"repeats": len(rounds)}
    for key in rounds[0]:
        out[key] = median(r.get(key) for r in rounds)
    return out


async def run(opts: Options) -> dict[str, Any]:
    model = llama_model(opts)
    threads = opts.n_threads
    tools = await tools_for(opts)
    size = 150 if opts.quick else HISTORY_TOKENS
    inproc = InProcess(model, n_ctx=N_CTX, n_batch=512, threads=threads)
    try:
        texts = [long_prompt(inproc, 40 + i, size)[0] for i in range(CONVERSATIONS)]
    finally:
        inproc.close()
    kw = {"rounds": 2 if opts.quick else ROUNDS, "max_tokens": 4 if opts.quick else 16}
    repeats = 1 if opts.quick else (opts.repeats or 2)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    for r in range(repeats):
        for name, extra in CONTENDERS.items():  # alternating: drift hits every contender
            if extra is None and tools is None:
                continue
            opts.log(f"  six conversations on two slots, round {r + 1}: {name}")
            if extra is None:
                assert tools is not None
                row = await _llama_server(tools, model, threads, texts, **kw)
            else:
                row = await _wsserver(model, threads, extra, texts, **kw)
            rounds[name].append(row)
    rows = [{"contender": name, **_median(runs)} for name, runs in rounds.items() if runs]
    return {
        "status": "ok",
        "threads": threads,
        "history_tokens": size,
        "rounds": kw["rounds"],
        "max_tokens": kw["max_tokens"],
        "repeats": repeats,
        "rows": rows,
    }


def _ttft(result: dict[str, Any], contender: str) -> float | None:
    for r in result["rows"]:
        if r["contender"] == contender:
            value: float | None = r["returning_ttft_ms"]
            return value
    return None


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 40's targets: a returning conversation's TTFT at most llama-server's,
    and at least 5x faster than without the cache."""
    ours = _ttft(result, CACHE_ON)
    return [
        target(
            f"six conversations on two slots: returning TTFT <= 1.0{TIMES} llama-server's",
            ratio(ours, _ttft(result, PEER)),
            lambda v: v <= 1.0,
            f"{{:,.2f}}{TIMES}",
            missing="not measured",
        ),
        target(
            f"six conversations on two slots: returning TTFT >= 5{TIMES} faster than without "
            "the cache",
            ratio(_ttft(result, CACHE_OFF), ours),
            lambda v: v >= 5.0,
            f"{{:,.1f}}{TIMES}",
        ),
    ]


def render(result: dict[str, Any]) -> str:
    lines = [
        f"Default model, {result['threads']} thread(s), temperature 0. Six conversations, each "
        f"opening with ~{result['history_tokens']:,} tokens of its own history, take turns on "
        f"two slots, one request at a time, {result['rounds']} rounds ({result['max_tokens']} "
        "tokens an answer; each later turn adds the answer and a user line); the median of "
        f"{result['repeats']} alternating repeat(s) per cell.",
        "",
        "| contender | first turn's TTFT, ms | returning TTFT, ms (median) | returning, worst, ms "
        "| prompt tokens from a cache (median) | vs llama-server |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    peer = _ttft(result, PEER)
    for r in result["rows"]:
        lines.append(
            f"| {r['contender']} | {fmt(r['cold_ttft_ms'], 0)} | {fmt(r['returning_ttft_ms'], 0)} "
            f"| {fmt(r['returning_worst_ms'], 0)} | {fmt(r['returning_cached_tokens'], 0)} "
            f"| {fmt(ratio(r['returning_ttft_ms'], peer), 2, TIMES)} |"
        )
    if peer is None:
        lines += ["", "llama-server: not measured (run scripts/llama-tools once)."]
    lines += ["", "| target | result | met |", "|---|---|:-:|", *target_rows(targets(result))]
    return "\n".join(lines)
