"""Prometheus metrics and the event-loop lag probe.

Each :class:`~wsserver.aio.server.Server` owns a :class:`Metrics` with its own
:class:`~prometheus_client.CollectorRegistry` (tests run many servers in one
process; the global registry would mix them). ``/metrics`` renders it.

Two kinds of values:

* **events** — counters and histograms updated where things happen (a request
  ends, a producer exits, a frame is refused). These calls are cheap: a lock
  and an addition.
* **state** — connections, running and waiting requests, bytes buffered per
  connection, producers blocked right now. These are read at scrape time by
  :class:`_LiveCollector` from a :class:`Snapshot` the server takes (and from
  the scheduler), so nothing has to keep them in sync.

The probe task wakes every ``server.loop_probe_ms`` and measures how late it
woke: that lateness is the time every other callback on the loop waited too
(a frame to send, a cancel to read). It also logs the model queue's depth
while requests wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import typing
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from .. import __version__
from ..core.protocol import Done
from .models import ModelStats

if TYPE_CHECKING:
    from websockets.protocol import Protocol

__all__ = ["CONTENT_TYPE", "Metrics", "Snapshot", "loop_lags"]

log = logging.getLogger("wsserver.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Request phases run from milliseconds (a fast first token) to minutes (a long answer).
_REQUEST_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
# Cancel latency and loop lag should stay far below 100 ms; resolve the low end.
_FAST_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The server's live state at one scrape."""

    connections: int
    #: Bytes each connection holds for its client (channel + write buffer).
    buffered: list[int]
    #: Requests whose engine still runs (producer threads, for a threaded engine).
    producers_alive: int
    #: Requests paused on a full channel right now.
    producers_blocked: int
    #: Seconds live requests have spent paused so far.
    blocked_seconds: float


class Queues(typing.Protocol):
    """Slots held and requests waiting, over every model (the model registry)."""

    @property
    def busy(self) -> int: ...

    @property
    def waiting(self) -> int: ...


