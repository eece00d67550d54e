"""A bounded soak: clients misbehaving at random, with adversaries mixed in.

Each client loops over random scenarios against the fake backend at a high
token rate: read a request to its end, cancel it mid-stream, restart it,
disconnect mid-stream, stop reading for a while, or send a bad frame. Beside
them run the adversaries found by attacking 0.1.0: a client that never reads,
one that sends pings and never reads, and a pair that presses Stop on a
running and a queued request at the same moment. The run is repeated with one,
two and twelve model slots. Afterwards:

* every accepted request on a connection that stayed open got exactly one
  ``done``, and nothing for its ID came after it;
* the scheduler's books balance: every slot free, nobody waiting, no orphan;
* no producer thread and no channel queue is left, and the server has no more
  threads than before;
* the process's RSS grew by less than ``RSS_GROWTH_BOUND``.

The server's event-loop lag (its own probe, beside the p99 an idle loop in
another process sees meanwhile) is printed, not asserted: it is a speed
figure, and a wall-clock bound fails on a busy machine; the benchmark
(``python -m bench``) measures it.

The clients run in a separate process, so the probe measures the server's
own event loop (sharing its GIL only with its producer threads, as in
production); they still share the machine's CPU cores with the server.
``WSSERVER_SOAK_SECONDS`` shortens or lengthens the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import random
import socket
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import janus
import psutil
import pytest
from conftest import running_server, timeout, wire
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from wsserver.aio.metrics import loop_lags

DURATION_S = float(os.environ.get("WSSERVER_SOAK_SECONDS", "40"))
#: How long clients may run past the deadline to finish what they started.
OVERRUN_S = 30.0
#: The server's stall and send timeouts in the soak.
STALL_S, SEND_TIMEOUT_S = 1.5, 3.0
#: Growth of the server's process (the test process; the clients run elsewhere).
RSS_GROWTH_BOUND = 64 * 1024 * 1024


@dataclass
class Tally:
    accepted: Counter[str] = field(default_factory=Counter)
    dones: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    scenarios: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    #: Every SoakClient of this process (to settle the ones cut off at the end).
    clients: list[Any] = field(default_factory=list)


class SoakClient:
    """One connection that checks the per-request invariants as frames arrive."""

    def __init__(self, ws: ClientConnection, tally: Tally, name: str) -> None:
        self.ws = ws
        self.tally = tally
        self.name = name
        self.ended: set[str] = set()
        self.seq: dict[str, int] = {}
        self._ids = 0
        tally.clients.append(self)

    def new_id(self) -> str:
        self._ids += 1
        return f"{self.name}-{self._ids}"

    async def send(self, frame: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(frame))

    async def next_frame(self) -> dict[str, Any]:
        async with asyncio.timeout(timeout(30)):
            frame: dict[str, Any] = json.loads(await self.ws.recv())
        request_id = frame.get("id")
        kind = frame["type"]
        if kind == "error":
            if frame["code"] not in ("unknown_id", "busy", *BAD_FRAME_CODES):
                self.tally.violations.append(f"unexpected error {frame}")
            return frame
        if request_id in self.ended:
            self.tally.violations.append(f"{kind} after done for {request_id}")
        if kind == "delta":
            if frame["seq"] != self.seq.get(request_id, 0):
                self.tally.violations.append(f"seq gap for {request_id}")
            self.seq[request_id] = frame["seq"] + 1
        elif kind == "done":
            self.ended.add(request_id)
            self.tally.dones[request_id] += 1
            self.tally.reasons[frame["reason"]] += 1
        return frame

    async def until(self, predicate: Any) -> dict[str, Any]:
        while True:
            frame = await self.next_frame()
            if predicate(frame):
                return frame

    async def generate(self, max_tokens: int) -> str:
        request_id = self.new_id()
        self.tally.accepted[request_id] += 1
        await self.send(
            {
                "type": "generate",
                "id": request_id,
                "prompt": f"soak {request_id}",
                "max_tokens": max_tokens,
            }
        )
        return request_id

    async def done(self, request_id: str) -> dict[str, Any]:
        return await self.until(lambda f: f["type"] == "done" and f["id"] == request_id)


async def stop_reading_for(seconds: float) -> None:
    """Simulate a client that does not read (this is load, not synchronisation)."""
    never = asyncio.Event()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await never.wait()


#: Frames that must be refused with an error and leave the connection usable.
BAD_FRAMES: list[str | bytes] = [
    '{"type": "generate", "id": "x1", "messages": [{"role": ["user"], "content": "c"}]}',
    '{"type": "generate", "id": "x2", "messages": [{"role": {"a": 1}, "content": "c"}]}',
    '{"type": "restart", "id": "x3", "new_id": "x4", "messages": [{"role": [], "content": ""}]}',
    '{"type": "generate", "id": "x5", "prompt": ["p"], "max_tokens": {"n": 1}}',
    '{"type": [], "id": {}}',
    "not json",
    b"\x00binary",
]
BAD_FRAME_CODES = ("bad_request", "bad_json", "unknown_type")


async def scenario(client: SoakClient, rng: random.Random) -> bool:
    """Run one random scenario; False when the connection was dropped on purpose."""
    kind = rng.choice(
        ["complete", "complete", "cancel", "restart", "disconnect", "slow", "busy", "bad"]
    )
    client.tally.scenarios[kind] += 1
    if kind == "complete":
        await client.done(await client.generate(rng.randint(1, 200)))
    elif kind == "cancel":
        request_id = await client.generate(4000)
        for _ in range(rng.randint(0, 3)):
            await client.until(lambda f: f["type"] in ("delta", "done"))
        await client.send({"type": "cancel", "id": request_id})
        await client.done(request_id)
    elif kind == "restart":
        old = await client.generate(4000)
        await client.until(lambda f: f["type"] in ("started", "done"))
        new = client.new_id()
        client.tally.accepted[new] += 1
        await client.send(
            {"type": "restart", "id": old, "new_id": new, "max_tokens": rng.randint(1, 100)}
        )
        await client.done(old)
        await client.done(new)
    elif kind == "disconnect":
        request_id = await client.generate(4000)
        await client.until(lambda f: f["type"] in ("delta", "done"))
        # This request's done will never be read: it is not counted.
        del client.tally.accepted[request_id]
        client.tally.dones.pop(request_id, None)
        return False
    elif kind == "slow":
        request_id = await client.generate(rng.randint(500, 3000))
        await stop_reading_for(rng.uniform(0.1, 1.0))
        await client.done(request_id)
    elif kind == "bad":
        await client.ws.send(rng.choice(BAD_FRAMES))
        # (An unknown_id for a cancel that lost the race with its done may come first.)
        await client.until(lambda f: f["type"] == "error" and f["code"] in BAD_FRAME_CODES)
    else:  # busy: a second generate while one runs is refused, the first continues
        request_id = await client.generate(300)
        await client.send({"type": "generate", "id": client.new_id(), "prompt": "x"})
        await client.until(lambda f: f["type"] == "error" and f["code"] == "busy")
        await client.done(request_id)
    return True


async def run_client(url: str, number: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(number)
    connections = 0
    while time.monotonic() < deadline:
        connections += 1
        async with connect(url, max_queue=8) as ws:
            hello = json.loads(await ws.recv())
            assert hello["type"] == "hello"
            client = SoakClient(ws, tally, f"k{number}.{connections}")
            with contextlib.suppress(ConnectionClosed):
                while time.monotonic() < deadline:
                    if not await scenario(client, rng):
                        break


async def never_reader(url: str, deadline: float, tally: Tally) -> None:
    """Starts a long request and never reads: the server must end it (stalled,
    when others wait) and abort the connection, not hold the model for it."""
    port = int(url.rsplit(":", 1)[1].strip("/"))
    while time.monotonic() < deadline:
        tally.scenarios["never_reader"] += 1
        # A tiny receive buffer: otherwise the kernel reads megabytes for it.
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        with contextlib.suppress(ConnectionClosed, OSError, TimeoutError):
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            async with connect(url, sock=sock, max_queue=1) as ws:
                ws.transport.pause_reading()
                await ws.send(
                    json.dumps({"type": "generate", "id": "n", "prompt": "p", "max_tokens": 10**5})
                )
                # The server stalls the request (others wait) and then aborts the
                # silent connection; a paused transport cannot see that, so look
                # again once both timeouts have passed.
                await stop_reading_for(STALL_S + SEND_TIMEOUT_S + 1.0)
                ws.transport.resume_reading()
                async with asyncio.timeout(timeout(10)):
                    await ws.wait_closed()
                if ws.close_code != 1006:
                    tally.violations.append(
                        f"never-reader closed with {ws.close_code}, not aborted"
                    )
        # Leave the model to the others for a while (one slot is the worst case).
        await stop_reading_for(random.uniform(2.0, 5.0))


async def ping_sender(url: str, deadline: float, tally: Tally) -> None:
    """Sends pings as fast as it can and reads nothing (not even the pongs)."""
    port = int(url.rsplit(":", 1)[1].strip("/"))
    while time.monotonic() < deadline:
        tally.scenarios["ping_sender"] += 1
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        with contextlib.suppress(ConnectionClosed, OSError, TimeoutError):
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
            async with connect(url, sock=sock, max_queue=1, ping_interval=None) as ws:
                ws.transport.pause_reading()
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    while not ws.transport.is_closing():
                        await ws.ping()  # waits once the server stops reading us
                        await asyncio.sleep(0)  # sleep-ok: leave this process's loop to the others
        await stop_reading_for(random.uniform(1.0, 3.0))


async def stop_pair(url: str, deadline: float, tally: Tally) -> None:
    """Stop on a running and a queued request within the same millisecond:
    the interleaving that wedged 0.1.0's scheduler."""
    async with connect(url) as a, connect(url) as b:
        await a.recv()
        await b.recv()
        holder, waiter = SoakClient(a, tally, "pa"), SoakClient(b, tally, "pb")
        while time.monotonic() < deadline:
            tally.scenarios["stop_pair"] += 1
            first = await holder.generate(4000)
            await holder.until(lambda f: f["type"] in ("started", "queued", "done"))
            second = await waiter.generate(4000)
            await waiter.until(lambda f: f["type"] in ("started", "queued", "done"))
            # The holder's slot is released when its producer exits, about a
            # millisecond after its cancel: the waiter's cancel lands around then.
            await holder.send({"type": "cancel", "id": first})
            await stop_reading_for(random.uniform(0.0, 0.002))
            await waiter.send({"type": "cancel", "id": second})
            await holder.done(first)
            await waiter.done(second)
            # Stay under the server's frame rate limit (this is load, not synchronisation).
            await stop_reading_for(random.uniform(0.02, 0.1))


