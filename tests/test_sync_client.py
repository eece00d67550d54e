"""The synchronous Python client (wsserver_client.sync) against a real server.

The server runs on this test's event loop; each scenario runs the blocking
client in a worker thread (``asyncio.to_thread``), as a plain script would
run it in its main thread. Ctrl-C is tested for real: a script in a
subprocess gets SIGINT once it has printed its first text.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from conftest import ROOT, expected_fake_text, running_server, timeout
from wsserver_client.sync import Client, GenerationError

from wsserver.aio import Server

T = TypeVar("T")


async def in_thread(scenario: Callable[[], T]) -> T:
    async with asyncio.timeout(timeout(30)):
        return await asyncio.to_thread(scenario)


def cancelled_count(server: Server) -> float:
    """Requests the server ended with a ``done`` of reason cancelled: only an
    in-band cancel makes one (a dropped connection sends no ``done``)."""
    value = server.metrics.registry.get_sample_value(
        "wsserver_requests_total", {"reason": "cancelled"}
    )
    return value or 0.0


async def test_generate_iterates_text_and_reports_done() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:

        def scenario() -> tuple[Any, ...]:
            with Client(server.url) as client:
                stream = client.generate("hello there", max_tokens=40, seed=5)
                pieces = list(stream)
                result = client.generate("again", max_tokens=7).result()
                # Waiting for the end sends a request that was not sent yet.
                waited = client.generate("wait", max_tokens=2).wait_done()
                assert waited is not None and waited.reason == "length"
                return client.hello, pieces, stream, result

        hello, pieces, stream, result = await in_thread(scenario)
    assert hello is not None and hello.model == "fake"
    assert "".join(pieces) == stream.text == expected_fake_text("hello there", 40, seed=5)
    assert stream.done is not None and stream.done.reason == "length"
    assert stream.done.usage.completion_tokens == 40
    assert (
        stream.done.timings.total_ms >= stream.done.timings.queued_ms
    )  # timing-ok: an order, not a speed
    assert stream.started
    assert result.text == expected_fake_text("again", 7)


async def test_cancel_drops_late_text_and_returns_done() -> None:
    async with running_server(backend__fake__tokens_per_s=300.0) as server:

        def scenario() -> tuple[Any, ...]:
            with Client(server.url) as client:
                stream = client.generate("long one", max_tokens=100000)
                seen = []
                done = None
                for text in stream:
                    seen.append(text)
                    if len(seen) == 2:
                        text_at_cancel = stream.text
                        done = stream.cancel()
                after = client.generate("after", max_tokens=5).result()
                return seen, done, stream.text, text_at_cancel, after, stream.cancel()

        seen, done, text, text_at_cancel, after, again = await in_thread(scenario)
        assert cancelled_count(server) == 1
    # Nothing after the cancel reached the caller: not in the loop, not in .text.
    assert len(seen) == 2
    assert text == text_at_cancel == "".join(seen)
    assert done is not None and done.reason == "cancelled"
    assert again is done  # cancelling an ended stream just returns its done
    assert after.text == expected_fake_text("after", 5)


async def test_restart_and_refusals() -> None:
    async with running_server(backend__fake__tokens_per_s=500.0) as server:

        def scenario() -> tuple[Any, ...]:
            with Client(server.url) as client:
                first = client.generate("story", max_tokens=10000, seed=2)
                for _ in first:
                    break
                text_at_restart = first.text
                again = client.restart(first, max_tokens=20).result()
                codes = []
                for refused in (
                    client.generate(messages=[{"role": "robot", "content": "x"}]),
                    client.restart("never-was"),
                ):
                    with pytest.raises(GenerationError) as info:
                        refused.result()
                    codes.append(info.value.code)
                usable = client.generate("still", max_tokens=3).result()
                return first, text_at_restart, again, codes, usable

        first, text_at_restart, again, codes, usable = await in_thread(scenario)
    assert again.text == expected_fake_text("story", 20, seed=2)
    assert first.done is not None and first.done.reason == "cancelled"
    assert first.text == text_at_restart
    assert list(first) == []  # an abandoned stream yields nothing more
    assert codes == ["bad_request", "unknown_id"]
    assert usable.done.reason == "length"


async def test_streams_fail_when_the_connection_drops() -> None:
    async with running_server(backend__fake__tokens_per_s=100.0) as server:
        first_text = asyncio.Event()
        loop = asyncio.get_running_loop()

        def scenario() -> GenerationError:
            with Client(server.url) as client:
                stream = client.generate("x", max_tokens=100000)
                with pytest.raises(GenerationError) as info:
                    for _ in stream:
                        loop.call_soon_threadsafe(first_text.set)
                with pytest.raises(GenerationError):
                    client.generate("y").result()
                return info.value

        failing = asyncio.ensure_future(in_thread(scenario))
        async with asyncio.timeout(timeout()):
            await first_text.wait()
        for connection in list(server.connections.values()):
            connection.ws.transport.abort()
        error = await failing
    assert error.code == "connection_lost"


async def test_leaving_the_client_cancels_in_band_what_still_runs() -> None:
    async with running_server(backend__fake__tokens_per_s=200.0) as server:

        def scenario() -> Any:
            with Client(server.url) as client:
                stream = client.generate("left running", max_tokens=100000)
                for _ in stream:
                    break
            return stream

        stream = await in_thread(scenario)
        assert cancelled_count(server) == 1
    assert stream.done is not None and stream.done.reason == "cancelled"


# The README's sync example, as a newcomer would run it, plus a marker line.
PLAIN_SCRIPT = """
import sys
from wsserver_client.sync import Client

