"""Embeddings beside llama-server ``--embeddings`` (issue 37): throughput, and the streams' gaps.

    python -m bench.embeddings [--rounds 3] [--model GGUF] [--threads 2]

**Throughput.** ``POST /v1/embeddings`` (floats) of 1, 32 and 512 short
inputs and of 8 long ones (~400 tokens each), on wsserver and on llama.cpp's
``llama-server --embeddings --pooling mean`` (``scripts/llama-tools``), the
same GGUF and threads, one server at a time, the two alternating round by
round; inputs/s and tokens/s (each server's own ``usage.prompt_tokens``),
medians. The vectors of the first round are compared (max |difference|).

**The streams' gaps.** Three greedy completions stream (``/v1/completions``,
SSE) while a 512-input embedding request runs: each stream's worst gap
between two pieces while the request runs, against its median gap
before it started. llama-server started with ``--embeddings`` serves
embeddings only (it refuses completions), so it is measured with the
completions on one llama-server and nothing shared — the section says so.

Run it on a quiet machine (nothing else running): llama.cpp's threads
collapse when the cores are oversubscribed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import time
from typing import Any

import aiohttp
import numpy as np

from .servers import Child, ServerProcess, default_model, llama_overrides, llama_server_binary

SHORT = "The quick brown fox jumps over the lazy dog, number {i}."
LONG = " ".join(
    f"Sentence {j} of document {{i}} talks about local language models." for j in range(36)
)  # ~400 tokens on the default model
WORKLOADS = {
    "1 short": [SHORT.format(i=0)],
    "32 short": [SHORT.format(i=i) for i in range(32)],
    "512 short": [SHORT.format(i=i) for i in range(512)],
    "8 long": [LONG.format(i=i) for i in range(8)],
}
PROMPT = "Once upon a time, in a village by the sea, there lived"


def _unit(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.asarray(vectors / np.where(norms == 0, 1.0, norms))


async def embed(session: aiohttp.ClientSession, base: str, inputs: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    async with session.post(
        base + "/v1/embeddings", json={"input": inputs, "encoding_format": "float"}
    ) as response:
        body = await response.json()
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise RuntimeError(f"{base}: {response.status} {body}")
    tokens = int(body["usage"]["prompt_tokens"])
    vectors = np.array([d["embedding"] for d in body["data"]], dtype=np.float64)
    return {
        "s": elapsed,
        "inputs/s": len(inputs) / elapsed,
        "tokens/s": tokens / elapsed,
        "tokens": tokens,
        "vectors": vectors,
    }


async def stream(
    session: aiohttp.ClientSession, base: str, arrivals: list[float], started: asyncio.Event
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}
    try:
        await _stream(session, base, body, arrivals, started)
    finally:
        started.set()  # also a stream that ended early: the others go on


async def _stream(
    session: aiohttp.ClientSession,
    base: str,
    body: dict[str, Any],
    arrivals: list[float],
    started: asyncio.Event,
) -> None:
    async with session.post(base + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{base}: {response.status} {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 20:
                    started.set()


async def gaps_beside(base_streams: str, base_embed: str) -> dict[str, float]:
    """Three streams on ``base_streams``; once each has 20 pieces, 512 inputs
    on ``base_embed``; each stream's worst gap during the request and its
    median gap before."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        arrivals: list[list[float]] = [[], [], []]
        ready = [asyncio.Event() for _ in arrivals]
        tasks = [
            asyncio.create_task(stream(session, base_streams, a, e))
            for a, e in zip(arrivals, ready, strict=True)
        ]
        await asyncio.gather(*(e.wait() for e in ready))
        begin = time.perf_counter()
        result = await embed(session, base_embed, WORKLOADS["512 short"])
        end = time.perf_counter()
        await asyncio.gather(*tasks)
    worst, median = [], []
    for times in arrivals:
        before = [b - a for a, b in itertools.pairwise(times) if b < begin]
        during = [b - a for a, b in itertools.pairwise(times) if a < end and b > begin]
        if before and during:
            median.append(statistics.median(before))
            worst.append(max(during))
    return {
        "embed_s": result["s"],
        "worst_gap_ms": 1000 * max(worst) if worst else float("nan"),
        "median_gap_ms": 1000 * statistics.median(median) if median else float("nan"),
    }