def channel_queues() -> int:
    gc.collect()
    # type(), not isinstance(): the heap holds weak proxies whose referent may be gone.
    return sum(type(o) is janus.Queue for o in gc.get_objects())


def _clients_process(url: str, seconds: float, clients: int, results: Any) -> None:
    """Entry point of the client process: run every client, report the tally."""
    tally = Tally()

    async def main() -> None:
        deadline = time.monotonic() + seconds
        tasks = [
            *(run_client(url, n, deadline, tally) for n in range(clients)),
            never_reader(url, deadline, tally),
            ping_sender(url, deadline, tally),
            stop_pair(url, deadline, tally),
        ]
        try:
            # A scenario under way at the deadline runs to its end, but not for
            # ever: behind one slot and a never-reader a queue can be long.
            async with asyncio.timeout(seconds + OVERRUN_S):
                await asyncio.gather(*tasks)
        except TimeoutError:
            tally.scenarios["cut_off_at_the_end"] += 1
        # Requests whose done was not read because we stopped reading are not counted.
        for client in tally.clients:
            for request_id in list(client.tally.accepted):
                if request_id.startswith(f"{client.name}-") and request_id not in client.ended:
                    del client.tally.accepted[request_id]

    try:
        asyncio.run(main())
    except BaseException:
        results.put({"error": traceback.format_exc()})
        raise
    results.put(
        {
            "accepted": dict(tally.accepted),
            "dones": dict(tally.dones),
            "reasons": dict(tally.reasons),
            "scenarios": dict(tally.scenarios),
            "violations": tally.violations,
        }
    )


