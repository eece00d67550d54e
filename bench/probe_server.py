"""A wsserver process instrumented for the benchmarks.

    python -m bench.probe_server '{"backend.kind": "fake", ...}' [--log FILE]

Starts :class:`wsserver.aio.Server` with the given configuration overrides
(port 0 on 127.0.0.1 unless overridden), plus two things the production server
does not need:

* an **event-loop lag probe**: a task that sleeps ``PROBE_INTERVAL`` and records
  how late it woke up — the delay every other callback on the loop suffered at
  that moment;
* an optional **sampler** that every ``SAMPLE_INTERVAL`` records each
  connection's buffered bytes (:meth:`Connection.buffered_bytes`) and keeps a
  reference to every request's channel so its producer-blocked time and CPU can
  be read after the request has ended.

The harness runs this in its own process so that clients do not share the
server's event loop or GIL. It talks to it over stdin/stdout, one JSON object
per line: the process prints ``{"event": "ready", "url": ..., "pid": ...}`` once
the model is loaded, then answers each command line with one JSON line:

* ``{"cmd": "stats", "reset": true}`` — lag percentiles, RSS, sampler figures,
  connection count since the last reset (and reset them);
* ``{"cmd": "sample", "on": true}`` — start or stop the sampler;
* ``{"cmd": "images", "reset": true}`` — the llama engine's images since the
  last reset, each its encode and its embeddings' decode in ms (section 20;
  timed around ``ImageDecoder.encode``/``decode`` when the backend is llama);
* ``{"cmd": "quit"}`` — stop the server and exit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import sys
import threading
import time
from typing import Any

from wsserver.aio import Server
from wsserver.aio.channel import Channel
from wsserver.aio.metrics import loop_lags
from wsserver.config import load_config
from wsserver.logs import setup_logging

PROBE_INTERVAL = 0.010
SAMPLE_INTERVAL = 0.050


# The harness's own statistics (bench.timing) are not imported here: this
# process is the server whose memory the sections measure, and it should hold
# no more than wsserver and this probe.
def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Probe:
    """Loop-lag probe and buffer sampler living on the server's loop."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.lags: list[float] = []
        self.sampling = False
        self.max_buffered = 0
        #: Largest memory any one connection held, both directions (held_bytes()).
        self.max_held = 0
        #: (seconds since reset, largest per-connection buffered bytes, RSS bytes)
        self.buffered_samples: list[tuple[float, int, int]] = []
        self.rss_max = 0
        self.channels: dict[tuple[str, str], Channel] = {}
        self._reset_at = time.monotonic()

    async def lag_probe(self) -> None:
        async for lag in loop_lags(PROBE_INTERVAL):
            self.lags.append(lag)

    async def sampler(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL)
            if not self.sampling:
                continue
            largest = 0
            for conn_id, connection in list(self.server.connections.items()):
                largest = max(largest, connection.buffered_bytes())
                self.max_held = max(self.max_held, sum(connection.held_bytes().values()))
                for request_id, generation in list(connection.generations.items()):
                    self.channels[(conn_id, request_id)] = generation.channel
            self.max_buffered = max(self.max_buffered, largest)
            rss = _rss_bytes()
            self.buffered_samples.append((time.monotonic() - self._reset_at, largest, rss))
            self.rss_max = max(self.rss_max, rss)

    def stats(self, reset: bool, series: bool = False) -> dict[str, Any]:
        lags = self.lags
        now = time.monotonic()
        blocked_s = 0.0
        blocked_cpu = 0.0
        for channel in self.channels.values():
            blocked_s += channel.blocked_seconds
            blocked_cpu += channel.blocked_cpu_seconds
            since = channel.blocked_since
            if since is not None:
                blocked_s += max(0.0, now - since)
        out = {
            "lag_ms": {
                "samples": len(lags),
                "p50": _ms(_percentile(lags, 50)),
                "p99": _ms(_percentile(lags, 99)),
                "max": _ms(max(lags) if lags else None),
            },
            "rss_bytes": _rss_bytes(),
            "rss_max_bytes": self.rss_max,
            "max_buffered_bytes": self.max_buffered,
            "max_held_bytes": self.max_held,
            "buffered_samples": len(self.buffered_samples),
            "channels_seen": len(self.channels),
            "producer_blocked_s": blocked_s,
            "producer_blocked_cpu_s": blocked_cpu,
            "connections": len(self.server.connections),
            "producer_threads": self.server.producer_threads(),
            "tcp_nodelay": _nodelay(self.server),
            "window_s": now - self._reset_at,
        }
        if series:
            out["series"] = [[round(t, 3), b, r] for t, b, r in self.buffered_samples]
        if reset:
            self.lags = []
            self.max_buffered = 0
            self.max_held = 0
            self.buffered_samples = []
            self.rss_max = _rss_bytes()
            self.channels = {}
            self._reset_at = now
        return out


