"""The WebSocket and HTTP paths, this checkout against another, side by side (fake backend).

    python -m bench.ab_ws --baseline /tmp/base [--rounds 200]

Both servers run the fake backend (no model, so what is measured is the
server's own work) in their own processes, from two checkouts — this one and
``--baseline`` (``git worktree add /tmp/base COMMIT``). Rounds alternate
between them, so load on a shared machine hits both alike. Per round and
server, over a fresh WebSocket connection:

* **TTFT** — ``generate`` sent → first ``delta`` (fake at unlimited rate);
* **throughput** — 2,000 tokens at unlimited rate, tokens / (done - first delta);
* **cancel** — after the first ``delta`` of a long request at 200 tokens/s,
  ``cancel`` sent → ``done`` (reason ``cancelled``) received;
* the same **TTFT** and **throughput** over the OpenAI HTTP API
  (``POST /v1/completions`` streamed as SSE, on a fresh HTTP connection):
  request sent → first text chunk, and completion tokens (from the usage
  chunk) over the time from the first chunk to ``[DONE]``;
* and over the Responses API both ways: ``POST /v1/responses`` streamed as
  SSE, and its WebSocket mode (``response.create`` on a fresh
  ``/v1/responses`` socket): request sent → first
  ``response.output_text.delta``, and output tokens (``response.completed``'s
  usage) over the time from that delta to its last event.

Medians and p90 are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from pathlib import Path
from typing import Any

from .common import ROOT
from .servers import ServerProcess, running
from .timing import percentile, side_by_side, streamed_post

now = time.perf_counter
_HTTP = ("http_ttft_ms", "http_tokens_per_s")
_RESPONSES = ("rh_ttft_ms", "rh_tokens_per_s", "rw_ttft_ms", "rw_tokens_per_s")
_TOKENS = {"ttft": 8, "tokens_per_s": 2000}
#: A response's last event: completed, or incomplete at max_output_tokens.
_ENDS = ("response.completed", "response.incomplete")


async def _round(url: str) -> dict[str, float]:
    from wsserver_client import Client

    out: dict[str, float] = {}
    async with Client(url) as client:
        t0 = now()
        stream = client.generate(prompt="ab", max_tokens=8)
        async for _ in stream:
            out["ttft_ms"] = 1000 * (now() - t0)
            break
        await stream.result()
        stream = client.generate(prompt="tp", max_tokens=2000)
        first = None
        async for _ in stream:
            if first is None:
                first = now()
        assert first is not None and stream.done is not None
        out["tokens_per_s"] = stream.done.usage.completion_tokens / max(now() - first, 1e-9)
    return out


def _completion_line(line: bytes) -> tuple[bool, int | None]:
    """An OpenAI completion stream's line: a text chunk, or the usage chunk."""
    import orjson

    if not line.startswith(b"data: {"):
        return False, None
    chunk = orjson.loads(line[6:])
    if chunk.get("usage"):
        return False, chunk["usage"]["completion_tokens"]
    return True, None


def _responses_line(line: bytes) -> tuple[bool, int | None]:
    """A Responses stream's line: a text delta, or the last event's usage."""
    import orjson

    if not line.startswith(b"data: {"):
        return False, None
    event = orjson.loads(line[6:])
    if event["type"] in _ENDS:
        return False, event["response"]["usage"]["output_tokens"]
    return event["type"] == "response.output_text.delta", None