def _control_probe(seconds: float, interval: float, results: Any) -> None:
    """An idle event loop running the same probe: the machine's own share of the lag."""

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        lags = []
        deadline = loop.time() + seconds
        async for lag in loop_lags(interval):  # the server's own probe
            lags.append(lag)
            if loop.time() >= deadline:
                break
        return lags

    results.put(asyncio.run(main()))


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[int(len(ordered) * 0.99)]


def server_threads() -> set[str]:
    """Threads of the server's process, less asyncio's executor pool (which keeps
    threads for reuse) and the test's own helpers."""
    return {
        t.name
        for t in threading.enumerate()
        if not t.name.startswith(("asyncio_", "QueueFeederThread"))
    }


@pytest.mark.soak
@pytest.mark.timeout(DURATION_S + 600)
@pytest.mark.parametrize(("parallel", "clients"), [(1, 6), (2, 10), (12, 32)])
async def test_soak_many_misbehaving_clients(parallel: int, clients: int) -> None:
    process = psutil.Process()
    queues_before = channel_queues()
    threads_before = server_threads()
    async with running_server(
        backend__fake__tokens_per_s=2000.0,
        backend__fake__parallel=parallel,
        server__send_timeout_s=SEND_TIMEOUT_S,
        server__loop_probe_ms=20.0,
        stream__stall_timeout_s=STALL_S,
        limits__max_connections_per_ip=1000,
    ) as server:
        # Warm up (imports, first allocations) before taking the baseline.
        await run_client(server.url, 999, time.monotonic() + 1.0, Tally())
        gc.collect()
        rss_before = process.memory_info().rss
        server.metrics.loop_lag_samples.clear()
        # The clients run in their own process: the server's loop (and GIL) is
        # then its own, as in production, and the lag probe measures the server.
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        clients = context.Process(
            target=_clients_process,
            args=(server.url, DURATION_S, clients, results),
            name="soak-clients",
        )
        control_results = context.Queue()
        control = context.Process(
            target=_control_probe, args=(DURATION_S, 0.020, control_results), name="soak-control"
        )
        clients.start()
        control.start()
        try:
            # A scenario under way at the deadline still runs to its end (a queued
            # request may wait a while behind one slot): a generous bound.
            report = await asyncio.to_thread(
                results.get, True, DURATION_S + OVERRUN_S + timeout(90)
            )
            control_lags = await asyncio.to_thread(control_results.get, True, timeout(60))
            await asyncio.to_thread(clients.join, timeout(30))
            await asyncio.to_thread(control.join, timeout(30))
        finally:
            for child in (clients, control):
                if child.is_alive():
                    child.kill()
            results.close()
            control_results.close()
        assert "error" not in report, report.get("error")
        lags = sorted(server.metrics.loop_lag_samples)
        # Every client has closed; wait for the server's handlers to finish.
        assert server._ws_server is not None
        handlers = set(server._ws_server.handler_tasks)
        if handlers:
            await asyncio.wait(handlers, timeout=timeout(20))
        assert not server.connections
        assert server.producer_threads() == 0
        scheduler = server.scheduler
        assert (scheduler.free, scheduler.busy, scheduler.waiting) == (parallel, 0, 0)
        assert server.orphaned_slots(asyncio.get_running_loop().time() + 60) == []
        gc.collect()
        rss_after = process.memory_info().rss
    assert not [t.name for t in threading.enumerate() if t.name.startswith("wsserver-producer-")]
    assert server_threads() <= threads_before, server_threads() - threads_before
    assert channel_queues() <= queues_before, "channel queues leaked"
    assert not report["violations"], report["violations"][:10]
    accepted, dones, reasons = report["accepted"], report["dones"], report["reasons"]
    missing = {i for i in accepted if dones.get(i, 0) == 0}
    doubled = {i for i, n in dones.items() if n > 1}
    assert not missing, f"{len(missing)} accepted requests got no done, e.g. {sorted(missing)[:5]}"
    assert not doubled, f"requests with more than one done: {sorted(doubled)[:5]}"
    # One slot is shared with a never-reader that holds it until it stalls.
    least = (5 if parallel > 2 else 1) * DURATION_S
    assert len(accepted) > least, f"too little traffic: {report['scenarios']}"
    assert reasons.get("cancelled", 0) > DURATION_S and reasons.get("length", 0) > DURATION_S, (
        reasons
    )
    for adversary in ("never_reader", "ping_sender", "stop_pair", "bad"):
        assert report["scenarios"].get(adversary), f"{adversary} never ran: {report['scenarios']}"
    growth = rss_after - rss_before
    assert lags, "the loop-lag probe did not run"
    server_p99, machine_p99 = p99(lags), p99(control_lags)
    print(
        f"\nsoak parallel={parallel}: {len(accepted)} requests {reasons} scenarios {report['scenarios']}; "
        f"server RSS +{growth / 2**20:.1f} MiB; loop lag p50 {lags[len(lags) // 2] * 1000:.2f} ms "
        f"p99 {server_p99 * 1000:.2f} ms max {lags[-1] * 1000:.2f} ms; idle-loop p99 on this "
        f"machine {machine_p99 * 1000:.2f} ms; load {os.getloadavg()[0]:.1f}"
    )
    assert growth < RSS_GROWTH_BOUND, f"RSS grew by {growth / 2**20:.1f} MiB"