class Metrics:
    """Every metric of one server, and the loop-lag probe."""

    def __init__(
        self,
        *,
        backend_kind: str,
        model_name: str,
        scheduler: Queues,
        snapshot: Callable[[], Snapshot],
        orphaned_slots: Callable[[float], list[str]],
        loop_probe_ms: float,
        queue_log_s: float,
        check_engines: Callable[[], None] = lambda: None,
    ) -> None:
        self._scheduler = scheduler
        self._orphaned_slots = orphaned_slots
        #: Called every probe: the engines log a stall the first time they are asked.
        self._check_engines = check_engines
        self._probe_interval = loop_probe_ms / 1000.0
        self._queue_log_s = queue_log_s
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._info = Gauge(
            "wsserver_info",
            "Server version, backend and model (value 1).",
            ["version", "backend", "model"],
            registry=r,
        )
        self._backend_kind = backend_kind
        self.set_model(model_name)
        self.connections_total = Counter(
            "wsserver_connections", "WebSocket connections accepted.", registry=r
        )
        self.connection_closes = Counter(
            "wsserver_connection_closes",
            "Connections ended, by close code: the one the server sent if it began the close, else the client's (1006 = aborted, other = a code the server does not know).",
            ["code"],
            registry=r,
        )
        self.handshakes_refused = Counter(
            "wsserver_handshakes_refused",
            "HTTP requests and handshakes refused: host, origin, auth, connections, connections_per_ip.",
            ["reason"],
            registry=r,
        )
        self.requests = Counter(
            "wsserver_requests", "Requests ended (done frames), by reason.", ["reason"], registry=r
        )
        self.embedding_requests = Counter(
            "wsserver_embedding_requests",
            "Embedding and rerank requests ended, by kind (embed, rerank) and reason "
            "(complete, error, cancelled).",
            ["kind", "reason"],
            registry=r,
        )
        self.embedding_time = Histogram(
            "wsserver_embedding_request_seconds",
            "Time from receiving an embedding or rerank request to its answer or end.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "wsserver_tokens_generated", "Tokens generated and handed to the sender.", registry=r
        )
        self.errors = Counter(
            "wsserver_errors",
            "Error frames sent and requests ended with reason error, by wire code.",
            ["code"],
            registry=r,
        )
        self.queue_time = Histogram(
            "wsserver_request_queue_seconds",
            "Time from receiving a request to its start (waiting for the model).",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "wsserver_request_ttft_seconds",
            "Time from receiving a request to sending its first text.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.total_time = Histogram(
            "wsserver_request_duration_seconds",
            "Time from receiving a request to its done frame.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.cancel_latency = Histogram(
            "wsserver_cancel_latency_seconds",
            "Time from a cancel (or restart) frame to its producer thread's exit and the model slot's release.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "wsserver_event_loop_lag_seconds",
            "How late the periodic probe callback ran: the delay every callback on the loop saw.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        #: Recent probe results (seconds), newest last, for tests and diagnostics.
        self.loop_lag_samples: deque[float] = deque(maxlen=100_000)
        #: Blocked seconds of producers that have exited (live ones are read at scrape time).
        self.blocked_seconds_finished = 0.0
        r.register(_LiveCollector(scheduler, snapshot, self))
        self._probe: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ events

    def connection_closed(self, protocol: Protocol) -> None:
        self.connection_closes.labels(close_label(protocol)).inc()

    def embedded(self, kind: str, reason: str, seconds: float) -> None:
        """An embedding or rerank request ended (any wire)."""
        self.embedding_requests.labels(kind, reason).inc()
        self.embedding_time.observe(seconds)

    def done(self, frame: Done) -> None:
        """A request ended: record its phases from the ``done`` frame's timings."""
        self.requests.labels(frame.reason).inc()
        if frame.error_code is not None:
            self.errors.labels(frame.error_code).inc()
        timings = frame.timings
        if frame.reason != "cancelled" or timings.queued_ms < timings.total_ms:
            # A request cancelled while it waited never started: no queue time.
            self.queue_time.observe(timings.queued_ms / 1000.0)
        if timings.ttft_ms is not None:
            self.ttft.observe(timings.ttft_ms / 1000.0)
        self.total_time.observe(timings.total_ms / 1000.0)

    def producer_finished(self, blocked_seconds: float) -> None:
        """A request's engine is gone (or it ended before it had one), having
        spent ``blocked_seconds`` paused on its full channel."""
        self.blocked_seconds_finished += blocked_seconds

    # ------------------------------------------------------------ HTTP

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------ probe

    def set_model(self, model_name: str) -> None:
        """The model ``wsserver_info`` names (again, once an upstream listed it)."""
        self._info.clear()
        self._info.labels(__version__, self._backend_kind, model_name).set(1)

    def start(self) -> None:
        if self._probe is None:
            self._probe = asyncio.create_task(self._run_probe(), name="wsserver-loop-probe")

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None

    async def _run_probe(self) -> None:
        interval = self._probe_interval
        queue_log = self._queue_log_s
        loop = asyncio.get_running_loop()
        next_queue_log = loop.time()
        reported: list[str] = []
        async for lag in loop_lags(interval):
            now = loop.time()
            self.loop_lag.observe(lag)
            self.loop_lag_samples.append(lag)
            self._check_engines()
            orphans = self._orphaned_slots(now)
            if orphans != reported:
                if orphans:
                    log.error(
                        "scheduler books do not balance: slot(s) %s held by no request "
                        "(a leak; /readyz reports it)",
                        orphans,
                        extra={"orphaned_slots": orphans},
                    )
                reported = orphans
            if queue_log and now >= next_queue_log:
                scheduler = self._scheduler
                if scheduler.waiting:
                    log.info(
                        "queue: %d request(s) waiting for the model, %d running",
                        scheduler.waiting,
                        scheduler.busy,
                        extra={"queued": scheduler.waiting, "running": scheduler.busy},
                    )
                    next_queue_log = now + queue_log


#: Close codes that get a label of their own; any other code a client sends is
#: "other", so that clients cannot mint a time series per code.
KNOWN_CLOSE_CODES: Final = frozenset(
    {1000, 1001, 1002, 1003, 1005, 1006, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014}
)


def close_label(protocol: Protocol) -> str:
    """The close code to count for a finished connection.

    When the server began the closing handshake (1002, 1007, 1008, 1009, 1011,
    1001 at shutdown …), the code it sent — a client that does not echo the
    close would otherwise make it look like an abort (1006). Otherwise the
    code the client sent, or 1006 when no close frame came at all.
    """
    sent, received = protocol.close_sent, protocol.close_rcvd
    if sent is not None and not protocol.close_rcvd_then_sent:
        code = int(sent.code)
    elif received is not None:
        code = int(received.code)
    else:
        code = 1006
    return str(code) if code in KNOWN_CLOSE_CODES else "other"


async def loop_lags(interval: float) -> AsyncIterator[float]:
    """Event-loop lag, forever: ask to be woken in ``interval`` seconds and
    yield how much later than that the loop got round to it.

    The sleep is the measurement itself (a timer that fires late is the lag),
    not a wait for some condition.
    """
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval)  # sleep-ok: the probe's timer is what is measured
        yield max(0.0, loop.time() - start - interval)


