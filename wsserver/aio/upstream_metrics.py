"""Per-upstream metrics of an engine that relays other servers (the openai backend).

Read from the engine at scrape time (:meth:`Backend.upstream_stats`), one
label value per upstream URL; an engine without upstreams exports no samples.
A collector of its own, registered by the server, so that the engine keeps
plain numbers and only the asyncio layer imports prometheus_client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from ..backends.base import UpstreamStats

__all__ = ["UPSTREAM_METRICS", "UpstreamCollector"]

#: The families this collector exports (their names as scraped, without suffixes).
UPSTREAM_METRICS = (
    "wsserver_upstream_in_flight",
    "wsserver_upstream_healthy",
    "wsserver_upstream_requests",
    "wsserver_upstream_errors",
    "wsserver_upstream_first_byte_seconds",
)


class UpstreamCollector(Collector):
    def __init__(self, stats: Callable[[], list[UpstreamStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | SummaryMetricFamily]:
        stats = self._stats()
        in_flight = GaugeMetricFamily(
            UPSTREAM_METRICS[0], "Requests streaming from each upstream now.", labels=["upstream"]
        )
        healthy = GaugeMetricFamily(
            UPSTREAM_METRICS[1],
            "1 while the upstream is in rotation, 0 while it is out after a failure and probed.",
            labels=["upstream"],
        )
        requests = CounterMetricFamily(
            UPSTREAM_METRICS[2],
            "Requests sent to each upstream (retries included).",
            labels=["upstream"],
        )
        errors = CounterMetricFamily(
            UPSTREAM_METRICS[3],
            "Requests each upstream failed (an upstream_* code).",
            labels=["upstream"],
        )
        first_byte = SummaryMetricFamily(
            UPSTREAM_METRICS[4],
            "Time from sending a request to the first byte of its stream (prefill included).",
            labels=["upstream"],
        )
        for s in stats:
            in_flight.add_metric([s.url], s.in_flight)
            healthy.add_metric([s.url], 1.0 if s.healthy else 0.0)
            requests.add_metric([s.url], s.requests)
            errors.add_metric([s.url], s.errors)
            first_byte.add_metric([s.url], s.first_byte_count, s.first_byte_seconds_sum)
        yield from (in_flight, healthy, requests, errors, first_byte)