async def test_queued_position_update_never_follows_the_done() -> None:
    """A race the soak found: a ``queued`` update is sent from a task, so a
    cancel processed before that task ran used to put it after the ``done``."""
    async with (
        running_server(backend__fake__parallel=1, backend__fake__tokens_per_s=50.0) as server,
        wire(server) as holder,
        wire(server) as waiter,
    ):
        await holder.send({"type": "generate", "id": "h", "prompt": "p", "max_tokens": 4000})
        await holder.until(lambda f: f["type"] == "started")
        await waiter.send({"type": "generate", "id": "w", "prompt": "p"})
        await waiter.until(lambda f: f["type"] == "queued")
        (connection,) = [c for c in server.connections.values() if "w" in c.generations]
        # The scheduler reports a new position (the send is now scheduled as a
        # task) and, before that task runs, the client's cancel is handled.
        connection.generations["w"].queued(7)
        await connection.dialect.receive(json.dumps({"type": "cancel", "id": "w"}))
        await waiter.until(lambda f: f["type"] == "done" and f["id"] == "w")
        # Anything still in flight for "w" would arrive before this reply.
        await waiter.send({"type": "cancel", "id": "w"})
        frames = await waiter.until(lambda f: f["type"] == "error")
        assert frames == [frames[-1]], f"frames after done: {frames}"
        assert frames[-1]["code"] == "unknown_id"
        await holder.send({"type": "cancel", "id": "h"})
        await holder.until(lambda f: f["type"] == "done")
