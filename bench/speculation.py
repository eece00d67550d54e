"""Speculative decoding beside llama-server's n-gram modes (issue 40): decode tok/s.

    python -m bench.speculation [--rounds 3] [--model GGUF] [--threads 2]

Two greedy completions (``POST /v1/completions``, SSE, ``max_tokens`` 300) on
the default model: **copy** — a ~400-token code listing, then its first lines
again with a name changed, so the continuation repeats the listing (the
work of code edits, rewrites and agents quoting their inputs) — and
**prose**, a story's opening, where n-grams rarely repeat. Contenders, one
server at a time, alternating round by round: wsserver with speculation
(its default), wsserver with it off, llama-server with no speculation and
with ``--spec-type ngram-simple``, ``ngram-map-k`` and ``ngram-cache`` (its
defaults otherwise; ``scripts/llama-tools`` builds it). The decode rate is
the completion's tokens after the first over the time from the first piece
to the last (each server's own ``usage.completion_tokens``); medians.

Run it on a quiet machine (nothing else running).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import aiohttp

from .contenders import llama_completion
from .servers import Child, ServerProcess, default_model, llama_overrides, llama_server_binary

FUNCTION = '''def {name}(items, tax_rate, discount=None):
    """Return the total price of the items, with tax and an optional discount."""
    subtotal = 0.0
    for item in items:
        price = item["price"] * item.get("quantity", 1)
        if item.get("taxable", True):
            price = price * (1.0 + tax_rate)
        subtotal += price
    if discount is not None:
        if discount.get("kind") == "percent":
            subtotal = subtotal * (1.0 - discount["value"] / 100.0)
        elif discount.get("kind") == "fixed":
            subtotal = max(0.0, subtotal - discount["value"])
    return round(subtotal, 2)

'''
LISTING = "".join(FUNCTION.format(name=n) for n in ("order_total", "cart_total", "invoice_total"))
COPY = (
    "# prices.py\n\n"
    + LISTING
    + "\n# prices.py, with order_total renamed to compute_total\n\n"
    + FUNCTION.format(name="compute_total").split("\n")[0]
    + "\n"
)
PROSE = (
    "Once upon a time, in a village by the sea, there lived an old fisherman and his "
    "granddaughter. Every morning before dawn they"
)
PROMPTS = {"copy": COPY, "prose": PROSE}
MAX_TOKENS = 300


async def complete_peer(port: int, prompt: str) -> dict[str, Any]:
    """llama-server's own ``/completion`` (its timings count the tokens)."""
    body = {"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0, "cache_prompt": False}
    stream = await llama_completion(port, body)
    tokens = int(stream.final["timings"]["predicted_n"])
    assert stream.first is not None and stream.last is not None and tokens > 1
    return {
        "tok/s": (tokens - 1) / (stream.last - stream.first),
        "tokens": tokens,
        "text": stream.text,
    }


async def complete(session: aiohttp.ClientSession, base: str, prompt: str) -> dict[str, Any]:
    body = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first = last = None
    tokens = 0
    text = []
    async with session.post(base + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{base}: {response.status} {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    assert first is not None and last is not None and tokens > 1
    return {"tok/s": (tokens - 1) / (last - first), "tokens": tokens, "text": "".join(text)}


def contenders(model: str, threads: int, on: dict[str, Any]) -> dict[str, Any]:
    binary = llama_server_binary()
    base = [str(binary), "-m", model, "--host", "127.0.0.1", "-t", str(threads), "-c", "16384"]

    def ours(extra: dict[str, Any]) -> ServerProcess:
        return ServerProcess(
            llama_overrides(model, threads=threads, parallel=4, n_ctx=4096, unpaced=True, **extra)
        )

    return {
        "wsserver (speculation, default)": lambda: ours(on),
        "wsserver (speculation off)": lambda: ours({"backend.llama.speculative": "off"}),
        "llama-server (none)": lambda: Child("llama-server", base),
        "llama-server ngram-simple": lambda: Child(
            "llama-server", [*base, "--spec-type", "ngram-simple"]
        ),
        "llama-server ngram-map-k": lambda: Child(
            "llama-server", [*base, "--spec-type", "ngram-map-k"]
        ),
        "llama-server ngram-cache": lambda: Child(
            "llama-server", [*base, "--spec-type", "ngram-cache"]
        ),
    }


async def main(rounds: int, model: str, threads: int, only: str = "") -> None:
    makers = {n: m for n, m in contenders(model, threads, {}).items() if only in n}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in makers}
    for turn in range(rounds):
        names = list(makers) if turn % 2 == 0 else list(reversed(makers))
        for name in names:
            server = makers[name]()
            async with server:
                if not isinstance(server, ServerProcess):
                    await complete_peer(server.port, "Warm up:")
                    for kind, prompt in PROMPTS.items():
                        got_peer = await complete_peer(server.port, prompt)
                        results[name].setdefault(kind, []).append(got_peer)
                else:
                    base = server.http.rstrip("/")
                    async with aiohttp.ClientSession(
                        timeout=aiohttp.ClientTimeout(total=600)
                    ) as session:
                        await complete(session, base, "Warm up:")
                        for kind, prompt in PROMPTS.items():
                            got_ours = await complete(session, base, prompt)
                            results[name].setdefault(kind, []).append(got_ours)
            got = {k: round(v[-1]["tok/s"], 1) for k, v in results[name].items()}
            print(f"round {turn + 1}/{rounds}: {name}: {got}", flush=True)
    print(f"\n{rounds} rounds, one server at a time, alternating; {threads} threads; {model}\n")
    off = "wsserver (speculation off)"
    print(
        "| contender | copy tok/s | copy vs our off | prose tok/s | prose vs our off | copy text = ours off |"
    )
    print("|---|---:|---:|---:|---:|:-:|")
    med = {
        n: {k: statistics.median(r["tok/s"] for r in v) for k, v in by.items()}
        for n, by in results.items()
    }
    for name, by in results.items():
        same = by["copy"][0]["text"] == results[off]["copy"][0]["text"]
        print(
            f"| {name} | {med[name]['copy']:.1f} | x{med[name]['copy'] / med[off]['copy']:.2f} "
            f"| {med[name]['prose']:.1f} | x{med[name]['prose'] / med[off]['prose']:.2f} | {'yes' if same else 'no'} |"
        )
    print("\nour copy text (first round):\n" + results[off]["copy"][0]["text"][:600])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="only the contenders whose name has this")
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.model or default_model(), args.threads, args.only))
