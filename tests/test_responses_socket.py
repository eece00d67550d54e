"""The Responses API's WebSocket mode end to end: ``client.responses.connect()``
of the official ``openai`` SDK against a real server on ``/v1/responses``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from conftest import (
    FAKE_MODEL,
    handlers_finished,
    producers_joined,
    running_server,
    timeout,
    wire,
)
from test_metrics import scrape
from websockets.asyncio.client import connect as ws_connect

from wsserver.aio import Server
from wsserver.aio.driver import RequestDriver
from wsserver.aio.peer import PeerAwareConnection
from wsserver.aio.pipeline import Generation
from wsserver.aio.responses_socket import ResponsesDialect
from wsserver.aio.socket_connection import SocketConnection

TERMINAL = ("response.completed", "response.incomplete", "response.failed")


@contextlib.asynccontextmanager
async def connected(server: Server, api_key: str = "unused") -> AsyncIterator[Any]:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1",
        api_key=api_key,
        max_retries=0,
        timeout=timeout(30),
    )
    try:
        async with client.responses.connect(max_retries=0) as connection:
            yield connection
    finally:
        await client.close()


async def until_terminal(connection: Any) -> list[Any]:
    events = []
    async with asyncio.timeout(timeout(30)):
        async for event in connection:
            events.append(event)
            if event.type in (*TERMINAL, "error"):
                return events
    raise AssertionError("the socket closed before the response ended")


async def next_event(connection: Any, kind: str) -> Any:
    async with asyncio.timeout(timeout(30)):
        async for event in connection:
            if event.type == kind:
                return event
    raise AssertionError(f"no {kind}")


def requests_ended(server: Server, reason: str) -> float:
    value = server.metrics.registry.get_sample_value("wsserver_requests_total", {"reason": reason})
    return value or 0.0


def responses_socket(server: Server) -> tuple[SocketConnection, ResponsesDialect]:
    """The one open connection in the Responses WebSocket mode, and its dialect."""
    (connection,) = [
        c for c in server.connections.values() if isinstance(c.dialect, ResponsesDialect)
    ]
    assert isinstance(connection.dialect, ResponsesDialect)
    return connection, connection.dialect


async def ws_text(server: Server, **fields: Any) -> str:
    async with wire(server) as client:
        await client.send({"type": "generate", "id": "w", **fields})
        text, _ = await client.done("w")
        return text


async def test_three_chained_creates_on_one_socket() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        async with connected(server) as connection:
            previous: str | None = None
            texts: list[str] = []
            for turn in ("one", "two", "three"):
                body: dict[str, Any] = {
                    "type": "response.create",
                    "model": FAKE_MODEL,
                    "input": turn,
                    "max_output_tokens": 4,
                }
                if previous is not None:
                    body["previous_response_id"] = previous
                await connection.send(body)
                events = await until_terminal(connection)
                assert [e.sequence_number for e in events] == list(range(len(events)))
                assert events[0].type == "response.created"
                final = events[-1].response
                assert final.previous_response_id == previous
                previous = final.id
                texts.append(final.output_text)
            _, dialect = responses_socket(server)
            assert len(dialect.store) == 3
            assert dialect.store.bytes <= server.config.limits.responses_memory_bytes
        # The third turn saw the whole conversation.
        expected = await ws_text(
            server,
            max_tokens=4,
            messages=[
                {"role": "user", "content": "one"},
                {"role": "assistant", "content": texts[0]},
                {"role": "user", "content": "two"},
                {"role": "assistant", "content": texts[1]},
                {"role": "user", "content": "three"},
            ],
        )
        assert texts[2] == expected


# The SDK's sync client opens websockets' sync connection without a context
# manager, which websockets >= 17.1 warns about: the SDK's, not ours.
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")
async def test_the_sync_client_connects_too() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="x",
            max_retries=0,
            timeout=timeout(30),
        )

        def converse() -> list[str]:
            with client.responses.connect(max_retries=0) as connection:
                connection.send({"type": "response.create", "input": "hi", "max_output_tokens": 3})
                kinds = []
                for event in connection:
                    kinds.append(event.type)
                    if event.type in TERMINAL:
                        return kinds
            return kinds

        try:
            kinds = await asyncio.wait_for(asyncio.to_thread(converse), timeout(30))
        finally:
            client.close()
        assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"


async def test_two_lanes_run_at_once_each_event_names_its_lane() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=0.0, backend__fake__parallel=2) as server,
        connected(server) as connection,
    ):
        for lane in ("a", "b"):
            await connection.send(
                {
                    "type": "response.create",
                    "input": lane,
                    "max_output_tokens": 5,
                    "stream_id": lane,
                }
            )
        ended: dict[str, str] = {}
        async with asyncio.timeout(timeout(30)):
            async for event in connection:
                assert event.stream_id in ("a", "b")
                if event.type in TERMINAL:
                    ended[event.stream_id] = event.response.status
                    if len(ended) == 2:
                        break
        assert ended == {"a": "incomplete", "b": "incomplete"}


async def test_response_cancel_ends_it_at_once_and_frees_the_engine() -> None:
    async with (
        running_server(backend__fake__tokens_per_s=20.0, backend__fake__parallel=1) as server,
        connected(server) as connection,
    ):
        await connection.send(
            {"type": "response.create", "input": "long", "max_output_tokens": 100_000}
        )
        created = await next_event(connection, "response.created")
        await next_event(connection, "response.output_text.delta")
        await connection.send({"type": "response.cancel", "response_id": created.response.id})
        final = (await until_terminal(connection))[-1]
        assert final.type == "response.incomplete"
        assert final.response.incomplete_details.reason == "cancelled"
        assert requests_ended(server, "cancelled") == 1
        # The one slot is free: the next response gets it and runs to its end.
        await connection.send({"type": "response.create", "input": "next", "max_output_tokens": 2})
        assert (await until_terminal(connection))[-1].response.status == "incomplete"
        assert requests_ended(server, "length") == 1


async def test_closing_the_socket_mid_stream_frees_the_engine() -> None:
    async with running_server(
        backend__fake__tokens_per_s=20.0, backend__fake__parallel=1
    ) as server:
        async with connected(server) as connection:
            await connection.send(
                {"type": "response.create", "input": "long", "max_output_tokens": 100_000}
            )
            await next_event(connection, "response.output_text.delta")
        # Gone: the next request (over HTTP) gets the only slot.
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="x",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            reply = await client.responses.create(model=FAKE_MODEL, input="hi", max_output_tokens=2)
        finally:
            await client.close()
        assert reply.status == "incomplete"
        assert not server.connections
        # The reply is whole before its own engine has let go (under load,
        # a thread's exit can lag): join, then nothing may be running.
        await producers_joined()
        assert server.producer_threads() == 0


async def test_bad_events_are_errors_and_the_socket_stays_usable() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        async with connected(server) as connection:
            bad: list[tuple[dict[str, Any], str]] = [
                (
                    {"type": "response.create", "input": "x", "tools": [{"type": "file_search"}]},
                    "tools",
                ),
                (
                    {"type": "response.create", "input": [{"type": "item_reference", "id": "x"}]},
                    "item_reference",
                ),
                (
                    {"type": "response.create", "input": "x", "previous_response_id": "resp_no"},
                    "resp_no",
                ),
                ({"type": "response.cancel", "response_id": "resp_gone"}, "resp_gone"),
                ({"type": "session.update"}, "session.update"),
                ({"type": "response.create", "input": "x" * 200_000}, "'input'"),
            ]
            for event, named in bad:
                await connection.send(event)
                error = await next_event(connection, "error")
                assert named in error.error.message, error.error.message
                assert error.status in (400, 404, 413)
            await connection.send(
                {"type": "response.create", "input": "ok", "max_output_tokens": 2}
            )
            assert (await until_terminal(connection))[-1].type == "response.incomplete"


#: Frames that are no JSON object: each an ``error`` event, the socket kept.
NOT_AN_OBJECT: list[tuple[str, str | bytes]] = [
    ("invalid JSON", '{"type": "response.create", "input": '),
    ("an array", '[{"type": "response.create", "input": "x"}]'),
    ("a string", '"response.create"'),
    ("null", "null"),
    ("NaN", "NaN"),
    ("5,000-deep nesting", "[" * 5000 + "]" * 5000),
    ("a number", "42"),
    ("binary, not UTF-8", b"\xff\xfe{"),
]


async def test_a_frame_that_is_no_json_object_is_an_error_and_the_socket_stays() -> None:
    """Issue 34, fault 6: each of these closed the socket (an UnboundLocalError
    in the receive loop), ending every other response on it, and none was
    counted. Each is now an ``error`` (``bad_json``), counted in
    ``wsserver_errors_total`` like every wire's refusals; a response running
    on another lane meanwhile goes on, and a new one after completes."""
    async with (
        running_server(backend__fake__tokens_per_s=100.0, backend__fake__parallel=2) as server,
        connected(server) as connection,
    ):
        before = (await scrape(server)).get('wsserver_errors_total{code="bad_json"}', 0.0)
        await connection.send(
            {"type": "response.create", "input": "x", "max_output_tokens": 10**6, "stream_id": "bg"}
        )
        running = (await next_event(connection, "response.created")).response.id
        for refused, (what, payload) in enumerate(NOT_AN_OBJECT, start=1):
            await connection.send_raw(payload)
            async with asyncio.timeout(timeout(30)):
                async for event in connection:
                    if event.type == "error":
                        break
                    # Only the running response's own events meanwhile.
                    assert event.stream_id == "bg" and event.type not in TERMINAL, (what, event)
            assert event.status == 400, what
            assert event.error.code == "bad_json", (what, event.error)
            assert getattr(event, "stream_id", None) is None, what
            counted = (await scrape(server))['wsserver_errors_total{code="bad_json"}']
            assert counted == before + refused, what
        # The response running all along is still streaming; cancelled, it ends.
        await next_event(connection, "response.output_text.delta")
        await connection.send({"type": "response.cancel", "response_id": running})
        final = (await until_terminal(connection))[-1]
        assert final.type == "response.incomplete" and final.response.id == running
        await connection.send({"type": "response.create", "input": "ok", "max_output_tokens": 2})
        assert (await until_terminal(connection))[-1].type == "response.incomplete"


async def test_the_token_is_checked_at_the_upgrade() -> None:
    async with running_server(security__auth_token="s3cret-token-1234") as server:
        async with connected(server, api_key="s3cret-token-1234") as connection:
            await connection.send(
                {"type": "response.create", "input": "hi", "max_output_tokens": 2}
            )
            assert (await until_terminal(connection))[-1].type == "response.incomplete"
        with pytest.raises(Exception, match="401"):
            async with connected(server, api_key="wrong"):
                pass


async def test_a_never_reading_client_holds_bounded_memory_and_others_stream_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client sends ``response.create`` and never reads: once the kernel's
    buffers and the server's write buffer are full its producer pauses on the
    full channel, the memory held for the connection stays bounded (the
    channel plus the write buffer, as for our protocol's slow reader), another
    connection streams meanwhile, ``response.cancel`` (sent, never read back)
    ends the producer, and closing the socket releases the rest."""
    bound = 64 * 1024
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        backend__fake__parallel=3,
        stream__queue_tokens=64,
        server__sndbuf=16384,
        server__write_limit=16384,
        server__ping_interval_s=0,
        server__send_timeout_s=timeout(60),
        stream__stall_timeout_s=0,
    ) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        url = f"ws://127.0.0.1:{server.port}/v1/responses"
        async with ws_connect(url, sock=sock, max_queue=1) as ws:
            create = {"type": "response.create", "input": "p", "max_output_tokens": 10**6}
            await ws.send(json.dumps({**create, "stream_id": "a"}))
            created = json.loads(await ws.recv())
            assert created["type"] == "response.created"
            ws.transport.pause_reading()  # from now on, read nothing
            hog, dialect = responses_socket(server)
            assert isinstance(hog.ws, PeerAwareConnection)
            first = hog.generations[created["response"]["id"]]
            # The kernel's buffers are full once the server's write buffer
            # passes its limit; then the channel fills and the producer waits.
            async with asyncio.timeout(timeout(30)):
                await hog.ws.writing_paused.wait()
            blocked = await asyncio.to_thread(first.channel.blocked.wait, timeout(30))
            assert blocked, "the producer never felt the backpressure"
            assert hog.ws.writing_paused.is_set() and first.channel.blocked.is_set()
            assert hog.buffered_bytes() < bound, hog.buffered_bytes()
            tokens = first.channel.tokens

            # Another client streams a whole response meanwhile.
            async with connected(server) as other:
                await other.send(
                    {"type": "response.create", "input": "hi", "max_output_tokens": 50}
                )
                events = await until_terminal(other)
                assert events[-1].type == "response.incomplete"
                assert events[-1].response.usage.output_tokens == 50
            # Still paused: nothing more was made for the client that reads nothing.
            assert first.channel.blocked.is_set() and first.channel.tokens == tokens
            assert hog.buffered_bytes() < bound, hog.buffered_bytes()

            # Cancel (sent, never read back): the producer ends and lets go of the model.
            await ws.send(json.dumps({"type": "response.cancel", "response_id": first.request.id}))
            assert first.exited is not None
            async with asyncio.timeout(timeout(30)):
                await asyncio.shield(first.exited)
            # Its closing events repeat the whole text (output_text.done, …), as the
            # Responses API has them: one of them now waits in the write buffer,
            # on top of the bound. The text is what the response keeps anyway.
            text_bytes = len(dialect.runs[first.request.id].render.text.encode())
            bound += text_bytes + 4096

            # A second lane's response pauses too; closing the socket releases it.
            started = announcing_generations(monkeypatch)
            await ws.send(json.dumps({**create, "stream_id": "b"}))
            async with asyncio.timeout(timeout(30)):
                second = await started.get()
            # It has the model, but its first event waits behind the first
            # response's last ones in the full write buffer: nothing is made.
            assert hog.ws.writing_paused.is_set()
            assert hog.buffered_bytes() < bound, hog.buffered_bytes()
            ws.transport.abort()
        await handlers_finished(server)
        assert second.channel.tokens == 0
        assert not server.connections
        assert server.producer_threads() == 0
        # Both slots are free again: two lanes of a new client run at once.
        async with connected(server) as again:
            for lane in ("x", "y", "z"):
                await again.send(
                    {
                        "type": "response.create",
                        "input": lane,
                        "max_output_tokens": 3,
                        "stream_id": lane,
                    }
                )
            ended = 0
            async with asyncio.timeout(timeout(30)):
                async for event in again:
                    ended += event.type == "response.incomplete"
                    if ended == 3:
                        break


