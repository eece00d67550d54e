"""Section 18: embeddings beside llama-server ``--embeddings`` (issue 37): throughput, and the streams' gaps.

    python -m bench --sections embeddings [--repeats 3] [--threads 2] [--merge]
    python -m bench.embeddings [--rounds 3] [--model GGUF] [--threads 2] [--quick]
                               [--long-chars N] [--json PATH]

**Throughput.** ``POST /v1/embeddings`` (floats) of 1, 32 and 512 short
inputs and of 8 long ones (~400 tokens each), on wsserver (4 slots, its
defaults otherwise) and on llama.cpp's ``llama-server --embeddings --pooling
mean -np 4 -b 512 -ub 512`` (``scripts/llama-tools`` builds it; without it
its columns read "-"), the same GGUF and threads, one server at a time, the
two alternating round by round (``--repeats``, default 3); inputs/s and
tokens/s (each server's own ``usage.prompt_tokens``), medians. The vectors of
the first round are compared as unit vectors (llama-server normalises its
own): the largest difference of any component.

**The streams' gaps.** Three greedy completions stream (``/v1/completions``,
SSE) while a 512-input embedding request runs on the same wsserver: each
stream's worst gap between two pieces while the request runs, against its
median gap before it started, once per round. llama-server started with
``--embeddings`` serves embeddings only, and without it answers
``/v1/embeddings`` with an error (its status is recorded): it cannot be
measured the same way on one server.

``--quick`` (a smoke run): 1, 8 and 32 short inputs and 2 long ones cut to
300 characters, one round, wsserver only.

Run it on a quiet machine (nothing else running): llama.cpp's threads
collapse when the cores are oversubscribed. ``python -m bench.embeddings``
runs this section alone and prints its part of docs/benchmarks.md
(``--json PATH`` keeps the result); the harness's ``--merge`` puts it in
docs/benchmarks.json and the report.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from .contenders import SseContender
from .figures import TIMES, fmt, target, target_rows
from .freeze import WORST_GAP_MS
from .options import Options
from .servers import llama_model, llama_server, llama_wsserver, tools_for
from .timing import median, ratio

SHORT = "The quick brown fox jumps over the lazy dog, number {i}."
LONG = " ".join(
    f"Sentence {j} of document {{i}} talks about local language models." for j in range(36)
)  # ~400 tokens on the default model
PROMPT = "Once upon a time, in a village by the sea, there lived"
N_CTX = 2048
PARALLEL = 4
#: The request the streams' gaps are measured beside: its count of short inputs.
BESIDE = 512
#: ``llama-server --embeddings`` as the comparison runs it (threads, context, slots added).
PEER_ARGS = ("--embeddings", "--pooling", "mean", "-b", 512, "-ub", 512)
TIMEOUT = aiohttp.ClientTimeout(total=600)


def workloads(quick: bool, long_chars: int = 0) -> dict[str, list[str]]:
    """Name → inputs: the full run's four, or the smoke run's smaller ones;
    ``long_chars``: the long inputs cut to that many characters (a tiny
    model's tokenizer makes far more tokens of them)."""
    shorts = (1, 8, 32) if quick else (1, 32, 512)
    out = {f"{n} short": [SHORT.format(i=i) for i in range(n)] for n in shorts}
    cut = long_chars or (300 if quick else 0)
    longs = [LONG.format(i=i)[: cut or None] for i in range(2 if quick else 8)]
    out[f"{len(longs)} long"] = longs
    return out


def _unit(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.asarray(vectors / np.where(norms == 0, 1.0, norms))


async def embed(session: aiohttp.ClientSession, base: str, inputs: list[str]) -> dict[str, Any]:
    """One ``POST /v1/embeddings``: inputs/s, tokens/s and the vectors."""
    started = time.perf_counter()
    async with session.post(
        base + "/v1/embeddings", json={"input": inputs, "encoding_format": "float"}
    ) as response:
        head = time.perf_counter()
        raw = await response.read()
    end = time.perf_counter()
    elapsed = end - started
    body = json.loads(raw)
    if response.status != 200:
        raise RuntimeError(f"{base}: {response.status} {body}")
    tokens = int(body["usage"]["prompt_tokens"])
    vectors = np.array([d["embedding"] for d in body["data"]], dtype=np.float64)
    return {
        "s": elapsed,
        "inputs_s": len(inputs) / elapsed,
        "tokens_s": tokens / elapsed,
        "tokens": tokens,
        "vectors": vectors,
        # From the answer's head to its last byte (a send buffer smaller than
        # two segments took seconds here on loopback: WholeAnswerBuffer).
        "body_ms": 1000 * (end - head),
    }


async def _stream(port: int, arrivals: list[float], started: asyncio.Event) -> None:
    """A greedy completion streamed over SSE, each piece's arrival kept;
    ``started`` is set after 20 pieces (or when the stream ends early)."""
    stream = await SseContender("wsserver", port, usage=False).open(PROMPT, 1000)
    try:
        async for event in stream.events():
            if any(choice.get("text") for choice in event.get("choices") or []):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 20:
                    started.set()
    finally:
        await stream.close()
        started.set()  # also a stream that ended early: the others go on


async def gaps_beside(base: str, inputs: list[str]) -> dict[str, Any]:
    """Three streams on ``base``; once each has 20 pieces, ``inputs`` embedded
    there; the streams' worst gap during the request and their median gap
    before it (None where a stream had no gap on one side)."""
    port = urlsplit(base).port
    assert port is not None, base
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        arrivals: list[list[float]] = [[], [], []]
        ready = [asyncio.Event() for _ in arrivals]
        tasks = [
            asyncio.create_task(_stream(port, a, e)) for a, e in zip(arrivals, ready, strict=True)
        ]
        await asyncio.gather(*(e.wait() for e in ready))
        begin = time.perf_counter()
        body = {"input": inputs, "encoding_format": "float"}
        async with session.post(base + "/v1/embeddings", json=body) as response:
            raw = await response.read()
        end = time.perf_counter()
        await asyncio.gather(*tasks)
    # Parsed once the streams are timed: 512 float vectors are ~4 MB of JSON,
    # and parsing them on this loop (as embed() does) stalls the clock that
    # stamps the streams' pieces — a gap of the client's, not the server's
    # (seen: worst gaps of 245-459 ms measured that way).
    answer = json.loads(raw)
    if response.status != 200 or len(answer.get("data") or ()) != len(inputs):
        raise RuntimeError(f"{base}: {response.status} {raw[:200]!r}")
    worst, typical = [], []
    for times in arrivals:
        before = [b - a for a, b in itertools.pairwise(times) if b < begin]
        during = [b - a for a, b in itertools.pairwise(times) if a < end and b > begin]
        if before and during:
            typical.append(median(before))
            worst.append(max(during))
    return {
        "inputs": len(inputs),
        "embed_s": end - begin,
        "worst_gap_ms": 1000 * max(worst) if worst else None,
        "median_gap_ms": 1000 * m if (m := median(typical)) is not None else None,
    }


async def _throughput(base: str, loads: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Every workload once on one server (after a warm-up)."""
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        await embed(session, base, ["warm up"])
        return {name: await embed(session, base, inputs) for name, inputs in loads.items()}


async def _plain_status(binary: Path, model: str, threads: int) -> int:
    """What a llama-server started without ``--embeddings`` answers to ``/v1/embeddings``."""
    args = ("-t", threads, "-c", N_CTX, "-np", PARALLEL)
    async with llama_server(binary, model, *args) as plain, aiohttp.ClientSession() as session:
        async with session.post(plain.url + "/v1/embeddings", json={"input": ["x"]}) as response:
            return response.status


async def run(opts: Options, long_chars: int = 0) -> dict[str, Any]:
    model = llama_model(opts)
    threads = opts.n_threads
    tools = await tools_for(opts)
    loads = workloads(opts.quick, long_chars)
    rounds = 1 if opts.quick else (opts.repeats or 3)
    ours = llama_wsserver(model, threads=threads, parallel=PARALLEL, n_ctx=N_CTX, unpaced=True)
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {"wsserver": [], "llama-server": []}
    for turn in range(rounds):
        order = ["wsserver", "llama-server"] if turn % 2 == 0 else ["llama-server", "wsserver"]
        for name in order:
            if name == "llama-server" and tools is None:
                continue
            opts.log(f"  embeddings, round {turn + 1}/{rounds}: {name}")
            if name == "wsserver":
                async with ours:
                    got = await _throughput(ours.http.rstrip("/"), loads)
            else:
                assert tools is not None
                args = ("-t", threads, "-c", N_CTX, "-np", PARALLEL, *PEER_ARGS)
                async with llama_server(tools / "llama-server", model, *args) as peer:
                    got = await _throughput(peer.url, loads)
            runs[name].append(got)
    rows = []
    for name, inputs in loads.items():
        row: dict[str, Any] = {"workload": name, "inputs": len(inputs)}
        for side, key in (("wsserver", "ours"), ("llama-server", "peer")):
            done = [r[name] for r in runs[side]]
            row[key] = (
                {
                    "inputs_s": median(r["inputs_s"] for r in done),
                    "tokens_s": median(r["tokens_s"] for r in done),
                    "tokens": done[0]["tokens"],
                    "rounds_inputs_s": [r["inputs_s"] for r in done],
                    "body_ms": median(r["body_ms"] for r in done),
                }
                if done
                else None
            )
        row["ratio"] = ratio(
            (row["ours"] or {}).get("inputs_s"), (row["peer"] or {}).get("inputs_s")
        )
        if runs["llama-server"]:
            a, b = runs["wsserver"][0][name]["vectors"], runs["llama-server"][0][name]["vectors"]
            row["max_unit_diff"] = float(np.abs(_unit(a) - _unit(b)).max())
        else:
            row["max_unit_diff"] = None
        rows.append(row)
    beside = [SHORT.format(i=i) for i in range(32 if opts.quick else BESIDE)]
    gaps = []
    async with ours:
        base = ours.http.rstrip("/")
        for turn in range(rounds):
            opts.log(f"  three streams beside {len(beside)} inputs, round {turn + 1}/{rounds}")
            gaps.append(await gaps_beside(base, beside))
    plain = None if tools is None else await _plain_status(tools / "llama-server", model, threads)
    return {
        "status": "ok",
        "threads": threads,
        "model": Path(model).name,
        "rounds": rounds,
        "rows": rows,
        "gaps": gaps,
        "plain_llama_server_embeddings_status": plain,
    }


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 37's targets: inputs/s at least llama-server's, for each
    workload; and beside the streams their bound holds — the one they keep
    beside a prompt (section 15's, :data:`.freeze.WORST_GAP_MS`), worst of
    every round."""
    worst = _worst_gaps(result)
    inputs = result["gaps"][0]["inputs"] if result["gaps"] else BESIDE
    return [
        *_throughput_targets(result),
        target(
            f"embeddings: three streams' worst gap <= {WORST_GAP_MS:g} ms beside "
            f"{inputs} inputs (every round)",
            max(worst) if worst else None,
            lambda v: v <= WORST_GAP_MS,
            "{:,.0f} ms",
        ),
    ]


def _throughput_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        target(
            f"embeddings, {r['workload']}: inputs/s >= 1.0{TIMES} llama-server's",
            r["ratio"],
            lambda v: v >= 1.0,
            f"{{:,.2f}}{TIMES}",
            missing="not measured",
        )
        for r in result["rows"]
    ]


def _worst_gaps(result: dict[str, Any]) -> list[float]:
    return [g["worst_gap_ms"] for g in result["gaps"] if g["worst_gap_ms"] is not None]


def _span(values: list[float], digits: int = 0, unit: str = "") -> str:
    """``low`` to ``high`` with an en dash (``low`` alone when they are equal; ``-`` for none)."""
    if not values:
        return "-"
    low, high = fmt(min(values), digits), fmt(max(values), digits)
    return (low if low == high else f"{low}\u2013{high}") + unit


def headlines(result: dict[str, Any]) -> list[str]:
    ratios = " / ".join(fmt(r["ratio"], 2, TIMES) for r in result["rows"])
    names = ", ".join(r["workload"] for r in result["rows"])
    return [
        f"| embeddings vs llama-server `--embeddings` (section 18) | {names} inputs: {ratios} "
        f"llama-server's inputs/s; three streams beside {result['gaps'][0]['inputs']} inputs: "
        f"worst gap {_span(_worst_gaps(result), 0, ' ms')} |"
    ]


def render(result: dict[str, Any]) -> str:
    lines = [
        f"`{result['model']}`, {result['threads']} thread(s) each. wsserver ({PARALLEL} slots, "
        "its defaults otherwise) and `llama-server --embeddings --pooling mean "
        f"-np {PARALLEL} -b 512 -ub 512`, one server at a time, alternating round by round; "
        "`POST /v1/embeddings` with float vectors, each server's own `usage.prompt_tokens`; "
        f"medians of {result['rounds']} round(s). The vectors of the first round are compared "
        "as unit vectors (llama-server normalises its own).",
        "",
        "| inputs | wsserver inputs/s | llama-server inputs/s | **ratio** | wsserver tokens/s "
        "| llama-server tokens/s | answer's body, head to last byte: ms, wsserver / llama-server "
        "| max \\|Δ\\| of unit vectors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        ours, peer = r["ours"] or {}, r["peer"] or {}
        diff = "-" if r["max_unit_diff"] is None else f"{r['max_unit_diff']:.1e}"
        lines.append(
            f"| {r['workload']} | {fmt(ours.get('inputs_s'))} | {fmt(peer.get('inputs_s'))} "
            f"| **{fmt(r['ratio'], 2, TIMES)}** | {fmt(ours.get('tokens_s'), 0)} "
            f"| {fmt(peer.get('tokens_s'), 0)} "
            f"| {fmt(ours.get('body_ms'), 0)} / {fmt(peer.get('body_ms'), 0)} | {diff} |"
        )
    if all(r["peer"] is None for r in result["rows"]):
        lines += ["", "llama-server: not measured (run scripts/llama-tools once)."]
    lines += ["", "| target | result | met |", "|---|---|:-:|", *target_rows(targets(result))]
    plain = result.get("plain_llama_server_embeddings_status")
    lines += [
        "",
        f"**Three streams decoding while {result['gaps'][0]['inputs']} short inputs are "
        "embedded** (wsserver; the streams unpaced, each gap between two of a stream's "
        "pieces over SSE; one row a round). llama-server cannot be measured the same way: "
        "started with `--embeddings` it serves embeddings only"
        + (f", and without it answered `/v1/embeddings` with {plain}" if plain is not None else "")
        + " — a front end needs two servers, and neither schedules one against the other.",
        "",
        "| round | streams' median gap (ms) | **streams' worst gap (ms)** | the request took (s) |",
        "|---:|---:|---:|---:|",
    ]
    for i, g in enumerate(result["gaps"], 1):
        lines.append(
            f"| {i} | {fmt(g['median_gap_ms'])} | **{fmt(g['worst_gap_ms'], 0)}** "
            f"| {fmt(g['embed_s'], 2)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.embeddings", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="GGUF (default: the default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run (see above)")
    parser.add_argument(
        "--long-chars",
        type=int,
        default=0,
        help="cut the long inputs (a smoke run on a tiny model)",
    )
    parser.add_argument("--json", type=Path, help="write the section's result here")
    args = parser.parse_args(argv)
    opts = Options(quick=args.quick, model=args.model, threads=args.threads, repeats=args.rounds)
    result = asyncio.run(run(opts, args.long_chars))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