class ImageTimes:
    """The llama engine's image work, timed: each ``ImageDecoder.encode`` call
    starts an image, the ``decode`` calls after it (its embeddings, a prompt
    share at a time) add to it. Wrapped at the class, in this process only."""

    def __init__(self) -> None:
        self.images: list[dict[str, float]] = []
        self.installed = False

    def install(self) -> None:
        from wsserver.backends.llama_vision import ImageDecoder

        encode, decode = ImageDecoder.encode, ImageDecoder.decode
        images = self.images

        def timed_encode(decoder: ImageDecoder, span: Any) -> Any:
            started = time.perf_counter()
            try:
                return encode(decoder, span)
            finally:
                took = (time.perf_counter() - started) * 1000.0
                images.append({"encode_ms": took, "decode_ms": 0.0})

        def timed_decode(decoder: ImageDecoder, *args: Any) -> int:
            started = time.perf_counter()
            try:
                return decode(decoder, *args)
            finally:
                if images:
                    images[-1]["decode_ms"] += (time.perf_counter() - started) * 1000.0

        ImageDecoder.encode = timed_encode  # type: ignore[method-assign,assignment]
        ImageDecoder.decode = timed_decode  # type: ignore[method-assign,assignment]
        self.installed = True

    def take(self, reset: bool) -> dict[str, Any]:
        if not self.installed:
            return {"error": "images are timed on the llama backend only"}
        out = {"images": [dict(image) for image in self.images]}
        if reset:
            self.images.clear()
        return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _nodelay(server: Server) -> bool | None:
    """Whether accepted sockets have TCP_NODELAY (None: no connection to look at).

    Without it, Nagle's algorithm holds a small frame while the previous one
    is unacknowledged, and the client's delayed ACK makes that ~40 ms.
    """
    for connection in list(server.connections.values()):
        transport = connection.ws.transport
        if transport is None or transport.is_closing():
            continue
        sock = transport.get_extra_info("socket")
        try:
            if sock is not None:
                return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        except OSError:
            continue
    return None


async def main(overrides: dict[str, Any]) -> None:
    values: dict[str, Any] = {"server.host": "127.0.0.1", "server.port": 0}
    values.update(overrides)
    config = load_config(env={}, overrides=values).config
    setup_logging(level=config.server.log_level, fmt=config.server.log_format)
    image_times = ImageTimes()
    if config.backend.kind == "llama":  # its engine imports llama_vision anyway
        image_times.install()
    server = Server(config)
    await server.start()
    await server.wait_ready()
    probe = Probe(server)
    tasks = [asyncio.create_task(probe.lag_probe()), asyncio.create_task(probe.sampler())]
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def read_stdin() -> None:
        # A plain thread: the loop's own stdin pipe support varies with how
        # the parent set the pipe up, and this keeps the loop free of it.
        for line in sys.stdin:
            line = line.strip()
            if line:
                loop.call_soon_threadsafe(commands.put_nowait, json.loads(line))
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, name="bench-stdin", daemon=True).start()
    _emit({"event": "ready", "url": server.url, "pid": os.getpid()})
    try:
        while True:
            command = await commands.get()
            if command is None or command.get("cmd") == "quit":
                break
            try:
                if command["cmd"] == "stats":
                    _emit(
                        probe.stats(
                            bool(command.get("reset", False)), bool(command.get("series", False))
                        )
                    )
                elif command["cmd"] == "images":
                    _emit(image_times.take(bool(command.get("reset", False))))
                elif command["cmd"] == "sample":
                    probe.sampling = bool(command.get("on", True))
                    _emit({"sampling": probe.sampling})
                else:
                    _emit({"error": f"unknown command {command['cmd']!r}"})
            except Exception as exc:  # report, keep serving: the harness decides
                _emit({"error": repr(exc)})
    finally:
        for task in tasks:
            task.cancel()
        await server.stop(grace=0)
    _emit({"event": "stopped"})


if __name__ == "__main__":
    # A thousand idle connections need a thousand descriptors.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    logging.getLogger("asyncio").setLevel(logging.WARNING)
    asyncio.run(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
