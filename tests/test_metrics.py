"""/metrics, the loop-lag probe, and structured logs."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from conftest import running_server, slow_wire, timeout, wire
from prometheus_client.parser import text_string_to_metric_families
from test_security import http

from wsserver.logs import JsonFormatter

EVERY_METRIC = (
    "wsserver_info",
    "wsserver_connections",
    "wsserver_open_connections",
    "wsserver_connection_closes",
    "wsserver_handshakes_refused",
    "wsserver_requests_active",
    "wsserver_requests_queued",
    "wsserver_requests",
    "wsserver_tokens_generated",
    "wsserver_request_queue_seconds",
    "wsserver_request_ttft_seconds",
    "wsserver_request_duration_seconds",
    "wsserver_cancel_latency_seconds",
    "wsserver_producer_blocked_seconds",
    "wsserver_producers_blocked",
    "wsserver_producer_threads",
    "wsserver_connection_buffered_bytes_max",
    "wsserver_connection_buffered_bytes_sum",
    "wsserver_event_loop_lag_seconds",
    "wsserver_errors",
)


async def scrape(server: Any) -> dict[str, float]:
    """``/metrics`` over HTTP, parsed: sample name with labels → value."""
    status, headers, body = await http(server, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    samples: dict[str, float] = {}
    families = list(text_string_to_metric_families(body.decode()))
    assert {f.name for f in families} >= set(EVERY_METRIC), "a metric is missing"
    for family in families:
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "le")
            key = sample.name + (f"{{{labels}}}" if labels else "")
            if "le" in sample.labels:
                key += f"[le={sample.labels['le']}]"
            samples[key] = sample.value
    return samples


async def test_metrics_endpoint_counts_requests_tokens_and_phases() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        before = await scrape(server)
        assert before["wsserver_open_connections"] == 0
        assert before["wsserver_requests_active"] == 0
        async with wire(server) as client:
            await client.send(
                {"type": "generate", "id": "a", "prompt": "count me", "max_tokens": 40}
            )
            await client.done("a")
            await client.send("not json")
            await client.recv()
            during = await scrape(server)
            assert during["wsserver_open_connections"] == 1
            assert during["wsserver_connection_buffered_bytes_max"] >= 0
        after = await scrape(server)
        assert after["wsserver_connections_total"] == 1
        assert after['wsserver_requests_total{reason="length"}'] == 1
        assert after["wsserver_tokens_generated_total"] == 40
        for histogram in ("queue", "ttft", "duration"):
            assert after[f"wsserver_request_{histogram}_seconds_count"] == 1
        assert after['wsserver_errors_total{code="bad_json"}'] == 1
        # (Producer threads are checked at shutdown by running_server: right
        # after a done, the thread may still be on its way out.)
        assert "wsserver_producer_threads" in after
        assert after["wsserver_producer_blocked_seconds_total"] >= 0


async def test_cancel_latency_is_measured_to_the_producer_exit() -> None:
    async with running_server(backend__fake__tokens_per_s=50.0) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "a", "prompt": "p", "max_tokens": 1000})
        await client.until(lambda f: f["type"] == "delta")
        sent = time.monotonic()
        await client.send({"type": "cancel", "id": "a"})
        _, frames = await client.done("a")
        assert frames[-1]["reason"] == "cancelled"
        # The done comes at once; the producer's exit follows. The next request
        # starts only after it, so its done proves the measurement happened.
        await client.send({"type": "generate", "id": "b", "prompt": "p", "max_tokens": 1})
        await client.done("b")
        observed = time.monotonic() - sent
        samples = await scrape(server)
        assert samples["wsserver_cancel_latency_seconds_count"] == 1
        # Causality, not speed: the server measured from the cancel's arrival to
        # the producer's exit, which happened before b could start and end, all
        # inside the span this client saw (its cancel sent → b's done).
        latency = samples["wsserver_cancel_latency_seconds_sum"]
        assert 0 < latency <= observed  # timing-ok: an order, not a threshold
        assert samples['wsserver_requests_total{reason="cancelled"}'] == 1


async def test_queue_gauges_and_queue_depth_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wsserver")
    async with (
        running_server(
            backend__fake__parallel=1,
            backend__fake__tokens_per_s=50.0,
            server__queue_log_s=0.01,
            server__loop_probe_ms=5.0,
        ) as server,
        wire(server) as first,
        wire(server) as second,
    ):
        await first.send({"type": "generate", "id": "a", "prompt": "p", "max_tokens": 25})
        await first.until(lambda f: f["type"] == "started")
        await second.send({"type": "generate", "id": "b", "prompt": "p", "max_tokens": 1})
        await second.until(lambda f: f["type"] == "queued")
        samples = await scrape(server)
        assert samples["wsserver_requests_active"] == 1
        assert samples["wsserver_requests_queued"] == 1
        await first.done("a")
        await second.done("b")
    queue_lines = [r for r in caplog.records if r.getMessage().startswith("queue:")]
    assert queue_lines, "the queue depth should be logged while requests wait"
    assert getattr(queue_lines[0], "queued", None) == 1


async def test_loop_lag_probe_records_samples() -> None:
    started = time.monotonic()
    async with running_server(
        server__loop_probe_ms=2.0, backend__fake__tokens_per_s=100.0
    ) as server:
        async with wire(server) as client:
            # A request of 20 tokens at 100 tokens/s lasts ~200 ms: many probe periods.
            await client.send({"type": "generate", "id": "a", "prompt": "p", "max_tokens": 20})
            await client.done("a")
        assert server.metrics.loop_lag_samples, "the probe never ran"
        # Seconds, and each lag lies within the server's life: a unit check, not a speed one.
        span = time.monotonic() - started
        assert min(server.metrics.loop_lag_samples) >= 0
        assert max(server.metrics.loop_lag_samples) <= span  # timing-ok: an order
        samples = await scrape(server)
        assert samples["wsserver_event_loop_lag_seconds_count"] >= 1


async def test_every_server_has_its_own_registry() -> None:
    async with running_server() as one, running_server() as two:
        async with wire(one):
            pass
        assert (await scrape(one))["wsserver_connections_total"] == 1
        assert (await scrape(two))["wsserver_connections_total"] == 0


async def test_request_log_lines_carry_ids_as_fields_and_never_the_prompt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="wsserver")
    secret_prompt = "my-very-private-prompt-text"
    async with running_server(backend__fake__tokens_per_s=200.0) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "a", "prompt": secret_prompt, "max_tokens": 5})
        await client.done("a")
        await client.send(
            {"type": "generate", "id": "b", "prompt": secret_prompt, "max_tokens": 500}
        )
        await client.until(lambda f: f["type"] == "delta")
        await client.send({"type": "cancel", "id": "b"})
        await client.done("b")
        await client.send({"type": "generate", "id": "c", "prompt": secret_prompt, "max_tokens": 1})
        await client.done("c")
    formatter = JsonFormatter()
    about_requests = [r for r in caplog.records if " id=" in r.getMessage()]
    messages = [r.getMessage() for r in about_requests]
    for kind in ("started", "first text", "done", "cancel", "producer stopped"):
        assert any(kind in m for m in messages), f"no {kind!r} line"
    for record in about_requests:
        entry = json.loads(formatter.format(record))
        request_id = record.getMessage().split(" id=", 1)[1].split()[0]
        assert entry["request"] == request_id, entry
        assert entry["conn"].startswith("c"), entry
    done_line = next(
        json.loads(formatter.format(r)) for r in about_requests if "done" in r.getMessage()
    )
    assert {"queued_ms", "ttft_ms", "total_ms"} <= set(done_line)  # timing-ok: names only
    for record in caplog.records:
        if record.levelno >= logging.INFO:
            assert secret_prompt not in record.getMessage()


async def test_loop_probe_stops_with_the_server() -> None:
    async with running_server() as server:
        probe = server.metrics._probe
        assert probe is not None and not probe.done()
    assert probe.done()


async def test_backpressure_shows_in_blocked_producers_and_buffered_bytes() -> None:
    async with running_server(
        backend__fake__tokens_per_s=0.0, stream__stall_timeout_s=0.0, limits__max_tokens=100_000
    ) as server:
        async with slow_wire(server, rcvbuf=4096, max_queue=2) as client:
            await client.send({"type": "generate", "id": "s", "prompt": "p", "max_tokens": 100_000})
            await client.until(lambda f: f["type"] == "started")
            # From here on the client reads nothing. The producer blocks for a
            # moment whenever it outruns the sender, and for good once the
            # socket buffers are full: scrape until the gauges show the latter.
            (connection,) = server.connections.values()
            generation = connection.generations["s"]
            assert await asyncio.to_thread(generation.channel.blocked.wait, timeout(20))
            async with asyncio.timeout(timeout(20)):
                while True:
                    samples = await scrape(server)
                    if (
                        samples["wsserver_producers_blocked"] == 1
                        # Half the write limit: well past the 4 KiB low-water mark,
                        # without depending on how far the last frame overshoots it.
                        and samples["wsserver_connection_buffered_bytes_max"] > 8192
                    ):
                        break
            assert samples["wsserver_producer_threads"] == 1
            assert (
                samples["wsserver_connection_buffered_bytes_sum"]
                >= samples["wsserver_connection_buffered_bytes_max"]
            )
            first = samples["wsserver_producer_blocked_seconds_total"]
            assert (await scrape(server))["wsserver_producer_blocked_seconds_total"] > first
            await client.send({"type": "cancel", "id": "s"})
            # Read again, so that the connection can close promptly.
            _, frames = await client.done("s", units=60)
            assert frames[-1]["reason"] == "cancelled"