async def main(rounds: int, model: str, threads: int) -> None:
    binary = llama_server_binary()
    ours = ServerProcess(
        llama_overrides(model, threads=threads, parallel=4, n_ctx=2048, unpaced=True),
        name="wsserver",
    )
    theirs_args = [
        "-t",
        threads,
        "-c",
        2048,
        "-np",
        4,
        "--embeddings",
        "--pooling",
        "mean",
        "-b",
        512,
        "-ub",
        512,
    ]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {"wsserver": {}, "llama-server": {}}
    for turn in range(rounds):
        order = ["wsserver", "llama-server"] if turn % 2 == 0 else ["llama-server", "wsserver"]
        for name in order:
            server: Any = (
                ours
                if name == "wsserver"
                else Child(
                    "llama-server",
                    [str(binary), "-m", model, "--host", "127.0.0.1", *map(str, theirs_args)],
                )
            )
            async with server:
                base = (server.http if name == "wsserver" else server.url).rstrip("/")
                async with aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=600)
                ) as session:
                    await embed(session, base, ["warm up"])
                    for workload, inputs in WORKLOADS.items():
                        got = await embed(session, base, inputs)
                        results[name].setdefault(workload, []).append(got)
            print(f"round {turn + 1}/{rounds}: {name} done", flush=True)
    print(f"\n{rounds} rounds, one server at a time, alternating; {threads} threads; {model}\n")
    print(
        "| inputs | wsserver inputs/s | llama-server inputs/s | ratio | wsserver tokens/s | llama-server tokens/s | max |Δ| of unit vectors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for workload in WORKLOADS:
        a, b = results["wsserver"][workload], results["llama-server"][workload]
        ai = statistics.median(r["inputs/s"] for r in a)
        bi = statistics.median(r["inputs/s"] for r in b)
        at = statistics.median(r["tokens/s"] for r in a)
        bt = statistics.median(r["tokens/s"] for r in b)
        # llama-server normalises its vectors (embd_normalize 2), ours are the
        # model's own: compared as unit vectors.
        diff = float(np.abs(_unit(a[0]["vectors"]) - _unit(b[0]["vectors"])).max())
        print(
            f"| {workload} | {ai:,.1f} | {bi:,.1f} | x{ai / bi:.2f} | {at:,.0f} | {bt:,.0f} | {diff:.2e} |"
        )
    print("\nThree streams decoding while 512 short inputs are embedded:\n")
    async with ours:
        gaps = [
            await gaps_beside(ours.http.rstrip("/"), ours.http.rstrip("/")) for _ in range(rounds)
        ]
    print("| server | embed s | streams' worst gap (ms) | their median gap (ms) |")
    print("|---|---:|---:|---:|")
    for g in gaps:
        print(
            f"| wsserver | {g['embed_s']:.2f} | {g['worst_gap_ms']:.0f} | {g['median_gap_ms']:.1f} |"
        )
    plain = Child(
        "llama-server",
        [
            str(binary),
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "-t",
            str(threads),
            "-c",
            "2048",
            "-np",
            "4",
        ],
    )
    async with plain, aiohttp.ClientSession() as session:
        async with session.post(plain.url + "/v1/embeddings", json={"input": ["x"]}) as response:
            print(
                f"\nllama-server without --embeddings answers /v1/embeddings with {response.status}"
                " (it serves completions and embeddings from separate servers):"
                " its streams' gap beside an embedding request cannot be measured on one server."
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.embeddings", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--long-chars",
        type=int,
        default=0,
        help="cut the long inputs (a smoke run on a tiny model)",
    )
    args = parser.parse_args()
    if args.long_chars:
        WORKLOADS["8 long"] = [text[: args.long_chars] for text in WORKLOADS["8 long"]]
    asyncio.run(main(args.rounds, args.model or default_model(), args.threads))
