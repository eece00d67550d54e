"""Paired rounds against llama-server: both servers up at once, the same work alternately.

    python -m bench.paired decode [--rounds 4] [--streams 1,2,4,8,16] [--threads 2]
    python -m bench.paired ingest [--rounds 8] [--threads 2]
    python -m bench.paired freeze [--rounds 2] [--threads 2]
    … [--set backend.llama.prompt_cache_bytes=0]  (wsserver's configuration, repeatable)

The report's sections start each contender afresh, one at a time, round by
round; on this machine two such runs minutes apart disagreed by more than
the margins issue 40's targets are about (docs/llama.md, "Issue 40's
targets"). Here both servers are started once (per stream count), warmed
up, and then take turns on the same work — wsserver first in odd rounds,
llama-server first in even ones — so each round gives a *pair* measured
seconds apart. Printed per case: each side's figures, the median of the
pairs' ratios, the ratio of the medians, and how many pairs wsserver won.

* ``decode``: aggregate decode tok/s at N streams of 128 tokens (section
  10's workload: distinct prompts, greedy; wsserver over WebSocket at its
  defaults with ``parallel = N``, ``llama-server -np N`` at its defaults).
  Each round's prompts are new, so neither server reuses a cached prefix.
* ``ingest``: a 3,001-token prompt alone, one token asked
  (``/v1/completions`` on both): seconds to the answer. A new prompt each
  round (a different opening), the same one to both servers.
* ``freeze``: section 15's scenario at 3,000 tokens (three streams decoding,
  the long prompt arrives): the long prompt's time to first token and the
  streams' worst gap. Servers are started per run (the scenario's own).

``--set KEY=VALUE`` changes wsserver's configuration (VALUE read as JSON,
else as text; an unknown key is refused): an A/B of one setting against
the same llama-server. llama-server comes from ``scripts/llama-tools`` (built if missing). Run it
on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from statistics import median
from typing import Any

import aiohttp

from . import freeze
from .batched import N_CTX, PEER_BODY, TOKENS, peer_at_once
from .contenders import InProcess, llama_completion
from .lineup import distinct, long_prompt
from .options import Options
from .servers import Child, ServerProcess, llama_model, llama_server, llama_wsserver, tools_for
from .timing import aggregate
from .wsload import at_once, generate_frame, timed_alone

__all__ = ["pairs_summary"]

INGEST_TOKENS = 3000


def pairs_summary(ours: list[float], peer: list[float], *, higher_is_better: bool) -> str:
    """One line: both sides' figures, the median of the pairs' ratios (ours /
    peer), the ratio of the medians, and the pairs ours won."""
    ratios = [a / b for a, b in zip(ours, peer, strict=True)]
    won = sum((r >= 1.0) if higher_is_better else (r <= 1.0) for r in ratios)
    return (
        f"wsserver {[round(x, 2) for x in ours]}, llama-server {[round(x, 2) for x in peer]}; "
        f"median of the pairs' ratios {median(ratios):.3f}, ratio of the medians "
        f"{median(ours) / median(peer):.3f}; wsserver ahead in {won} of {len(ratios)}"
    )


async def _alternate(
    rounds: int, ours: Callable[[int], Awaitable[float]], peer: Callable[[int], Awaitable[float]]
) -> tuple[list[float], list[float]]:
    a: list[float] = []
    b: list[float] = []
    for r in range(rounds):
        if r % 2 == 0:
            a.append(await ours(r))
            b.append(await peer(r))
        else:
            b.append(await peer(r))
            a.append(await ours(r))
    return a, b


async def _decode_pairs(
    ours: ServerProcess, peer: Child, n: int, rounds: int
) -> tuple[list[float], list[float]]:
    """``rounds`` pairs of N streams (new prompts each round) on two running servers."""
    await timed_alone(ours.url, generate_frame("warm", "Warm up.", 8))
    await llama_completion(peer.port, {"prompt": "Warm up.", **PEER_BODY, "n_predict": 8})

    async def ws(r: int) -> float:
        runs, t0 = await at_once(ours.url, distinct(n, f"ws{r}"), TOKENS)
        return float(aggregate(runs, t0)["tok_s"])

    async def ls(r: int) -> float:
        runs, t0 = await peer_at_once(peer.port, distinct(n, f"ls{r}"))
        return float(aggregate(runs, t0, to_end=True)["tok_s"])

    return await _alternate(rounds, ws, ls)


async def decode(
    opts: Options, tools: Path, rounds: int, streams: list[int], settings: dict[str, Any]
) -> None:
    model, threads = llama_model(opts), opts.n_threads
    for n in streams:
        ours = llama_wsserver(model, threads=threads, parallel=n, n_ctx=N_CTX, **settings)
        peer = llama_server(tools / "llama-server", model, "-np", n, "-c", N_CTX * n, "-t", threads)
        async with ours, peer:
            a, b = await _decode_pairs(ours, peer, n, rounds)
        print(f"decode, {n} stream(s), tok/s: " + pairs_summary(a, b, higher_is_better=True))


def _texts(opts: Options, count: int, tokens: int) -> list[str]:
    inproc = InProcess(llama_model(opts), n_ctx=4096, n_batch=512, threads=opts.n_threads)
    try:
        return [long_prompt(inproc, 100 + i, tokens)[0] for i in range(count)]
    finally:
        inproc.close()


async def ingest(opts: Options, tools: Path, rounds: int, settings: dict[str, Any]) -> None:
    model, threads = llama_model(opts), opts.n_threads
    texts = _texts(opts, rounds + 1, INGEST_TOKENS)
    ours = llama_wsserver(model, threads=threads, parallel=4, n_ctx=4096, **settings)
    peer = llama_server(tools / "llama-server", model, "-np", 4, "-c", 4096 * 4, "-t", threads)
    timeout = aiohttp.ClientTimeout(total=600)
    async with ours, peer, aiohttp.ClientSession(timeout=timeout) as session:

        async def ask(base: str, prompt: str) -> float:
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
            started = time.perf_counter()
            async with session.post(base + "/v1/completions", json=body) as response:
                answer = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{base}: {response.status} {answer!r}")
            return time.perf_counter() - started

        base = ours.http.rstrip("/")
        await ask(base, texts[-1][:2000])  # warm-up (the last text is no round's)
        await ask(peer.url, texts[-1][:2000])
        a, b = await _alternate(
            rounds, lambda r: ask(base, texts[r]), lambda r: ask(peer.url, texts[r])
        )
    print(
        f"ingest, a {INGEST_TOKENS:,}-token prompt alone, seconds: "
        + pairs_summary(a, b, higher_is_better=False)
    )


async def freeze_ttft(opts: Options, tools: Path, rounds: int, settings: dict[str, Any]) -> None:
    model, threads = llama_model(opts), opts.n_threads
    (text,) = _texts(opts, 1, INGEST_TOKENS)
    rows: dict[str, list[dict[str, Any]]] = {"ours": [], "peer": []}

    async def ws(_: int) -> float:
        rows["ours"].append(await freeze.scenario_wsserver(model, threads, settings, text))
        return float(rows["ours"][-1]["ttft_ms"]) / 1000

    async def ls(_: int) -> float:
        rows["peer"].append(await freeze.scenario_llama_server(tools, model, threads, text))
        return float(rows["peer"][-1]["ttft_ms"]) / 1000

    a, b = await _alternate(rounds, ws, ls)
    print(
        f"freeze, the {INGEST_TOKENS:,}-token prompt's first token beside three streams, "
        "seconds: " + pairs_summary(a, b, higher_is_better=False)
    )
    for name, side in (("wsserver", "ours"), ("llama-server", "peer")):
        worst = [round(r["gap_worst_ms"]) for r in rows[side]]
        typical = [round(r["gap_median_ms"]) for r in rows[side]]
        print(f"  {name}: the streams' worst gap {worst} ms, median gap {typical} ms")


def setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` for ``--set``: VALUE as JSON where it parses, else as text;
    a key wsserver's configuration does not have is refused (the harness
    would drop it silently)."""
    from wsserver.config import KEYS

    key, sep, raw = text.partition("=")
    if not sep or key not in {".".join(k) for k in KEYS}:
        raise argparse.ArgumentTypeError(f"not a wsserver setting: {text!r} (KEY=VALUE)")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.paired", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("what", choices=("decode", "ingest", "freeze"))
    parser.add_argument("--rounds", type=int, default=0, help="default: 4 / 8 / 2")
    parser.add_argument("--streams", default="1,2,4,8,16", help="decode: stream counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default=None, help="GGUF (default: the default model)")
    parser.add_argument("--set", type=setting, action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    opts = Options(model=args.model, threads=args.threads)
    tools = asyncio.run(tools_for(opts))
    if tools is None:
        print("llama-server is not available (scripts/llama-tools)", file=sys.stderr)
        return 1
    settings = dict(args.set)
    rounds = args.rounds or {"decode": 4, "ingest": 8, "freeze": 2}[args.what]
    if args.what == "decode":
        streams = [int(s) for s in args.streams.split(",")]
        asyncio.run(decode(opts, tools, rounds, streams, settings))
    elif args.what == "ingest":
        asyncio.run(ingest(opts, tools, rounds, settings))
    else:
        asyncio.run(freeze_ttft(opts, tools, rounds, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