with Client(sys.argv[1]) as client:
    stream = client.generate("Write a long story.", max_tokens=100000)
    first = True
    for text in stream:
        if first:
            print("FIRST", flush=True)
            first = False
"""

# Ctrl-C to stop an answer and carry on, as wsserver-chat does.
CARRY_ON_SCRIPT = """
import sys
from wsserver_client.sync import Client

with Client(sys.argv[1]) as client:
    stream = client.generate("Write a long story.", max_tokens=100000)
    try:
        for text in stream:
            print("FIRST", flush=True)
    except KeyboardInterrupt:
        done = stream.cancel()  # nothing more if Ctrl-C already cancelled it
        print("DONE", done.reason, flush=True)
    print("NEXT", client.generate("next", max_tokens=4).result().done.reason, flush=True)
"""


async def interrupt_after_first_text(server: Server, script: str) -> tuple[int, str, str]:
    """Run ``script`` against ``server``; SIGINT it once it printed FIRST."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        textwrap.dedent(script),
        server.url,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    try:
        async with asyncio.timeout(timeout(30)):
            assert await process.stdout.readline() == b"FIRST\n"
            process.send_signal(signal.SIGINT)
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_ctrl_c_in_the_loop_cancels_in_band_and_stops_the_script() -> None:
    async with running_server(backend__fake__tokens_per_s=20.0) as server:
        code, _, err = await interrupt_after_first_text(server, PLAIN_SCRIPT)
        # The server ended the request because of a cancel frame, not because
        # the connection went away.
        assert cancelled_count(server) == 1
    assert code == -signal.SIGINT, err  # how Python ends on an uncaught KeyboardInterrupt
    assert "KeyboardInterrupt" in err


async def test_ctrl_c_caught_leaves_the_connection_usable() -> None:
    async with running_server(backend__fake__tokens_per_s=20.0) as server:
        code, out, err = await interrupt_after_first_text(server, CARRY_ON_SCRIPT)
        assert cancelled_count(server) == 1
    assert code == 0, err
    assert out.splitlines()[-2:] == ["DONE cancelled", "NEXT length"]


async def test_a_resumable_stream_rides_over_a_server_side_abort() -> None:
    async with running_server(backend__fake__tokens_per_s=400.0) as server:
        loop = asyncio.get_running_loop()
        aborted = asyncio.Event()

        def abort() -> None:
            for connection in list(server.connections.values()):
                connection.ws.transport.abort()
            aborted.set()

        def scenario() -> tuple[str, Any, int, list[int]]:
            reconnected: list[int] = []
            with Client(
                server.url, resumable=True, on_reconnect=lambda c: reconnected.append(c.reconnects)
            ) as client:
                stream = client.generate("sync ride", max_tokens=150, seed=9)
                pieces = []
                for text in stream:
                    pieces.append(text)
                    if len(pieces) == 3:
                        loop.call_soon_threadsafe(abort)
                seqs = [d.seq for d in stream.deltas]
                return "".join(pieces), stream.done, client.reconnects, seqs

        text, done, reconnects, seqs = await in_thread(scenario)
        assert aborted.is_set()
        assert text == expected_fake_text("sync ride", 150, seed=9)
        assert done is not None and done.reason == "length"
        assert reconnects == 1
        assert seqs == list(range(len(seqs)))
