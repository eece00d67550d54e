"""Section 8 — the OpenAI API over SSE: wsserver against llama_cpp.server and llama-server.

The same minimal asyncio SSE client (:class:`~bench.contenders.SseStream`)
reads ``POST /v1/completions`` with ``stream: true`` from:

* **wsserver (SSE)** — the server of sections 1-2 (``WsContender``'s
  process), on its ``/v1`` endpoint, next to its WebSocket;
* **llama_cpp.server** — llama-cpp-python's own server (sections 1-2's peer);
* **llama-server** — llama.cpp's own server, built by ``scripts/llama-tools``
  from the sources of the very llama.cpp our wheel binds (skipped if absent).

All three load the same GGUF with the same ``n_ctx``, ``n_batch`` and
threads, one slot each, and take turns (order rotated per prompt).

(a) **TTFT and decode**: short prompts, 128 tokens at temperature 0; TTFT =
request sent → first text; decode = tokens after the first over the time to
the last text (tokens from the usage chunk, else ``max_tokens`` when the
finish reason is ``length``).

(b) **Abandoning a long prompt**: a ~3,000-token prompt is sent and the
connection dropped 1 s later, in the middle of its prefill (what a browser
tab or an SDK's ``break`` does); then a short prompt is sent at once. Its
wait (drop → its first text) minus its TTFT on the idle model is how long
the abandoned request still held the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import Skip, die_with_parent, fmt, free_port, summary
from .contenders import Run, SseStream
from .lineup import NEXT_PROMPTS, PROMPTS, LlamaLineup, long_prompt
from .options import Options

now = time.perf_counter
TOKENS = 128
NEXT_TOKENS = 8
ABANDON_AFTER_S = 1.0


class SseContender:
    """Any OpenAI-compatible server on a port, read with :class:`SseStream`."""

    def __init__(self, name: str, port: int, extra: dict[str, Any] | None = None) -> None:
        self.name = name
        self.port = port
        self.extra = extra or {}

    def body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra,
        }

    async def complete(self, prompt: str, max_tokens: int, index: int = 0) -> Run:
        run = Run(self.name, index)
        stream = await SseStream.connect(self.port)
        t0 = now()
        await stream.post("/v1/completions", self.body(prompt, max_tokens))
        finish = None
        try:
            async for event in stream.events():
                for choice in event.get("choices") or []:
                    run.piece(t0, choice.get("text") or "")
                    finish = choice.get("finish_reason") or finish
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens"):
                    run.tokens = int(usage["completion_tokens"])
        finally:
            await stream.close()
        run.end = now() - t0
        if run.tokens is None and finish == "length":
            run.tokens = max_tokens
        return run

    async def abandon(self, prompt: str) -> float:
        """Send a long prompt, drop the connection after a while; the drop's time."""
        stream = await SseStream.connect(self.port)
        await stream.post("/v1/completions", self.body(prompt, 16))
        await asyncio.sleep(ABANDON_AFTER_S)  # sleep-ok: the scenario (the user gives up)
        stream.abort()
        return now()


class LlamaServer:
    """llama.cpp's ``llama-server`` in a subprocess."""

    def __init__(self, binary: str, model: str, *, n_ctx: int, n_batch: int, threads: int) -> None:
        self.binary = binary
        self.args = [
            "-m", model, "--host", "127.0.0.1", "-c", str(n_ctx), "-b", str(n_batch),
            "-ub", str(n_batch), "-t", str(threads), "-tb", str(threads), "-np", "1",
        ]  # fmt: skip
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkstemp(prefix="bench-llama-server-", suffix=".log")[1])

    async def start(self, timeout: float = 300.0) -> LlamaServer:
        self.port = free_port()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [self.binary, *self.args, "--port", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        deadline = now() + timeout
        while now() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.write(
                    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                )
                status = await reader.readline()
                writer.close()
                if b" 200 " in status:
                    return self
            await asyncio.sleep(0.2)  # sleep-ok: polling a child process for health
        raise RuntimeError("llama-server did not become healthy")

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 15)
            except TimeoutError:
                self.proc.kill()
        with contextlib.suppress(OSError):
            self.log.unlink()


def find_llama_server() -> str | None:
    """The binary ``scripts/llama-tools`` built (never built from here: ~15 minutes)."""
    if os.environ.get("WSSERVER_LLAMA_SERVER"):
        return os.environ["WSSERVER_LLAMA_SERVER"]
    cache = os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    found = sorted(glob.glob(f"{cache}/wsserver/llama-tools/*/bin/llama-server"))
    return found[-1] if found else None


def _port(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])