async def _http_round(url: str) -> dict[str, float]:
    """``POST /v1/completions`` streamed: TTFT and throughput (SSE chunks)."""
    import aiohttp

    base = url.replace("ws://", "http://").rstrip("/")
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        for key, tokens in _TOKENS.items():
            body = {
                "model": "fake",  # the fake backend's model
                "prompt": "ab",
                "max_tokens": tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            got = await streamed_post(http, f"{base}/v1/completions", body, _completion_line)
            _store(out, "http", key, got)
    return out


async def _responses_http_round(url: str) -> dict[str, float]:
    """``POST /v1/responses`` streamed: TTFT and throughput (SSE events)."""
    import aiohttp

    base = url.replace("ws://", "http://").rstrip("/")
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        for key, tokens in _TOKENS.items():
            body = {"model": "fake", "input": "ab", "max_output_tokens": tokens, "stream": True}
            got = await streamed_post(http, f"{base}/v1/responses", body, _responses_line)
            _store(out, "rh", key, got)
    return out


def _store(out: dict[str, float], wire: str, key: str, got: tuple[float, float]) -> None:
    """One round's figure: TTFT (ms) from the short answer, tokens/s from the long one."""
    if key == "ttft":
        out[f"{wire}_ttft_ms"] = 1000 * got[0]
    else:
        out[f"{wire}_tokens_per_s"] = got[1]


async def _responses_ws_round(url: str) -> dict[str, float]:
    """The Responses API's WebSocket mode: TTFT and throughput (one message an event)."""
    import orjson
    from websockets.asyncio.client import connect

    out: dict[str, float] = {}
    async with connect(url.rstrip("/") + "/v1/responses", compression=None) as ws:
        for key, tokens in _TOKENS.items():
            create = {"type": "response.create", "input": "ab", "max_output_tokens": tokens}
            t0 = now()
            await ws.send(orjson.dumps(create).decode())
            first: float | None = None
            while True:
                event = orjson.loads(await ws.recv())
                if event["type"] == "response.output_text.delta" and first is None:
                    first = now()
                elif event["type"] in _ENDS:
                    output = event["response"]["usage"]["output_tokens"]
                    break
                assert event["type"] != "error", event
            assert first is not None and output
            _store(out, "rw", key, (first - t0, output / max(now() - first, 1e-9)))
    return out


async def _cancel_round(url: str) -> float:
    from wsserver_client import Client

    async with Client(url) as client:
        stream = client.generate(prompt="cancel", max_tokens=4000)
        async for _ in stream:
            break
        t0 = now()
        done = await stream.cancel()
        assert done is not None and done.reason == "cancelled"
        return 1000 * (now() - t0)


async def _measure(server: ServerProcess, paced: ServerProcess, _: int) -> dict[str, float]:
    """One round on one checkout: WebSocket TTFT and throughput, cancel, then
    HTTP (SSE), then the Responses API over HTTP and in WebSocket mode."""
    figures = await _round(server.url)
    figures["cancel_ms"] = await _cancel_round(paced.url)
    figures.update(await _http_round(server.url))
    figures.update(await _responses_http_round(server.url))
    return {**figures, **await _responses_ws_round(server.url)}


async def main(baseline: Path, rounds: int) -> None:
    trees = {"this checkout": ROOT, "baseline": baseline}
    servers = {
        (name, rate): ServerProcess(
            {"backend.kind": "fake", "backend.fake.tokens_per_s": rate},
            name="paced" if rate else "wsserver",
            root=root,
        )
        for rate in (0.0, 200.0)
        for name, root in trees.items()
    }
    async with running(servers) as up:
        contenders = {n: functools.partial(_measure, up[n, 0.0], up[n, 200.0]) for n in trees}
        runs = await side_by_side(rounds, contenders, order="flip")
    samples = {
        n: {
            k: [r[k] for r in got]
            for k in ("ttft_ms", "tokens_per_s", "cancel_ms", *_HTTP, *_RESPONSES)
        }
        for n, got in runs.items()
    }
    print(f"{rounds} rounds, alternating; baseline = {baseline}, this checkout = {ROOT}\n")
    print(
        "| server | TTFT median / p90 (ms) | tokens/s median / p10 | cancel → done median / p90 (ms) |"
    )
    print("|---|---:|---:|---:|")
    for name, s in samples.items():
        print(
            f"| {name} | {statistics.median(s['ttft_ms']):.2f} / {_p(s['ttft_ms'], 90):.2f} | "
            f"{statistics.median(s['tokens_per_s']):,.0f} / {_p(s['tokens_per_s'], 10):,.0f} | "
            f"{statistics.median(s['cancel_ms']):.2f} / {_p(s['cancel_ms'], 90):.2f} |"
        )
    for title, wire in (
        ("The OpenAI HTTP API (completions, SSE)", "http"),
        ("The Responses API over HTTP (SSE)", "rh"),
        ("The Responses API's WebSocket mode", "rw"),
    ):
        print(f"\n{title}:\n")
        print("| server | TTFT median / p90 (ms) | tokens/s median / p10 |")
        print("|---|---:|---:|")
        for name, s in samples.items():
            ttft, tps = s[f"{wire}_ttft_ms"], s[f"{wire}_tokens_per_s"]
            print(
                f"| {name} | {statistics.median(ttft):.2f} / {_p(ttft, 90):.2f} | "
                f"{statistics.median(tps):,.0f} / {_p(tps, 10):,.0f} |"
            )


def _p(values: list[float], q: float) -> Any:
    return percentile(values, q)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.ab_ws", description=__doc__)
    parser.add_argument("--baseline", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.baseline, args.rounds))