class _LiveCollector(Collector):
    """Values read at scrape time."""

    def __init__(
        self, scheduler: Queues, snapshot: Callable[[], Snapshot], metrics: Metrics
    ) -> None:
        self._scheduler = scheduler
        self._snapshot = snapshot
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def collect(self) -> Iterable[Metric]:
        return list(self._families(live=True))

    def _families(self, live: bool = False) -> Iterable[Metric]:
        state = self._snapshot() if live else Snapshot(0, [], 0, 0, 0.0)
        scheduler = self._scheduler

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value if live else None)

        yield gauge("wsserver_open_connections", "Open WebSocket connections.", state.connections)
        yield gauge(
            "wsserver_requests_active",
            "Requests holding a model slot (started, or winding down after a cancel).",
            scheduler.busy,
        )
        yield gauge(
            "wsserver_requests_queued", "Requests waiting for a model slot.", scheduler.waiting
        )
        yield gauge(
            "wsserver_producer_threads",
            "Live producer (generation) threads.",
            state.producers_alive,
        )
        yield gauge(
            "wsserver_producers_blocked",
            "Producers blocked right now because their client reads slower than the model writes.",
            state.producers_blocked,
        )
        yield gauge(
            "wsserver_connection_buffered_bytes_max",
            "Largest number of bytes one connection holds for its client (channel + write buffer).",
            max(state.buffered, default=0),
        )
        yield gauge(
            "wsserver_connection_buffered_bytes_sum",
            "Bytes held for clients across all connections (channels + write buffers).",
            sum(state.buffered),
        )
        blocked = CounterMetricFamily(
            "wsserver_producer_blocked_seconds",
            "Time producers spent blocked by backpressure (a full channel).",
        )
        if live:
            blocked.add_metric([], self._metrics.blocked_seconds_finished + state.blocked_seconds)
        yield blocked


#: The per-model families, in order: (name as scraped after ``wsserver_model_``,
#: without suffixes; counter or gauge; the :class:`ModelStats` field it reads; help).
MODEL_METRICS: Final = (
    ("loaded", "gauge", "loaded", "1 while the model is loaded."),
    ("requests_active", "gauge", "active", "Requests holding one of the model's slots."),
    ("requests_queued", "gauge", "queued", "Requests waiting for the model (its load included)."),
    (
        "memory_bytes",
        "gauge",
        "memory_bytes",
        "Bytes the model holds against the budget (weights, KV cache, prompt cache bound; estimated).",
    ),
    ("loads", "counter", "loads", "Loads of the model that succeeded."),
    ("unloads", "counter", "unloads", "Unloads of the model (for room or after its keep-alive)."),
    ("load_failures", "counter", "load_failures", "Loads of the model that failed."),
    (
        "engine_step_seconds",
        "gauge",
        "step_seconds",
        "How long the engine's running step has lasted (0 between steps, and while idle).",
    ),
    (
        "engine_stalled",
        "gauge",
        "stalled",
        "1 while the engine is stalled: a step has run for backend.llama.engine_stall_s.",
    ),
    (
        "grammar_calls_abandoned",
        "gauge",
        "grammar_calls_running",
        "Grammar computations given up on past their deadline whose native call still runs.",
    ),
    (
        "prompt_cache_hits",
        "counter",
        "prompt_cache_hits",
        "Requests whose prompt state was restored from the prompt cache in host memory.",
    ),
    (
        "prompt_cache_restored_tokens",
        "counter",
        "prompt_cache_restored_tokens",
        "Prompt tokens restored from the prompt cache in host memory (not decoded again).",
    ),
    (
        "prompt_cache_bytes",
        "gauge",
        "prompt_cache_bytes",
        "Bytes the prompt cache holds in host memory (within backend.llama.prompt_cache_bytes).",
    ),
    (
        "draft_tokens",
        "counter",
        "draft_tokens",
        "Draft tokens decoded by speculative decoding (n-gram drafts; since the model's load).",
    ),
    (
        "draft_tokens_accepted",
        "counter",
        "draft_tokens_accepted",
        "Of those, the tokens accepted: each one a token that took no step of its own.",
    ),
)


class ModelCollector(Collector):
    """Per-model families, read from the model registry at scrape time; one
    ``model`` label value per configured model (bounded by the configuration)."""

    def __init__(self, stats: Callable[[], list[ModelStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        for name, kind, field, doc in MODEL_METRICS:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"wsserver_model_{name}", doc, labels=["model"]
            )
            for s in stats:
                family.add_metric([s.name], float(getattr(s, field)))
            yield family
