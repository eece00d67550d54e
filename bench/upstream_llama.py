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
import time
from pathlib import Path
from typing import Any

import aiohttp

from .figures import fmt
from .options import Options
from .servers import ServerProcess, default_model, llama_server, llama_server_binary
from .sse_upstream import direct_stream
from .timing import side_by_side, summary
from .upstream_pairs import relay_overrides, relay_rounds
from .wsload import cancel, open_connection, send, timed

SHORT_PROMPT = "Once upon a time, in a small village by the sea, there lived"
#: Words per long prompt (roughly as many tokens): long enough that its prefill
#: takes a good part of a second here.
LONG_WORDS = 1500


def long_prompt(index: int) -> str:
    words = ["river", "stone", "lantern", "harbor", "meadow", "copper", "winter", "signal"]
    body = " ".join(words[(index * 7 + i * 3) % len(words)] for i in range(LONG_WORDS))
    return f"Story {index} ({time.time_ns()}): {body}"


async def _ws_stop_then_next(
    ws: Any, rep: int, stop_after: float, next_body: dict[str, Any]
) -> float | None:
    """Through wsserver: the long request, ``cancel`` after ``stop_after`` s, then the next."""
    request_id = f"long-{rep}"
    await send(
        ws, {"type": "generate", "id": request_id, "prompt": long_prompt(rep), "max_tokens": 16}
    )
    await asyncio.sleep(stop_after)  # sleep-ok: the user presses Stop this long after sending
    await cancel(ws, request_id)
    run = await timed(ws, {"type": "generate", "id": f"next-{rep}", **next_body})
    return run.ttft_ms


async def _direct_stop_then_next(
    session: Any, url: str, rep: int, stop_after: float, next_body: dict[str, Any]
) -> float | None:
    body = {"prompt": long_prompt(rep), "max_tokens": 16}
    await direct_stream(session, url, body, stop_after=stop_after)
    run = await direct_stream(session, url, next_body)
    return run.ttft_ms


async def run(opts: Options) -> dict[str, Any]:
    model = opts.model or default_model()
    binary = llama_server_binary()
    opts.log(f"  llama-server on {Path(model).name} …")
    threads = ("-t", opts.threads) if opts.threads else ()
    async with llama_server(binary, model, "-c", 4096, "-np", 1, "--no-webui", *threads) as peer:
        url = peer.url + "/v1"
        overrides = relay_overrides(url, parallel=1, model="")
        async with ServerProcess(overrides, name="wsserver-llama-server") as server:
            ws = await open_connection(server.url)
            # A new connection per request: llama-server (cpp-httplib) closes idle
            # keep-alive connections on its own, and a POST on one it just closed fails.
            connector = aiohttp.TCPConnector(force_close=True)
            async with aiohttp.ClientSession(connector=connector) as session:
                tokens = 16 if opts.quick else 64
                body = {"prompt": SHORT_PROMPT, "max_tokens": tokens, "temperature": 0}
                await relay_rounds(opts, ws, session, url, body, 1, "warm-up")
                row = await relay_rounds(
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
                reps = 2 if opts.quick else 8
                stops = {
                    "wsserver": lambda rep: _ws_stop_then_next(ws, rep, stop_after, next_body),
                    "direct": lambda rep: _direct_stop_then_next(
                        session, url, 100 + rep, stop_after, next_body
                    ),
                }
                waits = await side_by_side(reps, stops, order="flip")
            await ws.close()
    stop = {
        "prefill_s": prefill_s,
        "stop_after_s": stop_after,
        "long_words": LONG_WORDS,
        "reps": reps,
        "wsserver_next_ttft_ms": summary(waits["wsserver"]),
        "direct_next_ttft_ms": summary(waits["direct"]),
        "idle_ttft_ms": row["direct_ttft_ms"],
    }
    opts.log(
        f"    Stop mid-prefill ({prefill_s * 1000:.0f} ms prefill, Stop after {stop_after * 1000:.0f} ms): "
        f"next request's first token via wsserver {fmt(stop['wsserver_next_ttft_ms']['median'])} ms, "
        f"direct {fmt(stop['direct_next_ttft_ms']['median'])} ms"
    )
    return {"status": "ok", "model": Path(model).name, "rows": [row], "stop": stop}