async def run(opts: Options, session: LlamaLineup) -> dict[str, Any]:
    if session.ws is None or session.inproc is None:
        raise Skip("the lineup has no wsserver")
    contenders = [SseContender("wsserver (SSE)", _port(session.ws.server.url))]
    notes: list[str] = []
    if session.peer is not None:
        # repeat_penalty: llama_cpp.server defaults to 1.1, the others to 1.0.
        contenders.append(
            SseContender("llama_cpp.server", session.peer.port, {"repeat_penalty": 1.0})
        )
    binary = find_llama_server()
    llama_server = None
    if binary is not None:
        try:
            llama_server = await LlamaServer(
                binary,
                session.model,
                n_ctx=opts.n_ctx,
                n_batch=opts.n_batch,
                threads=session.threads,
            ).start()
            contenders.append(
                SseContender(
                    "llama-server",
                    llama_server.port,
                    {"repeat_penalty": 1.0, "cache_prompt": False},
                )
            )
        except Exception as exc:
            notes.append(f"llama-server did not start: {exc}")
    else:
        notes.append("llama-server not built (run scripts/llama-tools first)")
    try:
        return await _measure(opts, session, contenders, notes)
    finally:
        if llama_server is not None:
            await llama_server.stop()


async def _measure(
    opts: Options, session: LlamaLineup, contenders: list[SseContender], notes: list[str]
) -> dict[str, Any]:
    assert session.inproc is not None
    prompts = PROMPTS[: 3 if opts.quick else min(opts.repeats or 8, 8)]
    tokens = 16 if opts.quick else TOKENS
    runs: dict[str, list[Run]] = {c.name: [] for c in contenders}
    for contender in contenders:  # warm-up, not counted
        await contender.complete("Hello", 4)
    for index, prompt in enumerate(prompts):
        shift = index % len(contenders)
        for contender in contenders[shift:] + contenders[:shift]:
            opts.log(f"  section 8: {contender.name} prompt {index}")
            runs[contender.name].append(await contender.complete(prompt, tokens, index))
    abandons = 1 if opts.quick else 2
    waits: dict[str, list[dict[str, float]]] = {c.name: [] for c in contenders}
    for n in range(abandons):
        for contender in contenders:
            long_text, _ = long_prompt(
                session.inproc, 100 + n * len(contenders) + len(waits[contender.name])
            )
            nxt = NEXT_PROMPTS[n % len(NEXT_PROMPTS)]
            idle = await contender.complete(nxt, NEXT_TOKENS)
            opts.log(f"  section 8: {contender.name} abandons a long prompt ({n + 1}/{abandons})")
            dropped = await contender.abandon(long_text)
            after = await contender.complete(nxt, NEXT_TOKENS)
            if after.first is None or idle.first is None:
                continue
            # The next request was sent right after the drop; its first text
            # arrived (end - first) before complete() returned.
            wait = (now() - dropped) - (after.end - after.first)
            waits[contender.name].append(
                {"wait_ms": 1000 * wait, "busy_ms": 1000 * (wait - idle.first)}
            )
    rows = []
    for contender in contenders:
        mine = runs[contender.name]
        ttft = [1000 * r.first for r in mine if r.first is not None]
        decode = [d for r in mine if (d := r.decode_tps()) is not None]
        rows.append(
            {
                "contender": contender.name,
                "n": len(mine),
                "ttft_ms": summary(ttft),
                "decode_tps": summary(decode),
                "wait_ms": summary([w["wait_ms"] for w in waits[contender.name]]),
                "busy_ms": summary([w["busy_ms"] for w in waits[contender.name]]),
                "abandons": len(waits[contender.name]),
            }
        )
    return {
        "status": "ok",
        "params": {
            "model": session.model,
            "prompts": len(prompts),
            "tokens": tokens,
            "threads": session.threads,
        },
        "rows": rows,
        "notes": notes,
    }


def _median(stats: dict[str, Any]) -> float | None:
    return stats.get("median") if stats else None


def render(result: dict[str, Any]) -> str:
    p = result["params"]
    lines = [
        f"Model `{Path(p['model']).name}`, {p['threads']} threads, one slot per server; {p['prompts']} prompts x "
        f"{p['tokens']} tokens at temperature 0 over `POST /v1/completions` with `stream: true`, read by the same "
        "SSE client, contenders' order rotated per prompt. *Abandon*: a ~3,000-token prompt dropped "
        f"{ABANDON_AFTER_S:.0f} s after it was sent (mid-prefill), then a short prompt at once: *next waits* = drop → "
        "its first text; *model busy* = that minus its idle TTFT. Medians (worst in brackets).",
        "",
        "| contender | TTFT median (ms) | decode tokens/s median | after abandoning a long prompt: next waits (ms) | model busy (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        wait, busy = row["wait_ms"], row["busy_ms"]
        lines.append(
            f"| {row['contender']} | {fmt(_median(row['ttft_ms']))} | {fmt(_median(row['decode_tps']))} | "
            f"{fmt(_median(wait))} ({fmt(wait.get('max') if wait else None)}) | "
            f"{fmt(_median(busy))} ({fmt(busy.get('max') if busy else None)}) |"
        )
    for note in result.get("notes", []):
        lines += ["", note + "."]
    return "\n".join(lines)


def headline(result: dict[str, Any]) -> str:
    parts = []
    for row in result["rows"]:
        parts.append(
            f"{row['contender']}: TTFT {fmt(_median(row['ttft_ms']))} ms, {fmt(_median(row['decode_tps']))} tokens/s, "
            f"next request after an abandoned long prompt waits {fmt(_median(row['wait_ms']))} ms"
        )
    return "; ".join(parts)
