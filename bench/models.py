"""Section 14 — several models (issue 23): time to first token for a model
already loaded, for one loaded on demand, and for one that first evicts
another; the server's memory before and after an unload.

Two models, the default one (Gemma 3 270M, ~250 MB) and a tiny random GGUF
(``tests/tiny_gguf.py``), served by one wsserver process
(``bench.probe_server``, so RSS is the server's own). The tiny one is the
default model (``backend.llama.model``, loaded at start), Gemma a
``[[backend.llama.models]]`` table named ``gemma`` (loaded on its first
request). TTFT is a WebSocket ``generate`` (a short prompt, 4 tokens) from
send to its first ``delta``, on a connection already open.

* **Room for both** (``models_memory_bytes`` = 0: three quarters of RAM):
  each round asks Gemma while it is unloaded (``keep_alive`` -1: it stays),
  then loaded, then the tiny model (loaded); RSS with both loaded; then a
  Gemma request with ``keep_alive`` 0 unloads it when it ends, and RSS is
  read again once ``GET /v1/models`` says ``unloaded``.
* **Room for one** (the budget = Gemma's estimate + half the tiny one's):
  each round asks Gemma (the tiny model is loaded and idle: it is unloaded
  first, then Gemma loads), then the tiny model (Gemma is unloaded first);
  RSS after each.

Medians over the rounds; every figure of every round is in the JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
from websockets.asyncio.client import ClientConnection

from .common import ROOT
from .options import Options
from .servers import ServerProcess, default_model, llama_overrides
from .wsload import generate_frame, open_connection, timed

N_CTX = 1024
PARALLEL = 2
PROMPT = "The capital of France is"


def _tiny_gguf(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from tiny_gguf import write_tiny_gguf
    finally:
        sys.path.remove(str(ROOT / "tests"))
    path: Path = write_tiny_gguf(folder / "tiny.gguf")
    return path


def _estimate(path: Path) -> int:
    from wsserver.backends.llama import LlamaBackend

    return LlamaBackend(model=str(path), n_ctx=N_CTX, parallel=PARALLEL).memory_estimate()


async def _ttft(ws: ClientConnection, rid: str, model: str | None, **extra: Any) -> float:
    if model is not None:
        extra["model"] = model
    async with asyncio.timeout(600):
        run = await timed(ws, generate_frame(rid, PROMPT, 4, **extra))
    if run.final["reason"] not in ("stop", "length") or run.ttft_ms is None:
        raise RuntimeError(f"{rid}: {run.final}")
    return run.ttft_ms


async def _state(http: aiohttp.ClientSession, base: str, name: str) -> str:
    async with http.get(f"{base}/v1/models") as resp:
        body = await resp.json()
    return str(next(m["state"] for m in body["data"] if m["id"] == name))


async def _until(http: aiohttp.ClientSession, base: str, name: str, state: str) -> None:
    async with asyncio.timeout(120):
        while await _state(http, base, name) != state:
            await asyncio.sleep(0.05)  # sleep-ok: polling the server's own report


async def _unloads(http: aiohttp.ClientSession, base: str, name: str) -> int:
    """``wsserver_model_unloads`` for ``name``: counted once its memory is freed
    (``/v1/models`` already says ``unloaded`` while that runs)."""
    async with http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    match = re.search(
        rf'^wsserver_model_unloads_total{{model="{re.escape(name)}"}} (\S+)', text, re.M
    )
    return int(float(match.group(1))) if match else 0


async def _freed(http: aiohttp.ClientSession, base: str, name: str, before: int) -> None:
    async with asyncio.timeout(120):
        while await _unloads(http, base, name) <= before:
            await asyncio.sleep(0.05)  # sleep-ok: polling the server's own report


@contextlib.asynccontextmanager
async def _serving(overrides: dict[str, Any]) -> Any:
    async with ServerProcess(overrides, start_timeout=600) as server:
        base = server.http.rstrip("/")
        ws = await open_connection(server.url)
        try:
            async with aiohttp.ClientSession() as http:
                yield server, base, http, ws
        finally:
            await ws.close()


async def run(opts: Options) -> dict[str, Any]:
    rounds = 2 if opts.quick else 5
    threads = opts.threads or 2
    gemma = Path(default_model())
    with tempfile.TemporaryDirectory(prefix="bench-models-") as folder:
        tiny = _tiny_gguf(Path(folder))
        estimates = {"gemma": _estimate(gemma), "tiny": _estimate(tiny)}
        models: dict[str, Any] = {"backend.llama.models": [{"name": "gemma", "model": str(gemma)}]}
        base_overrides = llama_overrides(
            str(tiny), threads=threads, parallel=PARALLEL, n_ctx=N_CTX, **models
        )
        both: dict[str, list[float]] = {
            "gemma_on_demand": [],
            "gemma_loaded": [],
            "tiny_loaded": [],
            "rss_both": [],
            "rss_after_unload": [],
        }
        async with _serving(base_overrides) as (server, base, http, ws):
            tiny_name = next(
                m["id"]
                for m in (await (await http.get(f"{base}/v1/models")).json())["data"]
                if m["id"] != "gemma"
            )
            await _ttft(ws, "warm", tiny_name)
            for r in range(rounds):
                await _until(http, base, "gemma", "unloaded")
                both["gemma_on_demand"].append(await _ttft(ws, f"a{r}", "gemma", keep_alive=-1))
                both["gemma_loaded"].append(await _ttft(ws, f"b{r}", "gemma"))
                both["tiny_loaded"].append(await _ttft(ws, f"c{r}", tiny_name))
                both["rss_both"].append((await server.stats())["rss_bytes"])
                unloads = await _unloads(http, base, "gemma")
                await _ttft(ws, f"d{r}", "gemma", keep_alive=0)
                await _freed(http, base, "gemma", unloads)
                both["rss_after_unload"].append((await server.stats())["rss_bytes"])
        budget = estimates["gemma"] + estimates["tiny"] // 2
        one: dict[str, list[float]] = {
            "gemma_evicting": [],
            "tiny_evicting": [],
            "rss_gemma": [],
            "rss_tiny": [],
        }
        async with _serving({**base_overrides, "backend.llama.models_memory_bytes": budget}) as (
            server,
            base,
            http,
            ws,
        ):
            await _ttft(ws, "warm", tiny_name)
            for r in range(rounds):
                unloads = await _unloads(http, base, "gemma")
                one["gemma_evicting"].append(await _ttft(ws, f"e{r}", "gemma"))
                one["rss_gemma"].append((await server.stats())["rss_bytes"])
                one["tiny_evicting"].append(await _ttft(ws, f"f{r}", tiny_name))
                await _freed(http, base, "gemma", unloads)
                one["rss_tiny"].append((await server.stats())["rss_bytes"])
    return {
        "status": "ok",
        "rounds": rounds,
        "threads": threads,
        "estimates": estimates,
        "budget_one": budget,
        "both": both,
        "one": one,
        "median": {
            key: statistics.median(values) for group in (both, one) for key, values in group.items()
        },
    }


def _mib(value: float) -> str:
    return f"{value / (1 << 20):,.1f}"


def headlines(r: dict[str, Any]) -> list[str]:
    m = r["median"]
    return [
        f"| several models (section 14) | TTFT Gemma loaded {m['gemma_loaded']:,.0f} ms, "
        f"on demand {m['gemma_on_demand']:,.0f} ms, after unloading the tiny model "
        f"{m['gemma_evicting']:,.0f} ms; RSS {_mib(m['rss_both'])} MiB with both → "
        f"{_mib(m['rss_after_unload'])} MiB after unloading Gemma |"
    ]


def render(r: dict[str, Any]) -> str:
    m = r["median"]
    est = r["estimates"]
    lines = [
        f"Default model (`gemma`, estimated {_mib(est['gemma'])} MiB with its KV cache) and a tiny "
        f"random GGUF (the default model here, {_mib(est['tiny'])} MiB), `n_ctx` {N_CTX}, "
        f"`parallel` {PARALLEL}, {r['threads']} thread(s); one server process; "
        f"{r['rounds']} rounds, medians (every figure in `benchmarks.json`). TTFT = `generate` "
        "sent → first `delta` on an open connection.",
        "",
        "| request | TTFT, ms |",
        "|---|---:|",
        f"| Gemma, already loaded | {m['gemma_loaded']:,.1f} |",
        f"| tiny model, already loaded | {m['tiny_loaded']:,.1f} |",
        f"| Gemma, loaded on demand (room for both) | {m['gemma_on_demand']:,.1f} |",
        f"| Gemma, after unloading the idle tiny model (room for one: budget "
        f"{_mib(r['budget_one'])} MiB) | {m['gemma_evicting']:,.1f} |",
        f"| tiny model, after unloading the idle Gemma (room for one) | {m['tiny_evicting']:,.1f} |",
        "",
        "| server RSS | MiB |",
        "|---|---:|",
        f"| both loaded | {_mib(m['rss_both'])} |",
        f"| after Gemma's unload (`keep_alive` 0) | {_mib(m['rss_after_unload'])} |",
        f"| room for one: Gemma loaded | {_mib(m['rss_gemma'])} |",
        f"| room for one: the tiny model loaded (Gemma unloaded) | {_mib(m['rss_tiny'])} |",
    ]
    return "\n".join(lines)
