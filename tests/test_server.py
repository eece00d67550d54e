"""The server end to end: real sockets, real WebSocket clients, the fake backend."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time

import janus
import pytest
from conftest import (
    expected_fake_text,
    make_config,
    running_server,
    slow_wire,
    text_of,
    timeout,
    wire,
)
from websockets.exceptions import ConnectionClosed

from wsserver.aio import Server
from wsserver.backends.fake import FakeBackend
from wsserver.core import pacing
from wsserver.errors import BackendError


def producer_threads(request_id: str | None = None) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("wsserver-producer-")
        and (request_id is None or t.name.endswith(f"-{request_id}"))
    ]


async def join_producers(request_id: str | None = None) -> None:
    """Wait (a real join, not a sleep) for the producer threads to exit."""
    for thread in producer_threads(request_id):
        await asyncio.to_thread(thread.join, timeout(10))
        assert not thread.is_alive(), f"{thread.name} did not exit"


# ---------------------------------------------------------------- streaming


async def test_hello_describes_server_and_limits() -> None:
    async with running_server() as server, wire(server) as client:
        hello = client.hello
        assert hello is not None
        assert hello["protocol"] == 1
        assert hello["server"].startswith("wsserver/")
        assert hello["model"] == "fake"
        assert hello["limits"]["max_tokens"] == server.config.limits.max_tokens
        # What the page needs to leave out what the engine would refuse.
        assert hello["honours"] == [
            "json_schema",
            "logit_bias",
            "logprobs",
            "reasoning_budget_tokens",
            "tools",
        ]


async def test_stream_delivers_the_exact_text_in_order() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, wire(server) as client:
        await client.send(
            {"type": "generate", "id": "a", "prompt": "tell me", "max_tokens": 300, "seed": 7}
        )
        text, frames = await client.done("a")
        kinds = [f["type"] for f in frames]
        assert kinds[0] == "started"
        assert kinds[-1] == "done" and kinds.count("done") == 1
        assert set(kinds[1:-1]) == {"delta"}
        assert text == expected_fake_text("tell me", 300, seed=7)
        done = frames[-1]
        assert done["reason"] == "length"
        assert done["usage"]["completion_tokens"] == 300
        assert done["usage"]["prompt_tokens"] >= 1


async def test_same_request_gives_same_text_and_seed_changes_it() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, wire(server) as client:
        texts = []
        for request_id, seed in (("a", 1), ("b", 1), ("c", 2)):
            await client.send(
                {
                    "type": "generate",
                    "id": request_id,
                    "prompt": "p",
                    "max_tokens": 50,
                    "seed": seed,
                }
            )
            texts.append((await client.done(request_id))[0])
        assert texts[0] == texts[1]
        assert texts[0] != texts[2]


async def test_multibyte_characters_are_never_split() -> None:
    # The fake backend emits CJK, emoji and accents as 1-3 byte tokens.
    async with (
        running_server(
            backend__fake__tokens_per_s=0.0, stream__flush_tokens=1, stream__flush_ms=0.0
        ) as server,
        wire(server) as client,
    ):
        await client.send({"type": "generate", "id": "m", "prompt": "unicode", "max_tokens": 400})
        text, frames = await client.done("m")
        deltas = [f["text"] for f in frames if f["type"] == "delta"]
        assert any(not d.isascii() for d in deltas), "the test needs multi-byte text"
        for delta in deltas:
            assert "\ufffd" not in delta
            delta.encode("utf-8")  # a lone surrogate would raise
        assert text == expected_fake_text("unicode", 400)


async def test_stop_string_ends_with_reason_stop_and_is_not_emitted() -> None:
    prompt = "stop test"
    full = expected_fake_text(prompt, 200)
    stop = full.split()[10]  # a word that occurs in the text
    async with (
        running_server(
            backend__fake__tokens_per_s=0.0, stream__flush_tokens=1, stream__flush_ms=0.0
        ) as server,
        wire(server) as client,
    ):
        await client.send(
            {"type": "generate", "id": "s", "prompt": prompt, "max_tokens": 200, "stop": stop}
        )
        text, frames = await client.done("s")
        assert frames[-1]["reason"] == "stop"
        assert text == full[: full.find(stop)]
        assert stop not in text


async def test_messages_input_streams() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, wire(server) as client:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        await client.send({"type": "generate", "id": "c", "messages": messages, "max_tokens": 20})
        text, frames = await client.done("c")
        assert frames[-1]["reason"] == "length" and text


# ---------------------------------------------------------------- cancel


async def test_cancel_mid_stream_ends_at_once_with_nothing_after() -> None:
    async with running_server(backend__fake__tokens_per_s=200.0) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "x", "prompt": "long", "max_tokens": 100000})
        await client.until(lambda f: f["type"] == "delta")
        # How fast the done comes is a benchmark figure (docs/benchmarks.md §2);
        # that it comes without waiting for the producer, the prefill test shows.
        await client.send({"type": "cancel", "id": "x"})
        frames = await client.until(lambda f: f["type"] == "done")
        assert frames[-1]["reason"] == "cancelled"
        # The producer exits, and the next request runs normally; nothing of x follows.
        await join_producers("x")
        await client.send({"type": "generate", "id": "y", "prompt": "short", "max_tokens": 5})
        text, _ = await client.done("y")
        assert text == expected_fake_text("short", 5)
        assert all(f["id"] != "x" for f in client.frames[client.frames.index(frames[-1]) + 1 :])


async def test_cancel_during_prefill_is_answered_without_waiting_for_it() -> None:
    # 400 prompt tokens x 2.5 s = 1,000 s of simulated prompt processing, so
    # each answer below, arriving within its (hang-guard) wait, can only come
    # from a cancel that did not wait for the prefill. How fast it comes is a
    # benchmark figure (docs/benchmarks.md §2), not asserted here.
    async with (
        running_server(backend__fake__prefill_ms_per_token=2500.0) as server,
        wire(server) as client,
    ):
        await client.send(
            {"type": "generate", "id": "p", "prompt": "word " * 320, "max_tokens": 10}
        )
        await client.until(lambda f: f["type"] == "started")
        await client.send({"type": "cancel", "id": "p"})
        frames = await client.until(lambda f: f["type"] == "done")
        assert frames[-1]["reason"] == "cancelled"
        # The producer stopped for real: the one slot serves the next request
        # (its own prompt of 1 token x 2.5 s) instead of 1,000 s of prefill.
        await client.send({"type": "generate", "id": "q", "prompt": "hi", "max_tokens": 3})
        _, frames = await client.done("q", units=30)
        assert frames[-1]["reason"] == "length"


async def test_cancel_unknown_or_finished_id_is_refused_and_touches_nothing() -> None:
    async with running_server(backend__fake__tokens_per_s=500.0) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "f", "prompt": "a", "max_tokens": 3})
        await client.done("f")
        await client.send({"type": "cancel", "id": "f"})
        error = (await client.until(lambda f: f["type"] == "error"))[-1]
        assert error == {
            "type": "error",
            "id": "f",
            "code": "unknown_id",
            "message": error["message"],
        }
        await client.send({"type": "generate", "id": "g", "prompt": "b", "max_tokens": 50})
        await client.until(lambda f: f["type"] == "started")
        await client.send({"type": "cancel", "id": "nope"})
        frames = await client.until(lambda f: f["type"] == "error")
        assert frames[-1]["code"] == "unknown_id" and frames[-1]["id"] == "nope"
        text, mine = await client.done("g")
        assert mine[-1]["reason"] == "length"
        assert text == expected_fake_text("b", 50)


async def test_cancel_racing_the_natural_end_yields_exactly_one_done() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, wire(server) as client:
        for n in range(30):
            request_id = f"r{n}"
            await client.send(
                {"type": "generate", "id": request_id, "prompt": "race", "max_tokens": 1 + n % 4}
            )
            await client.send({"type": "cancel", "id": request_id})
            frames = await client.until(
                lambda f, r=request_id: (
                    f["id"] == r and f["type"] in ("done", "error") and f["type"] == "done"
                )
            )
            assert frames[-1]["reason"] in ("length", "cancelled")
        # A late cancel after a natural end is refused with unknown_id, never a second done.
        await client.send({"type": "generate", "id": "end", "prompt": "z", "max_tokens": 1})
        await client.done("end")
        dones = [f for f in client.frames if f["type"] == "done"]
        assert len(dones) == len({f["id"] for f in dones}) == 31


# ---------------------------------------------------------------- restart


async def test_restart_old_done_precedes_every_frame_of_new() -> None:
    async with running_server(backend__fake__tokens_per_s=300.0) as server, wire(server) as client:
        await client.send(
            {"type": "generate", "id": "one", "prompt": "regen me", "max_tokens": 10000, "seed": 3}
        )
        await client.until(lambda f: f["type"] == "delta")
        await client.send({"type": "restart", "id": "one", "new_id": "two", "max_tokens": 40})
        text, _ = await client.done("two")
        ids = [f["id"] for f in client.frames if f["type"] != "hello"]
        old_done = next(
            i for i, f in enumerate(client.frames) if f["type"] == "done" and f["id"] == "one"
        )
        first_new = next(i for i, f in enumerate(client.frames) if f.get("id") == "two")
        assert old_done < first_new
        assert "one" not in ids[ids.index("two") :]
        # NEW ran OLD's input with the override.
        assert text == expected_fake_text("regen me", 40, seed=3)


async def test_restart_after_done_regenerates_and_rapid_restarts_never_mix() -> None:
    async with running_server(backend__fake__tokens_per_s=1000.0) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "r0", "prompt": "again", "max_tokens": 5})
        first, _ = await client.done("r0")
        for n in range(1, 15):
            await client.send(
                {"type": "restart", "id": f"r{n - 1}", "new_id": f"r{n}", "max_tokens": 500}
            )
        text, _frames = await client.done("r14")
        assert text == expected_fake_text("again", 500)
        assert first == expected_fake_text("again", 5)
        for n in range(1, 14):
            mine = [f for f in client.frames if f.get("id") == f"r{n}"]
            assert [f["type"] for f in mine].count("done") == 1
            assert mine[-1]["type"] == "done"


async def test_restart_of_unknown_id_is_refused() -> None:
    async with running_server() as server, wire(server) as client:
        await client.send({"type": "restart", "id": "ghost", "new_id": "n"})
        frame = (await client.until(lambda f: f["type"] == "error"))[-1]
        assert frame["code"] == "unknown_id" and frame["id"] == "n"


# ---------------------------------------------------------------- ids and busy


async def test_duplicate_id_and_busy_are_refused_and_running_request_continues() -> None:
    async with running_server(backend__fake__tokens_per_s=500.0) as server, wire(server) as client:
        await client.send({"type": "generate", "id": "d", "prompt": "x", "max_tokens": 200})
        await client.until(lambda f: f["type"] == "started")
        await client.send({"type": "generate", "id": "e", "prompt": "y"})
        busy = (await client.until(lambda f: f["type"] == "error"))[-1]
        assert (busy["code"], busy["id"]) == ("busy", "e")
        text, frames = await client.done("d")
        assert frames[-1]["reason"] == "length"
        assert text == expected_fake_text("x", 200)
        await client.send({"type": "generate", "id": "d", "prompt": "again"})
        dup = (await client.until(lambda f: f["type"] == "error"))[-1]
        assert (dup["code"], dup["id"]) == ("duplicate_id", "d")
        # A refused generate gets no done: the busy one never started.
        assert not [f for f in client.frames if f.get("id") == "e" and f["type"] != "error"]


async def test_connections_run_concurrently() -> None:
    async with running_server(backend__fake__tokens_per_s=100.0) as server:
        async with wire(server) as a, wire(server) as b:
            await a.send({"type": "generate", "id": "same", "prompt": "a", "max_tokens": 30})
            await b.send({"type": "generate", "id": "same", "prompt": "b", "max_tokens": 30})
            (ta, fa), (tb, fb) = await asyncio.gather(a.done("same"), b.done("same"))
        assert ta == expected_fake_text("a", 30) and tb == expected_fake_text("b", 30)
        # Neither waited for the other: both got a slot at once (no queued
        # frame), so they ran side by side — shown by cause, not by the clock.
        assert not [f for f in fa + fb if f["type"] == "queued"]


# ---------------------------------------------------------------- bad input


BAD_FRAMES = [
    ("not json", "bad_json"),
    ("[1, 2]", "bad_json"),
    ('"string"', "bad_json"),
    ("{}", "bad_request"),
    ('{"type": "dance", "id": "a"}', "unknown_type"),
    ('{"type": "generate", "id": "a"}', "bad_request"),
    ('{"type": "generate", "id": "bad id!", "prompt": "x"}', "bad_request"),
    ('{"type": "generate", "id": "a", "prompt": 5}', "bad_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 0}', "bad_request"),
    ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 1e400}', "bad_json"),
    (
        '{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 123456789012345678901234567890}',
        "bad_request",
    ),
    ('{"type": "generate", "id": "a", "prompt": "x", "temperature": -1}', "bad_request"),
    (
        '{"type": "generate", "id": "a", "prompt": "x", "stop": ["a","b","c","d","e"]}',
        "bad_request",
    ),
    ('{"type": "generate", "id": "a", "prompt": "x", "extra": 1}', "bad_request"),
    ("[" * 5000 + "]" * 5000, "bad_json"),
    ('{"type": "cancel"}', "bad_request"),
]


async def test_bad_input_gets_an_error_and_the_connection_stays_usable() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server, wire(server) as client:
        for raw, code in BAD_FRAMES:
            await client.send(raw)
            frame = await client.recv()
            assert frame["type"] == "error", raw
            assert frame["code"] == code, (raw, frame)
            assert "Traceback" not in frame["message"]
        await client.send(b"\x00\x01binary")
        frame = await client.recv()
        assert (frame["type"], frame["code"]) == ("error", "bad_json")
        await client.send({"type": "generate", "id": "ok", "prompt": "still here", "max_tokens": 5})
        text, _ = await client.done("ok")
        assert text == expected_fake_text("still here", 5)


async def test_oversized_frame_closes_with_1009_and_server_lives_on() -> None:
    async with running_server(server__max_frame_bytes=4096) as server:
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "big", "prompt": "x" * 10000})
            with pytest.raises(ConnectionClosed) as info:
                await client.recv()
            assert info.value.rcvd is not None and info.value.rcvd.code == 1009
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "ok", "prompt": "fine", "max_tokens": 3})
            await client.done("ok")


# ---------------------------------------------------------------- disconnect


async def test_disconnect_mid_generation_stops_producer_and_leaks_nothing() -> None:
    gc.collect()
    queues_before = sum(isinstance(o, janus.Queue) for o in gc.get_objects())
    threads_before = len(producer_threads())
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        for n in range(6):
            async with wire(server, close_timeout=timeout(10)) as client:
                request_id = f"gone{n}"
                await client.send(
                    {"type": "generate", "id": request_id, "prompt": "x", "max_tokens": 10**6}
                )
                await client.until(lambda f: f["type"] == "delta")
                if n % 2:
                    # A clean close: the close frame alone must stop the producer,
                    # even though the client no longer reads the backed-up deltas.
                    closing = asyncio.create_task(client.ws.close())
                else:
                    # An abrupt disconnect: the TCP connection just goes away.
                    client.ws.transport.abort()
                    closing = None
                # Generating 10**6 tokens flat out would outlast the join's
                # hang guard: the producer's exit is the disconnect's doing.
                await join_producers(request_id)
                if closing is not None:
                    closing.cancel()
                    await asyncio.gather(closing, return_exceptions=True)
                    client.ws.transport.abort()
        assert len(producer_threads()) == threads_before
    gc.collect()
    assert sum(isinstance(o, janus.Queue) for o in gc.get_objects()) == queues_before


# ---------------------------------------------------------------- pacing


async def test_first_delta_is_immediate_then_frames_respect_the_window() -> None:
    # 200 tokens at 200 tokens/s with a 500 ms window: ~1 s, so at most ~2
    # window flushes plus the immediate first one (count flushing disabled).
    async with (
        running_server(
            backend__fake__tokens_per_s=200.0, stream__flush_ms=500.0, stream__flush_tokens=100000
        ) as server,
        wire(server) as client,
    ):
        await client.send({"type": "generate", "id": "w", "prompt": "pace", "max_tokens": 200})
        text, frames = await client.done("w")
        deltas = [f for f in frames if f["type"] == "delta"]
        done = frames[-1]
        assert text == expected_fake_text("pace", 200)
        # The first token did not wait for the window: had it waited 500 ms at
        # 200 tokens/s, its frame would carry ~100 tokens. Immediate, it carries
        # the first and whatever came while the loop got to it — a token every
        # 5 ms, so a handful even on a loaded machine (at 1000 tokens/s and a
        # 100 ms window, a loop 4 ms late under load made this fail).
        assert len(deltas[0]["text"].split()) <= 10
        elapsed_s = done["timings"]["total_ms"] / 1000
        assert len(deltas) <= 1 + elapsed_s / 0.5 + 2, (len(deltas), elapsed_s)
        assert len(deltas) >= 2


async def test_token_count_does_not_break_the_ceiling() -> None:
    # flush_tokens = 1 makes every token due at once, but the 100 ms window
    # still holds: ~0.2 s of tokens give a handful of frames, not 100.
    async with (
        running_server(
            backend__fake__tokens_per_s=500.0, stream__flush_ms=100.0, stream__flush_tokens=1
        ) as server,
        wire(server) as client,
    ):
        await client.send({"type": "generate", "id": "n", "prompt": "count", "max_tokens": 100})
        text, frames = await client.done("n")
        deltas = [f for f in frames if f["type"] == "delta"]
        elapsed_s = frames[-1]["timings"]["total_ms"] / 1000
        assert 2 <= len(deltas) <= 2 + elapsed_s / 0.1, (len(deltas), elapsed_s)
        assert text == expected_fake_text("count", 100)


async def test_an_unlimited_producer_gets_at_most_one_frame_per_window() -> None:
    # Flat out, the fake backend makes tens of thousands of tokens a second;
    # with the old count rule (a frame every 5 tokens) that was ~830 frames/s.
    # Now consecutive deltas are at least flush_ms apart on the server's
    # clock, so over the request's total time (the server's own measure) there
    # are at most 1 + total/flush_ms of them, plus the final flush before done.
    flush_ms = 10.0
    tokens = 200_000
    async with (
        running_server(
            backend__fake__tokens_per_s=0.0,
            stream__flush_ms=flush_ms,
            stream__flush_tokens=5,
            limits__max_tokens=tokens,
        ) as server,
        wire(server) as client,
    ):
        await client.send(
            {"type": "generate", "id": "u", "prompt": "flat out", "max_tokens": tokens}
        )
        text, frames = await client.done("u", units=60)
        deltas = [f for f in frames if f["type"] == "delta"]
        done = frames[-1]
        total_s = done["timings"]["total_ms"] / 1000
        assert done["usage"]["completion_tokens"] == tokens
        assert len(deltas) <= 2 + total_s * 1000 / flush_ms, (len(deltas), total_s)
        # Tokens merged, nothing lost or reordered.
        assert text == expected_fake_text("flat out", tokens)
        assert tokens / len(deltas) > 5


async def test_a_frame_carries_at_most_its_size_in_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # Flat out with a long window, a frame would gather rate x window tokens.
    # The size rule caps it (lowered here to 1,000 characters so a short
    # request shows it): the rest waits in the channel, nothing is lost.
    monkeypatch.setattr(pacing, "FRAME_TEXT_CHARS", 1000)
    tokens = 6000
    async with (
        running_server(
            backend__fake__tokens_per_s=0.0,
            stream__flush_ms=150.0,
            limits__max_tokens=tokens,
        ) as server,
        wire(server) as client,
    ):
        await client.send({"type": "generate", "id": "s", "prompt": "big", "max_tokens": tokens})
        text, frames = await client.done("s", units=60)
    deltas = [f["text"] for f in frames if f["type"] == "delta"]
    assert text == expected_fake_text("big", tokens)
    assert len(text) > 3 * 1000, "the request must span several full frames"
    # A token adds at most a few characters past the line.
    assert max(len(d) for d in deltas) < 1000 + 8, [len(d) for d in deltas]


# ---------------------------------------------------------------- backpressure


def _thread_cpu_seconds(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


async def test_slow_reader_bounds_memory_blocks_producer_and_loses_nothing() -> None:
    """A client stops reading while the model runs flat out.

    Bound: the connection holds at most queue_tokens pieces in the channel plus
    the websockets write buffer (write_limit) plus one merged frame: 64 KiB
    here. The kernel's own buffers are bounded by SO_SNDBUF and not counted.
    """
    bound = 64 * 1024
    max_tokens = 60000
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        stream__queue_tokens=64,
        server__sndbuf=16384,
        server__write_limit=16384,
        stream__stall_timeout_s=60.0,
    ) as server:
        async with slow_wire(server) as client:
            await client.send(
                {"type": "generate", "id": "slow", "prompt": "stall", "max_tokens": max_tokens}
            )
            await client.until(lambda f: f["type"] == "started")
            (connection,) = server.connections.values()
            generation = connection.generations["slow"]
            # Not reading: wait until the producer blocks on the full channel.
            blocked = await asyncio.to_thread(generation.channel.blocked.wait, timeout(20))
            assert blocked, "the producer never felt the backpressure"
            (thread,) = producer_threads("slow")
            # The channel first fills while the kernel buffers are still taking
            # data: wait until the whole pipeline is full (the producer blocked
            # and no token made for a second, however loaded the machine),
            # then measure for two seconds.
            window = asyncio.Event()
            async with asyncio.timeout(timeout(60)):
                while True:
                    settled = generation.channel.tokens
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(1.0):
                            await window.wait()
                    if generation.channel.blocked.is_set() and (
                        generation.channel.tokens == settled
                    ):
                        break
            cpu_before = _thread_cpu_seconds(thread)
            tokens_before = generation.channel.tokens
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(2.0):
                    await window.wait()
            cpu_spent = _thread_cpu_seconds(thread) - cpu_before
            buffered = connection.buffered_bytes()
            assert generation.channel.blocked.is_set(), "the producer should still be blocked"
            assert generation.channel.tokens == tokens_before, "the producer kept producing"
            assert cpu_spent < 0.05, f"blocked producer used {cpu_spent:.3f}s CPU in 2 s"
            assert buffered < bound, f"{buffered} bytes buffered for one connection"
            # Read again: everything arrives, complete and in order.
            text, frames = await client.done("slow", units=120)
            assert frames[-1]["reason"] == "length"
            assert frames[-1]["usage"]["completion_tokens"] == max_tokens
        slow_text = text
        async with wire(server) as fast:
            await fast.send(
                {"type": "generate", "id": "fast", "prompt": "stall", "max_tokens": max_tokens}
            )
            fast_text, fast_frames = await fast.done("fast", units=120)
        assert slow_text == fast_text == expected_fake_text("stall", max_tokens)
        # While it was stuck, deltas merged: the channel's 64 pieces (each a
        # token's non-empty text) left in one frame once it read again. (Not
        # compared with the fast reader's frames: at an unlimited rate those
        # merge too, the more so on a loaded machine — that comparison raced.)
        slow_deltas = [f for f in frames if f["type"] == "delta"]
        assert max(len(f["text"]) for f in slow_deltas) >= 64
        assert fast_frames[-1]["reason"] == "length"


async def test_a_stalled_client_does_not_hold_the_model_hostage() -> None:
    async with running_server(
        backend__fake__parallel=1,
        backend__fake__tokens_per_s=0.0,
        stream__stall_timeout_s=0.5,
        server__send_timeout_s=60.0,
    ) as server:
        async with slow_wire(server) as stalled:
            await stalled.send(
                {"type": "generate", "id": "hog", "prompt": "x", "max_tokens": 10**6}
            )
            await stalled.until(lambda f: f["type"] == "started")
            # From here on the stalled client reads nothing while another waits.
            async with wire(server) as other:
                await other.send(
                    {"type": "generate", "id": "next", "prompt": "my turn", "max_tokens": 5}
                )
                frames = await other.until(lambda f: f["type"] == "started")
                assert [f["type"] for f in frames] == ["queued", "started"]
                text, _ = await other.done("next")
                assert text == expected_fake_text("my turn", 5)
            # The stalled client reads again: its stream ended with an explicit reason.
            frames = await stalled.until(lambda f: f["type"] == "done", units=60)
            done = frames[-1]
            assert (done["reason"], done["error"]["code"]) == ("error", "stalled")
            text = text_of([f for f in stalled.frames if f.get("id") == "hog"], "hog")
            assert text == expected_fake_text("x", done["usage"]["completion_tokens"])[: len(text)]


# ---------------------------------------------------------------- model queue


async def test_requests_wait_in_fifo_order_with_queued_positions() -> None:
    async with running_server(
        backend__fake__parallel=1, backend__fake__tokens_per_s=200.0
    ) as server:
        async with wire(server) as a, wire(server) as b, wire(server) as c:
            await a.send({"type": "generate", "id": "a", "prompt": "first", "max_tokens": 40})
            await a.until(lambda f: f["type"] == "started")
            await b.send({"type": "generate", "id": "b", "prompt": "second", "max_tokens": 10})
            assert (await b.recv()) == {"type": "queued", "id": "b", "position": 1}
            await c.send({"type": "generate", "id": "c", "prompt": "third", "max_tokens": 10})
            assert (await c.recv()) == {"type": "queued", "id": "c", "position": 2}
            await a.done("a")
            frames = await b.until(lambda f: f["type"] == "started")
            assert frames[-1]["id"] == "b"
            # b took the model: c moves up to position 1.
            assert (await c.recv()) == {"type": "queued", "id": "c", "position": 1}
            await b.done("b")
            text, frames = await c.done("c")
            assert [f["type"] for f in frames][:3] == ["queued", "queued", "started"]
            assert text == expected_fake_text("third", 10)


async def test_cancel_while_queued_and_overload() -> None:
    async with (
        running_server(
            backend__fake__parallel=1,
            backend__fake__max_waiting=1,
            backend__fake__tokens_per_s=100.0,
        ) as server,
        wire(server) as a,
        wire(server) as b,
        wire(server) as c,
    ):
        await a.send({"type": "generate", "id": "a", "prompt": "hold", "max_tokens": 10000})
        await a.until(lambda f: f["type"] == "started")
        await b.send({"type": "generate", "id": "b", "prompt": "wait"})
        await b.until(lambda f: f["type"] == "queued")
        await c.send({"type": "generate", "id": "c", "prompt": "too many"})
        error = (await c.until(lambda f: f["type"] == "error"))[-1]
        assert (error["code"], error["id"]) == ("overloaded", "c")
        await b.send({"type": "cancel", "id": "b"})
        done = (await b.until(lambda f: f["type"] == "done"))[-1]
        assert done["reason"] == "cancelled"
        # c may try again now that the queue has room, and gets position 1.
        await c.send({"type": "generate", "id": "c2", "prompt": "retry", "max_tokens": 3})
        assert (await c.recv())["position"] == 1
        await a.send({"type": "cancel", "id": "a"})
        await a.until(lambda f: f["type"] == "done")
        await c.done("c2")


async def test_accepted_sockets_have_nodelay_and_the_small_send_buffer() -> None:
    async with running_server(server__sndbuf=16384) as server, wire(server):
        (connection,) = server.connections.values()
        sock = connection.ws.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        # Linux doubles the requested size for its bookkeeping.
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 2 * 16384


async def test_a_slow_but_steady_reader_is_never_stalled() -> None:
    """Progress, not speed, decides: a client that keeps reading gets everything,
    even while another request waits for the model it holds."""
    max_tokens = 20000
    async with running_server(
        backend__fake__parallel=1,
        backend__fake__tokens_per_s=0.0,
        stream__stall_timeout_s=4.0,
        server__send_timeout_s=30.0,
    ) as server:
        async with slow_wire(server) as client, wire(server) as waiting:
            await client.send(
                {"type": "generate", "id": "steady", "prompt": "slow", "max_tokens": max_tokens}
            )
            await client.until(lambda f: f["type"] == "started")
            await waiting.send({"type": "generate", "id": "w", "prompt": "next", "max_tokens": 3})
            assert (await waiting.recv())["type"] == "queued"
            loop = asyncio.get_running_loop()
            # The simulated client reads one frame every 10 ms: a pacing delay
            # of the client under test, not a wait for the server.
            while True:
                frame = await client.recv(units=60)
                if frame["type"] == "done":
                    break
                pause = loop.create_future()
                loop.call_later(0.01, pause.set_result, None)
                await pause
            assert frame["reason"] == "length", frame
            text = text_of([f for f in client.frames if f.get("id") == "steady"], "steady")
            assert text == expected_fake_text("slow", max_tokens)
            # The waiting request gets the model once the steady one is done.
            await waiting.done("w")


class _FailingBackend(FakeBackend):
    """Fails the way a backend reports a request it cannot serve."""

    def generate(self, request, *, slot, sink, cancel):  # type: ignore[no-untyped-def]
        if request.prompt == "too long":
            raise BackendError("the prompt does not fit", code="too_large")
        raise RuntimeError("secret internal detail")


async def test_backend_failures_end_the_request_with_a_code_and_no_traceback() -> None:
    server = Server(make_config(), backend=_FailingBackend())
    await server.start()
    try:
        await server.wait_ready()
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "a", "prompt": "too long"})
            done = (await client.until(lambda f: f["type"] == "done"))[-1]
            assert (done["reason"], done["error"]["code"]) == ("error", "too_large")
            await client.send({"type": "generate", "id": "b", "prompt": "boom"})
            done = (await client.until(lambda f: f["type"] == "done"))[-1]
            assert (done["reason"], done["error"]["code"]) == ("error", "internal")
            assert "secret" not in done["error"]["message"]
            # The connection and the server carry on.
            await client.send({"type": "cancel", "id": "b"})
            assert (await client.recv())["code"] == "unknown_id"
    finally:
        await server.stop(grace=0)
