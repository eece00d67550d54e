"""The openai backend against a real, fault-injecting upstream (tests/fake_upstream.py).

Real sockets all the way: a WebSocket client → the real server → the openai
backend → HTTP on 127.0.0.1 → an aiohttp.web upstream. The upstream records
what it was asked and when its client left; the tests wait on those events
(never on time) and check what the WebSocket client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import psutil
import pytest
from conftest import make_config, slow_wire, timeout, wire
from fake_upstream import PIECES, FakeUpstream
from test_metrics import scrape

from wsserver.aio import Server
from wsserver.backends.openai import OpenAIBackend
from wsserver.backends.openai_wire import parse_chunk

TEXT = "".join(PIECES)


@contextlib.asynccontextmanager
async def relay(*urls: str, **options: Any) -> AsyncIterator[Server]:
    """The real server with an openai backend in front of ``urls``."""
    server_overrides = {k: options.pop(k) for k in list(options) if k.startswith("stream__")}
    if "aliases" in options:
        server_overrides["backend__openai__aliases"] = options.pop("aliases")
        server_overrides["backend__openai__model"] = options["model"]
    options.setdefault("max_backoff_s", 0.5)
    backend = OpenAIBackend(urls=list(urls), backoff_s=0.05, **options)
    config = make_config(
        backend__kind="openai", backend__openai__urls=list(urls), **server_overrides
    )
    server = Server(config, backend)
    await server.start()
    try:
        async with asyncio.timeout(timeout(20)):
            await server.wait_ready()
        yield server
    finally:
        await server.stop(grace=0)


def gen(request_id: str, **fields: Any) -> dict[str, Any]:
    return {"type": "generate", "id": request_id, "prompt": "p", **fields}


async def test_a_completion_streams_the_upstreams_text_and_usage() -> None:
    async with FakeUpstream() as up, relay(up.url, api_key="sk-test") as server:
        async with wire(server) as client:
            assert client.hello is not None and client.hello["model"] == "fake-upstream"
            await client.send(
                gen("a", max_tokens=50, temperature=0.2, top_p=0.5, top_k=7, seed=3, stop=["zz"])
            )
            text, frames = await client.done("a")
    assert text == TEXT
    assert frames[-1]["reason"] == "stop"
    assert frames[-1]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": len(PIECES),
        "cached_tokens": 0,
    }
    (stream,) = up.streams
    assert stream.path == "/v1/completions"
    assert stream.body == {
        "model": "fake-upstream",
        "prompt": "p",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
        "temperature": 0.2,
        "top_p": 0.5,
        "top_k": 7,
        "seed": 3,
        "stop": ["zz"],
    }
    assert stream.headers["Authorization"] == "Bearer sk-test"


async def test_the_sampler_options_given_are_forwarded_by_their_llama_server_names() -> None:
    options = {
        "min_p": 0.1,
        "typical_p": 0.9,
        "repeat_penalty": 1.2,
        "repeat_last_n": 128,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"15": 2, "Hello": False},
        "dry_multiplier": 0.8,
        "dry_sequence_breakers": ["\n"],
        "xtc_probability": 0.5,
        "xtc_threshold": 0.2,
    }
    async with FakeUpstream() as up, relay(up.url) as server:
        async with wire(server) as client:
            # Defaults given explicitly are not sent: the upstream keeps its own.
            await client.send(gen("a", **options, dry_base=1.75))
            await client.done("a")
    (stream,) = up.streams
    sent = {k: v for k, v in stream.body.items() if k in options or k.startswith("dry_")}
    assert sent == options


async def test_a_grammar_and_a_schema_are_forwarded() -> None:
    schema = {"type": "object"}
    async with FakeUpstream() as up, relay(up.url) as server:
        async with wire(server) as client:
            await client.send(gen("g", grammar='root ::= "a"'))
            await client.done("g")
            await client.send(gen("s", json_schema=schema))
            await client.done("s")
            messages = [{"role": "user", "content": "u"}]
            await client.send(
                {"type": "generate", "id": "c", "messages": messages, "json_schema": schema}
            )
            await client.done("c")
    grammar, completion, chat = up.streams
    assert grammar.body["grammar"] == 'root ::= "a"'
    assert completion.body["json_schema"] == schema
    assert chat.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


async def test_a_chat_goes_to_chat_completions() -> None:
    async with FakeUpstream() as up, relay(up.url, model="m1") as server:
        async with wire(server) as client:
            messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
            await client.send({"type": "generate", "id": "c", "messages": messages})
            text, frames = await client.done("c")
    assert text == TEXT and frames[-1]["reason"] == "stop"
    (stream,) = up.streams
    assert stream.path == "/v1/chat/completions"
    assert stream.body["messages"] == messages and stream.body["model"] == "m1"
    assert up.models_requests == 0  # a configured model needs no listing


async def test_without_usage_the_chunks_are_counted() -> None:
    async with FakeUpstream() as up, relay(up.url) as server:
        up.send_usage = False
        async with wire(server) as client:
            await client.send(gen("a"))
            text, frames = await client.done("a")
    assert text == TEXT
    assert frames[-1]["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": len(PIECES),
        "cached_tokens": 0,
    }


async def test_a_stop_string_the_upstream_ignored_ends_the_request() -> None:
    async with FakeUpstream() as up, relay(up.url) as server:
        up.mode = "endless"
        async with wire(server) as client:
            await client.send(gen("a", stop=["ld —"]))
            text, frames = await client.done("a")
        assert text == "Hello, wor"
        assert frames[-1]["reason"] == "stop" and frames[-1]["stop_sequence"] == "ld —"
        async with asyncio.timeout(timeout()):
            await up.streams[0].disconnected.wait()  # and its stream was closed


async def test_cancel_closes_the_upstream_stream_at_once() -> None:
    async with FakeUpstream() as up, relay(up.url, parallel=1) as server:
        up.mode = "endless"
        async with wire(server) as client:
            for n in range(10):  # repeated cancels leak nothing, and the slot comes back
                await client.send(gen(f"a{n}"))
                await client.until(lambda f, n=n: f["type"] == "delta" and f["id"] == f"a{n}")
                await client.send({"type": "cancel", "id": f"a{n}"})
                frames = await client.until(
                    lambda f, n=n: f["type"] == "done" and f["id"] == f"a{n}"
                )
                assert frames[-1]["reason"] == "cancelled"
                stream = await up.next_stream(n)
                async with asyncio.timeout(timeout()):
                    await stream.disconnected.wait()
            up.mode = "ok"
            await client.send(gen("b"))
            text, _ = await client.done("b")
            assert text == TEXT
            # Every cancelled stream's connection was closed, not kept: at most
            # the one that served "b" is left, idle in the pool.
            port = int(up.url.split(":")[2].split("/")[0])
            open_to_upstream = [
                c
                for c in psutil.Process().net_connections(kind="tcp")
                if c.raddr and c.raddr[1] == port and c.status == psutil.CONN_ESTABLISHED
            ]
            assert len(open_to_upstream) <= 1


async def test_a_slow_reader_pauses_its_upstream_and_no_other() -> None:
    async with FakeUpstream(sndbuf=4096) as up, relay(up.url, stream__queue_tokens=4) as server:
        up.mode = "endless"
        async with slow_wire(server) as slow, wire(server) as fast:
            await slow.send(gen("s"))
            await slow.until(lambda f: f["type"] == "delta")
            slow.ws.transport.pause_reading()  # from now on, read nothing
            stream = await up.next_stream(0)
            up.mode = "ok"
            (connection,) = [c for c in server.connections.values() if "s" in c.generations]
            channel = connection.generations["s"].channel
            # Buffers along the way (the sockets', aiohttp's, the channel) are
            # finite: soon the upstream's write stays blocked while a whole other
            # request runs through the same backend and loop. (The slow client
            # itself may still trickle: the kernel packs its full receive queue
            # and lets a few more frames in now and then. That moves text out
            # of the channel, not bytes out of the upstream.)
            for attempt in range(50):
                assert await asyncio.to_thread(channel.blocked.wait, timeout(20))
                before = stream.bytes_sent
                await fast.send(gen(f"f{attempt}"))
                text, _ = await fast.done(f"f{attempt}")
                assert text == TEXT
                if stream.writing and stream.bytes_sent == before:
                    break
            else:
                raise AssertionError("the upstream was never paused by the slow reader")
            assert channel.buffered_bytes() <= 4 * max(len(p.encode()) for p in PIECES)
            slow.ws.transport.abort()
        async with asyncio.timeout(timeout()):
            await stream.disconnected.wait()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


FAULTS = [
    ("status", {"status": 500}, "upstream_failed", "HTTP 500: upstream says no (500)"),
    ("status", {"status": 429}, "upstream_failed", "HTTP 429"),
    ("status", {"status": 400}, "upstream_rejected", "HTTP 400: upstream says no (400)"),
    ("hang", {}, "upstream_timeout", "sent nothing within"),
    ("silence", {}, "upstream_silent", "mid-stream"),
    ("drop", {}, "upstream_truncated", "before its final chunk"),
    ("no_final", {}, "upstream_truncated", "before its final chunk"),
    ("malformed", {}, "upstream_bad_stream", "not JSON"),
    ("bad_sse", {}, "upstream_bad_stream", "malformed"),
    ("not_streamed", {}, "upstream_bad_stream", "not an event stream"),
    ("error_event", {}, "upstream_failed", "out of memory"),
]


@pytest.mark.parametrize(("mode", "attrs", "code", "message"), FAULTS)
async def test_each_upstream_fault_ends_with_its_code(
    mode: str, attrs: dict[str, Any], code: str, message: str
) -> None:
    timeouts = {"first_byte_timeout_s": 0.5 * timeout(1), "silence_timeout_s": 0.5 * timeout(1)}
    async with FakeUpstream() as up, relay(up.url, **timeouts) as server:
        up.mode = mode
        for name, value in attrs.items():
            setattr(up, name, value)
        backend = server.backend
        assert isinstance(backend, OpenAIBackend)
        async with wire(server) as client:
            await client.send(gen("a"))
            _, frames = await client.done("a")
            done = frames[-1]
            assert done["reason"] == "error"
            assert done["error"]["code"] == code
            assert message in done["error"]["message"]
            # The connection stays usable and the upstream serves again
            # (after its probe, for a fault that took it out of rotation).
            up.mode = "ok"
            async with asyncio.timeout(timeout()):
                await backend.upstreams[0].in_rotation.wait()
            await client.send(gen("b"))
            text, frames = await client.done("b")
            assert text == TEXT and frames[-1]["reason"] == "stop"
        if mode in ("hang", "silence", "malformed", "bad_sse", "error_event"):
            # A stream given up on is closed, not left running upstream.
            async with asyncio.timeout(timeout()):
                await up.streams[0].disconnected.wait()


async def test_an_unreachable_upstream_is_reported() -> None:
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    async with relay(url, model="m") as server:
        async with wire(server) as client:
            await client.send(gen("a"))
            _, frames = await client.done("a")
            assert frames[-1]["error"]["code"] == "upstream_unreachable"
            assert "connection refused" in frames[-1]["error"]["message"]
            # Out of rotation now: the next one fails at once, and says why.
            await client.send(gen("b"))
            _, frames = await client.done("b")
            assert frames[-1]["error"]["code"] == "upstream_unreachable"


async def test_queue_positions_with_one_stream_per_upstream() -> None:
    async with FakeUpstream() as up, relay(up.url, parallel=1) as server:
        up.mode = "endless"
        async with wire(server) as first, wire(server) as second:
            await first.send(gen("a"))
            await first.until(lambda f: f["type"] == "delta")
            await second.send(gen("b"))
            queued = await second.until(lambda f: f["type"] == "queued")
            assert queued[-1]["position"] == 1
            up.mode = "ok"
            await first.send({"type": "cancel", "id": "a"})
            text, frames = await second.done("b")
            assert text == TEXT
            assert [f["type"] for f in frames][:2] == ["queued", "started"]


async def test_requests_go_to_the_upstream_with_fewest_in_flight_and_retry_once() -> None:
    async with FakeUpstream() as a, FakeUpstream() as b, relay(a.url, b.url, model="m") as server:
        backend = server.backend
        assert isinstance(backend, OpenAIBackend)
        a.mode = b.mode = "endless"
        # Small receive buffers: the endless streams fill them within
        # kilobytes, so reading on to the done is quick even on a busy machine
        # (with Linux's autotuned megabytes it meant validating thousands of
        # frames: the test timed out at load average 6).
        async with slow_wire(server) as one, slow_wire(server) as two:
            await one.send(gen("x", max_tokens=1_000_000))
            await one.until(lambda f: f["type"] == "delta")
            await two.send(gen("y", max_tokens=1_000_000))
            await two.until(lambda f: f["type"] == "delta")
            assert (len(a.streams), len(b.streams)) == (1, 1)
            await one.send({"type": "cancel", "id": "x"})
            await one.until(lambda f: f["type"] == "done")
            await two.send({"type": "cancel", "id": "y"})
            await two.until(lambda f: f["type"] == "done")
            # A fails before the first token: the request moves to B, once.
            a.mode, a.status, b.mode = "status", 503, "ok"
            await one.send(gen("z"))
            text, frames = await one.done("z")
            assert text == TEXT and frames[-1]["reason"] == "stop"
            assert (len(a.streams), len(b.streams)) == (2, 2)
            assert not backend.upstreams[0].healthy and backend.upstreams[1].healthy
            samples = await scrape(server)
            for url, requests, errors, healthy in ((a.url, 2, 1, 0), (b.url, 2, 0, 1)):
                label = f'{{upstream="{url}"}}'
                assert samples[f"wsserver_upstream_requests_total{label}"] == requests
                assert samples[f"wsserver_upstream_errors_total{label}"] == errors
                assert samples[f"wsserver_upstream_healthy{label}"] == healthy
                assert samples[f"wsserver_upstream_in_flight{label}"] == 0
            assert samples[f'wsserver_upstream_first_byte_seconds_count{{upstream="{b.url}"}}'] == 2


async def test_an_upstream_killed_mid_run_loses_and_duplicates_nothing() -> None:
    async with FakeUpstream() as a, FakeUpstream() as b, relay(a.url, b.url, model="m") as server:
        backend = server.backend
        assert isinstance(backend, OpenAIBackend)
        a.mode = b.mode = "endless"
        # Small receive buffers: the endless streams fill them within
        # kilobytes, so reading on to the done is quick even on a busy machine
        # (with Linux's autotuned megabytes it meant validating thousands of
        # frames: the test timed out at load average 6).
        async with slow_wire(server) as one, slow_wire(server) as two:
            await one.send(gen("x", max_tokens=1_000_000))
            await one.until(lambda f: f["type"] == "delta")
            await two.send(gen("y", max_tokens=1_000_000))
            await two.until(lambda f: f["type"] == "delta")
            await a.stop()  # x was on A: it had text, so it ends (no retry after text)
            frames = await one.until(lambda f: f["type"] == "done" and f["id"] == "x")
            assert frames[-1]["error"]["code"] == "upstream_truncated"
            assert not backend.upstreams[0].healthy
            b.mode = "ok"
            for n in range(4):  # every new request goes to B, each exactly once
                await one.send(gen(f"n{n}"))
                text, done = await one.done(f"n{n}")
                assert text == TEXT and done[-1]["reason"] == "stop"
            assert len(b.streams) == 5 and len(a.streams) == 1
            await two.send({"type": "cancel", "id": "y"})
            await two.until(lambda f: f["type"] == "done")


async def test_readyz_is_ready_while_an_upstream_is_in_rotation() -> None:
    from test_security import http

    up = FakeUpstream()
    await up.start()
    port = int(up.url.split(":")[2].split("/")[0])
    try:
        async with relay(up.url, model="m") as server:
            backend = server.backend
            assert isinstance(backend, OpenAIBackend)
            assert (await http(server, "/readyz"))[0] == 200
            await up.stop()  # the only upstream goes away
            async with wire(server) as client:
                await client.send(gen("a"))
                _, frames = await client.done("a")
            assert frames[-1]["error"]["code"] == "upstream_unreachable"
            status, _, body = await http(server, "/readyz")
            assert status == 503 and b"no upstream is in rotation" in body
            await up.start(port)  # back: the probe finds it
            async with asyncio.timeout(timeout()):
                await backend.upstreams[0].in_rotation.wait()
            assert (await http(server, "/readyz"))[0] == 200
            async with wire(server) as client:
                await client.send(gen("b"))
                text, _ = await client.done("b")
            assert text == TEXT
    finally:
        await up.stop()


def test_the_stop_string_an_upstream_names_is_read() -> None:
    # vLLM says which stop string it stopped at (its choice's ``stop_reason``).
    vllm = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "##"}]}
    assert parse_chunk(json.dumps(vllm)).stop_string == "##"
    eos = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": None}]}
    assert parse_chunk(json.dumps(eos)).stop_string is None


# ---------------------------------------------------------------- hardening III (issue 26)


async def test_a_compressed_body_is_refused_and_identity_is_asked_for() -> None:
    """Fault 2: 20 KB of gzip that expands to 20 MiB of blank lines froze the loop."""
    async with FakeUpstream() as up, relay(up.url, model="m") as server:
        up.mode = "gzip_bomb"
        async with wire(server) as client:
            await client.send(gen("a"))
            _, frames = await client.done("a")
        assert frames[-1]["error"]["code"] == "upstream_bad_stream"
        assert "Content-Encoding 'gzip'" in frames[-1]["error"]["message"]
        assert up.streams[0].headers["Accept-Encoding"] == "identity"


async def test_huge_upstream_events_are_bounded_by_bytes_in_the_channel() -> None:
    """Fault 3: a channel of 64 pieces held 64 events of a megabyte each."""
    async with FakeUpstream() as up, relay(up.url, model="m") as server:
        up.mode = "endless"
        up.pieces = ["x" * 200_000]
        async with slow_wire(server) as client:
            await client.send(gen("a", max_tokens=1_000_000))
            await client.until(lambda f: f["type"] == "delta")
            (connection,) = server.connections.values()
            generation = connection.generations["a"]
            assert await asyncio.to_thread(generation.channel.blocked.wait, timeout(20))
            queue_tokens = server.config.stream.queue_tokens
            assert generation.channel.buffered_bytes() <= queue_tokens * 256 + 1024
            await client.send({"type": "cancel", "id": "a"})


@pytest.mark.parametrize("piece", ["ab", "y" * 10_000])
async def test_an_upstream_that_ignores_max_tokens_is_cut_at_the_limit(piece: str) -> None:
    """Fault 7: an endless upstream gave a max_tokens 5 request 352k characters."""
    async with FakeUpstream() as up, relay(up.url, model="m") as server:
        up.mode = "endless"
        up.pieces = [piece]
        up.send_usage = False
        async with wire(server) as client:
            await client.send(gen("a", max_tokens=5))
            text, frames = await client.done("a")
        assert frames[-1]["reason"] == "length"
        assert frames[-1]["usage"]["completion_tokens"] <= 5
        assert len(text) <= 5 * 16
        async with asyncio.timeout(timeout()):
            await up.streams[0].disconnected.wait()  # and its stream was closed


async def test_keep_alive_comments_are_no_content_for_the_silence_timeout() -> None:
    """Fault 8: an upstream sending only ": keep-alive" held a request forever."""
    async with (
        FakeUpstream() as up,
        relay(up.url, model="m", silence_timeout_s=timeout(0.5)) as server,
    ):
        up.mode = "comments"
        up.token_delay = timeout(0.05)
        async with wire(server) as client:
            await client.send(gen("a"))
            _, frames = await client.done("a")
        assert frames[-1]["error"]["code"] == "upstream_silent"


async def test_an_upstreams_model_name_is_clipped_and_cleaned_where_it_is_shown() -> None:
    """Fault 12: a 5 KB id with newlines and ESC reached hello and the chunks."""
    raw = "evil\n\x1b[31m" + "x" * 5000
    async with FakeUpstream(model=raw) as up, relay(up.url) as server:
        async with wire(server) as client:
            assert client.hello is not None
            shown = client.hello["model"]
            await client.send(gen("a"))
            text, _ = await client.done("a")
        assert text == TEXT
        assert len(shown) <= 256 and shown.startswith("evil??[31m")
        assert up.streams[0].body["model"] == raw  # the upstream is asked for its own id
        samples = await scrape(server)
        (info,) = [k for k in samples if k.startswith("wsserver_info")]
        assert f'model="{shown}"' in info


async def test_the_relay_starts_before_its_upstream_and_serves_once_it_answers() -> None:
    """Also: with no model configured, wsserver exited 1 if no upstream answered."""
    from test_security import http

    up = FakeUpstream()
    await up.start()
    port = int(up.url.split(":")[2].split("/")[0])
    await up.stop()
    try:
        async with relay(up.url) as server:
            backend = server.backend
            assert isinstance(backend, OpenAIBackend)
            status, _, body = await http(server, "/readyz")
            assert status == 503 and b"no upstream has listed a model" in body
            async with wire(server) as client:
                await client.send(gen("a"))
                _, frames = await client.done("a")
                assert frames[-1]["error"]["code"] == "upstream_unavailable"
                # A named model cannot be checked before a listing: the same answer.
                await client.send(gen("n", model="fake-upstream"))
                _, frames = await client.done("n")
                assert frames[-1]["error"]["code"] == "upstream_unavailable"
            await up.start(port)
            backend.unready_reason()  # looks again (as /readyz does)
            discovery = backend._discovery
            if discovery is not None:
                await asyncio.wait_for(asyncio.shield(discovery), timeout())
            assert (await http(server, "/readyz"))[0] == 200
            async with wire(server) as client:
                assert client.hello is not None and client.hello["model"] == "fake-upstream"
                await client.send(gen("b"))
                text, _ = await client.done("b")
            assert text == TEXT
            assert 'model="fake-upstream"' in "".join(await scrape(server))
    finally:
        await up.stop()


async def test_a_configured_model_is_strict_and_its_aliases_reach_it() -> None:
    import openai

    async with FakeUpstream() as up, relay(up.url, model="m", aliases=["gpt-4o"]) as server:
        async with wire(server) as client:
            assert client.hello is not None
            assert [(m["name"], m["aliases"]) for m in client.hello["models"]] == [
                ("m", ["gpt-4o"])
            ]
            await client.send(gen("a", model="gpt-4o"))
            text, frames = await client.done("a")
            assert text == TEXT and frames[-1]["model"] == "m"
            await client.send(gen("x", model="gpt-5"))
            refused = await client.recv()
            assert (refused["type"], refused["code"]) == ("error", "model_not_found")
        sdk = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            completion = await sdk.completions.create(model="gpt-4o", prompt="p", max_tokens=50)
            assert completion.model == "m"
            with pytest.raises(openai.NotFoundError) as caught:
                await sdk.completions.create(model="gpt-5", prompt="p")
            assert caught.value.code == "model_not_found"
        finally:
            await sdk.close()
        # The upstream is asked for the configured model, whatever name was used.
        assert [s.body["model"] for s in up.streams] == ["m", "m"]


async def test_two_upstreams_serving_different_models_get_their_own_requests() -> None:
    """Routing by model: each upstream's /v1/models says what it serves."""
    import openai

    async with (
        FakeUpstream(model="m-one") as one,
        FakeUpstream(model="m-two") as two,
        relay(one.url, two.url) as server,
    ):
        async with wire(server) as client:
            assert client.hello is not None
            assert [(m["name"], m["state"]) for m in client.hello["models"]] == [
                ("m-one", "loaded"),
                ("m-two", "loaded"),
            ]
            for request_id, model in (("a", "m-two"), ("b", "m-one"), ("c", "m-two")):
                await client.send(gen(request_id, model=model))
                text, frames = await client.done(request_id)
                assert text == TEXT and frames[-1]["model"] == model
            await client.send(gen("d"))  # no model: the default, the first listed
            _, frames = await client.done("d")
            assert frames[-1]["model"] == "m-one"
            await client.send(gen("x", model="m-three"))
            refused = await client.recv()
            assert (refused["type"], refused["code"]) == ("error", "model_not_found")
        assert [s.body["model"] for s in one.streams] == ["m-one", "m-one"]
        assert [s.body["model"] for s in two.streams] == ["m-two", "m-two"]
        sdk = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            listed = await sdk.models.list()
            assert [m.id for m in listed.data] == ["m-one", "m-two"]
            completion = await sdk.completions.create(model="m-two", prompt="p", max_tokens=50)
            assert completion.model == "m-two" and two.streams[-1].body["model"] == "m-two"
            with pytest.raises(openai.NotFoundError) as caught:
                await sdk.completions.create(model="m-three", prompt="p")
            assert caught.value.code == "model_not_found"
        finally:
            await sdk.close()
        assert len(one.streams) == 2 and len(two.streams) == 3