LANES = "abcdefgh"
#: A server where a lane's long input takes 1,000 s of prefill (a short one
#: 0.1 s) and only the stall rule frees the engine from a client that reads
#: nothing: such a connection is never aborted while a test runs.
STALLING = {
    "backend__fake__tokens_per_s": 0.0,
    "backend__fake__prefill_ms_per_token": 100.0,
    "stream__queue_tokens": 16,
    "server__sndbuf": 4096,
    "server__write_limit": 4096,
    "server__ping_interval_s": 0,
    "server__send_timeout_s": timeout(600),
    "stream__stall_timeout_s": timeout(0.5),
}


@contextlib.asynccontextmanager
async def never_reading(server: Server) -> AsyncIterator[Any]:
    """A WebSocket-mode client that sends one ``response.create`` per lane of
    :data:`LANES` — lane a a short input, the others long ones — reads each
    response's ``response.created`` (all eight are then running or waiting
    for the model), and from then on reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    url = f"ws://127.0.0.1:{server.port}/v1/responses"
    async with ws_connect(url, sock=sock, max_queue=1) as ws:
        for lane in LANES:
            body = {
                "type": "response.create",
                "input": "p" if lane == "a" else "x" * 40_000,
                "max_output_tokens": 10**6,
                "stream_id": lane,
            }
            await ws.send(json.dumps(body))
        created: set[str] = set()
        async with asyncio.timeout(timeout(30)):
            while len(created) < len(LANES):
                event = json.loads(await ws.recv())
                if event["type"] == "response.created":
                    created.add(event["stream_id"])
        ws.transport.pause_reading()  # from now on it reads nothing
        try:
            yield ws
        finally:
            ws.transport.abort()


async def test_a_never_reading_connections_lanes_are_stalled_together() -> None:
    """Issue 34, fault 7: lanes multiplied a client that reads nothing. Its
    lanes' responses each held the engine in turn: the stall rule ended only
    a response blocked on its full channel, and the slot went to the next
    lane's response (ahead of every other client, too, while the queue was
    first come, first served). A lane's response may be long to even start
    producing (here: a long prompt's prefill), and holds the engine all that
    time for a client that reads nothing.

    Now a connection's lanes count together: once it has read nothing for
    the stall timeout while another client waits, all its responses end
    (``stalled``), those still waiting for the model too, and the other
    client is served, while the connection that reads nothing stays open.
    (On the wire and /metrics only: the Responses WebSocket mode is to be
    rewritten onto the generic connection, issue 35.)"""
    async with (
        running_server(backend__fake__parallel=1, **STALLING) as server,
        never_reading(server),
    ):
        # Lane a has the one slot; the other seven lanes' responses wait.
        metrics = await scrape(server)
        assert metrics["wsserver_requests_active"] == 1
        assert metrics["wsserver_requests_queued"] == len(LANES) - 1

        # Another client asks: it is served, the lanes' responses notwithstanding.
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="x",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            reply = await client.responses.create(model=FAKE_MODEL, input="hi", max_output_tokens=3)
        finally:
            await client.close()
        assert reply.status == "incomplete" and reply.usage is not None
        assert reply.usage.output_tokens == 3
        # Every lane's response ended stalled, at once (else the next lane's
        # long prefill would hold the slot now); the connection is still open.
        metrics = await scrape(server)
        assert metrics['wsserver_errors_total{code="stalled"}'] == len(LANES)
        assert metrics["wsserver_requests_queued"] == 0
        assert metrics["wsserver_open_connections"] == 1


async def test_connections_take_turns_for_the_model_whatever_their_lanes() -> None:
    """Issue 34, fault 7, with several connections: three that read nothing,
    eight lanes each, asked one connection after the other, then a client on
    our protocol. The queue was first come, first served: the client was
    23rd, behind every lane. Now connections take turns (the scheduler is
    fair by owner): it is 3rd, behind the first lane of each connection that
    holds no slot — and served as soon as the stall rule has ended one of
    theirs."""
    # A longer stall timeout: no connection may be judged before the client
    # below has its place in the queue.
    config = {**STALLING, "stream__stall_timeout_s": timeout(3)}
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(
            running_server(backend__fake__parallel=2, **config)
        )
        for _ in range(3):
            await stack.enter_async_context(never_reading(server))
        # The first connection's lanes a and b took both slots at once.
        metrics = await scrape(server)
        assert metrics["wsserver_requests_active"] == 2
        assert metrics["wsserver_requests_queued"] == 3 * len(LANES) - 2
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "b", "prompt": "hi", "max_tokens": 3})
            queued = await client.recv()
            assert queued["type"] == "queued" and queued["position"] == 3, queued
            _, frames = await client.done("b", units=60)
        assert frames[-1]["reason"] == "length"
        # It had a slot once the first connection, and then the second or
        # the third, had read nothing for the stall timeout: each lost all
        # its lanes' responses at once. (The last one's stall may come after.)
        metrics = await scrape(server)
        assert metrics['wsserver_errors_total{code="stalled"}'] in (2 * len(LANES), 3 * len(LANES))
        assert metrics["wsserver_open_connections"] == 3


def announcing_generations(monkeypatch: pytest.MonkeyPatch) -> asyncio.Queue[Generation]:
    """From now on, each generation a request driver starts is announced in the queue."""
    started: asyncio.Queue[Generation] = asyncio.Queue()
    start = RequestDriver._start

    def announcing(driver: RequestDriver, effect: Any) -> None:
        start(driver, effect)
        generation = driver.generations.get(effect.request.id)
        if generation is not None:
            started.put_nowait(generation)

    monkeypatch.setattr(RequestDriver, "_start", announcing)
    return started
