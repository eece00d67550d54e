"""Ollama's chat beside the OpenAI chat on the same server (fake backend).

    python -m bench.ollama_wire [--rounds 200]

One server runs the fake backend at an unlimited rate (no model: what is
measured is the server's own work) in its own process. Rounds alternate
between the two wires, on a fresh HTTP connection each:

* **OpenAI** — ``POST /v1/chat/completions`` streamed as SSE;
* **Ollama** — ``POST /api/chat`` streamed as newline-delimited JSON;

each with the same messages: **TTFT** (request sent → first text, 8 tokens
asked) and **throughput** (2,000 tokens: completion tokens — the usage chunk,
``eval_count`` — over the time from the first text to the end). Medians and
p90/p10 are printed as a Markdown table, with Ollama's added TTFT and its
throughput as a fraction of OpenAI's (the issue's targets: ≤ 1 ms, ≥ 0.98x).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from .servers import ServerProcess
from .timing import LineRead, percentile, side_by_side, streamed_post

now = time.perf_counter
MESSAGES = [{"role": "user", "content": "ab"}]
_TOKENS = {"ttft": 8, "tokens_per_s": 2000}


def _chat_line(line: bytes) -> tuple[bool, int | None]:
    """An OpenAI chat stream's line: a content chunk, or the usage chunk."""
    import orjson

    if not line.startswith(b"data: {"):
        return False, None
    chunk = orjson.loads(line[6:])
    if chunk.get("usage"):
        return False, chunk["usage"]["completion_tokens"]
    return bool(chunk["choices"][0]["delta"].get("content")), None


def _ollama_line(line: bytes) -> tuple[bool, int | None]:
    """An Ollama chat object: content, or the last one's ``eval_count``."""
    import orjson

    obj = orjson.loads(line)
    if obj["done"]:
        return False, obj["eval_count"]
    return bool(obj["message"]["content"]), None


async def _openai(base: str) -> dict[str, float]:
    bodies = {
        key: {
            "model": "fake",
            "messages": MESSAGES,
            "max_tokens": tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for key, tokens in _TOKENS.items()
    }
    return await _round(f"{base}v1/chat/completions", bodies, _chat_line)


async def _ollama(base: str) -> dict[str, float]:
    bodies = {
        key: {"model": "fake", "messages": MESSAGES, "options": {"num_predict": tokens}}
        for key, tokens in _TOKENS.items()
    }
    return await _round(f"{base}api/chat", bodies, _ollama_line)


async def _round(url: str, bodies: dict[str, Any], read: LineRead) -> dict[str, float]:
    """TTFT from the short answer, throughput from the long one."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        ttft, _ = await streamed_post(http, url, bodies["ttft"], read)
        _, tokens_per_s = await streamed_post(http, url, bodies["tokens_per_s"], read)
    return {"ttft_ms": 1000 * ttft, "tokens_per_s": tokens_per_s}


async def main(rounds: int) -> None:
    server = ServerProcess({"backend.kind": "fake", "backend.fake.tokens_per_s": 0.0})
    async with server:
        base = server.http
        contenders: dict[str, Any] = {
            "OpenAI chat (SSE)": lambda _: _openai(base),
            "Ollama chat (NDJSON)": lambda _: _ollama(base),
        }
        runs = await side_by_side(rounds, contenders, order="flip", skip=min(10, rounds // 10))
    print(f"{rounds} rounds, alternating, one server (fake backend, unlimited rate)\n")
    print("| wire | TTFT median / p90 (ms) | tokens/s median / p10 |")
    print("|---|---:|---:|")
    medians: dict[str, tuple[float, float]] = {}
    for name, got in runs.items():
        ttft = [r["ttft_ms"] for r in got]
        tps = [r["tokens_per_s"] for r in got]
        medians[name] = (statistics.median(ttft), statistics.median(tps))
        print(
            f"| {name} | {medians[name][0]:.2f} / {percentile(ttft, 90):.2f} | "
            f"{medians[name][1]:,.0f} / {percentile(tps, 10):,.0f} |"
        )
    (openai_ttft, openai_tps), (ollama_ttft, ollama_tps) = medians.values()
    print(
        f"\nOllama: TTFT {ollama_ttft - openai_ttft:+.2f} ms, "
        f"throughput x{ollama_tps / openai_tps:.3f} of OpenAI's (medians)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.ollama_wire", description=__doc__)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.rounds))