async def test_a_model_goes_to_the_least_busy_upstream_that_serves_it() -> None:
    async with (
        FakeUpstream(model="shared") as one,
        FakeUpstream(model="shared") as two,
        FakeUpstream(model="other") as three,
        relay(one.url, two.url, three.url) as server,
    ):
        one.mode = two.mode = "endless"
        async with wire(server) as first, wire(server) as second:
            await first.send(gen("a", model="shared"))
            await one.next_stream(0)
            await second.send(gen("b", model="shared"))
            await two.next_stream(0)  # the idle one of the two that serve it
            assert not three.streams
            for client, request_id in ((first, "a"), (second, "b")):
                await client.send({"type": "cancel", "id": request_id})
                await client.done(request_id)


async def test_several_choices_go_upstream_as_a_request_each_with_its_seed() -> None:
    """The relay serves ``n`` as it serves any request, once per choice
    (docs/upstream.md): no ``n`` upstream, ``seed + k``."""
    async with FakeUpstream() as up, relay(up.url, parallel=2) as server:
        async with wire(server) as client:
            await client.send(gen("n", max_tokens=50, seed=3, n=2))
            _, frames = await client.done("n")
    texts: dict[int, str] = {}
    for frame in frames:
        if frame["type"] == "delta":
            texts[frame["choice"]] = texts.get(frame["choice"], "") + frame["text"]
    assert texts == {0: TEXT, 1: TEXT}
    assert frames[-1]["usage"]["completion_tokens"] == 2 * len(PIECES)
    assert sorted(stream.body["seed"] for stream in up.streams) == [3, 4]
    assert all("n" not in stream.body for stream in up.streams)
