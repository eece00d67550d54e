"""Security and limits: Host, Origin, tokens, connection limits, frame size and rate.

The checks themselves (wsserver.security) are sans-I/O and tested directly;
the rest runs a real server on 127.0.0.1 with real WebSocket clients.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from typing import Any

import pytest
from conftest import expected_fake_text, make_config, running_server, timeout, wire
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from wsserver_client import Client

from wsserver.config import describe, load_config
from wsserver.errors import ConfigError
from wsserver.security import (
    ConnectionLimiter,
    FrameLimiter,
    Gatekeeper,
    TokenBucket,
    exposure_warning,
    select_subprotocol,
)

TOKEN = "s3cret-token_0123456789"


async def http(
    server: Any, path: str, *, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP/1.1 request; returns status, headers (lower-case names), body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        lines = [f"{method} {path} HTTP/1.1"]
        all_headers = {"Host": f"127.0.0.1:{server.port}", "Connection": "close"}
        all_headers.update(headers or {})
        lines += [f"{k}: {v}" for k, v in all_headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        async with asyncio.timeout(timeout(10)):
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head.decode().split("\r\n")
            status = int(status_line.split()[1])
            parsed = {}
            for line in header_lines:
                if ":" in line:
                    name, _, value = line.partition(":")
                    parsed[name.strip().lower()] = value.strip()
            length = int(parsed.get("content-length", "0"))
            body = await reader.readexactly(length) if method != "HEAD" else b""
        return status, parsed, body
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def sample(server: Any, name: str, **labels: str) -> float | None:
    return server.metrics.registry.get_sample_value(name, labels)


async def refused_status(url: str, **kwargs: Any) -> int:
    with pytest.raises(InvalidStatus) as info:
        async with connect(url, **kwargs):
            pass
    return info.value.response.status_code


# ---------------------------------------------------------------- sans-I/O checks


def gate(**overrides: Any) -> Gatekeeper:
    return Gatekeeper(make_config(**overrides))


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        ("http://localhost:3000", True),
        ("https://localhost", True),
        ("http://127.0.0.1:9", True),
        ("http://127.5.6.7:80", True),
        ("http://[::1]:8080", True),
        ("HTTP://LOCALHOST:1", True),
        ("http://127.0.0.1:8765", True),  # the server's own page (Host below)
        ("http://evil.example", False),
        ("https://localhost.evil.example", False),
        ("http://192.168.1.9:8765", False),
        ("null", False),
        ("file://", False),
        ("ws://localhost:1", False),
        ("http://localhost:99999", False),
        ("http://localhost:1/path", False),
    ],
)
def test_origin_allowlist(origin: str, allowed: bool) -> None:
    refusal = gate().check_origin([origin], ["127.0.0.1:8765"])
    assert (refusal is None) is allowed
    if refusal is not None:
        assert refusal.status == 403


def test_own_origin_follows_the_host_the_browser_used() -> None:
    keeper = gate(server__host="0.0.0.0")
    assert keeper.check_origin(["http://192.168.1.9:8765"], ["192.168.1.9:8765"]) is None
    assert keeper.check_origin(["http://192.168.1.9:8765"], ["192.168.1.9:9999"]) is not None


def test_configured_origins_missing_origin_and_wildcard() -> None:
    assert gate().check_origin([], []) is None
    assert gate(security__allow_missing_origin=False).check_origin([], []) is not None
    electron = gate(security__allowed_origins=["app://my-app/"])
    assert electron.check_origin(["app://my-app"], []) is None
    assert electron.check_origin(["app://other"], []) is not None
    assert gate(security__allowed_origins=["*"]).check_origin(["http://evil.example"], []) is None
    assert gate().check_origin(["http://localhost", "http://localhost"], []) is not None


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:8765", True),
        ("[::1]:8765", True),
        ("localhost:8765", True),
        ("10.1.2.3", True),
        ("evil.example:8765", False),  # DNS rebinding: an attacker's name for 127.0.0.1
        ("localhost.evil.example", False),
    ],
)
def test_host_header_guards_against_dns_rebinding(host: str, allowed: bool) -> None:
    assert (gate().check_host([host]) is None) is allowed


def test_host_allowlist_and_configured_host() -> None:
    assert gate(security__allowed_hosts=["box.lan"]).check_host(["box.lan:8765"]) is None
    assert gate(server__host="box.lan").check_host(["BOX.LAN"]) is None
    assert gate().check_host([]) is None
    assert gate().check_host(["a", "b"]) is not None


def test_token_checks() -> None:
    keeper = gate(security__auth_token=TOKEN)
    assert keeper.check_auth([], [], upgrade=True) is not None
    assert keeper.check_auth([f"Bearer {TOKEN}"], [], upgrade=False) is None
    assert keeper.check_auth([f"bearer  {TOKEN} "], [], upgrade=True) is None
    assert keeper.check_auth([f"Bearer {TOKEN}x"], [], upgrade=True) is not None
    assert keeper.check_auth([f"Bearer {TOKEN}", f"Bearer {TOKEN}"], [], upgrade=True) is not None
    offer = ["wsserver.v1", f"bearer.{TOKEN}"]
    assert keeper.check_auth([], offer, upgrade=True) is None
    # The subprotocol route needs wsserver.v1, and applies to handshakes only.
    assert keeper.check_auth([], [f"bearer.{TOKEN}"], upgrade=True) is not None
    assert keeper.check_auth([], offer, upgrade=False) is not None
    basic = base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
    assert keeper.check_auth([f"Basic {basic}"], [], upgrade=False) is None
    assert keeper.check_auth(["Basic !!!"], [], upgrade=False) is not None
    assert gate().check_auth([], [], upgrade=True) is None  # auth off
    assert select_subprotocol(offer) == "wsserver.v1"
    assert select_subprotocol([f"bearer.{TOKEN}"]) is None


def test_token_config_from_env_is_validated_and_never_shown() -> None:
    loaded = load_config(env={"WSSERVER_SECURITY_AUTH_TOKEN": TOKEN})
    assert loaded.config.security.auth_token == TOKEN
    shown = describe(loaded)
    assert TOKEN not in shown
    assert 'auth_token = "***"' in shown
    with pytest.raises(ConfigError, match="auth_token"):
        load_config(env={"WSSERVER_SECURITY_AUTH_TOKEN": "has space"})


def test_exposure_warning() -> None:
    assert exposure_warning(make_config()) is None
    assert exposure_warning(make_config(server__host="localhost")) is None
    assert exposure_warning(make_config(server__host="::1")) is None
    assert exposure_warning(make_config(server__host="0.0.0.0")) is not None
    assert exposure_warning(make_config(server__host="0.0.0.0", security__auth_token=TOKEN)) is None


def test_connection_limiter() -> None:
    alive = {"a": True, "b": True, "c": True, "d": True}
    limiter = ConnectionLimiter(max_total=3, max_per_ip=2)
    assert limiter.admit("a", "1.1.1.1", lambda: alive["a"]) is None
    assert limiter.admit("b", "1.1.1.1", lambda: alive["b"]) is None
    refusal = limiter.admit("c", "1.1.1.1", lambda: alive["c"])
    assert refusal is not None and refusal.status == 429
    assert limiter.admit("c", "2.2.2.2", lambda: alive["c"]) is None
    refusal = limiter.admit("d", "3.3.3.3", lambda: alive["d"])
    assert refusal is not None and refusal.status == 503
    limiter.release("a")
    assert limiter.admit("d", "1.1.1.1", lambda: alive["d"]) is None
    # A handshake that died after admission is not counted for ever.
    alive["b"] = False
    assert limiter.count("1.1.1.1") == 1
    assert limiter.count() == 2


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(rate=10.0, burst=2, now=0.0)
    assert [bucket.take(0.0) for _ in range(3)] == [True, True, False]
    assert bucket.take(0.1) and not bucket.take(0.1)  # one token a tenth of a second
    assert [bucket.take(60.0) for _ in range(3)] == [True, True, False]  # never above burst
    assert not bucket.take(59.0)  # a clock going back refills nothing
    assert all(TokenBucket(rate=0.0, burst=0, now=0.0).take(0.0) for _ in range(3))


def test_frame_limiter_bucket_and_flood() -> None:
    limiter = FrameLimiter(rate=10.0, burst=5, close_after=3, now=0.0)
    assert [limiter.check(0.0) for _ in range(5)] == ["ok"] * 5
    assert limiter.check(0.0) == "limited"
    assert limiter.check(0.1) == "ok"  # refilled one frame
    assert limiter.check(0.1) == "limited"
    assert limiter.check(0.1) == "flood"
    # Refusals spread beyond the window are not a flood.
    spread = FrameLimiter(rate=0.001, burst=1, close_after=3, now=0.0)
    assert spread.check(0.0) == "ok"
    assert [spread.check(t) for t in (1.0, 7.0, 13.0, 19.0)] == ["limited"] * 4
    assert FrameLimiter(rate=0.0, burst=1, close_after=1, now=0.0).check(0.0) == "ok"


# ---------------------------------------------------------------- handshakes


async def test_foreign_origin_is_refused_and_local_origins_are_accepted() -> None:
    async with running_server() as server:
        assert await refused_status(server.url, origin="http://evil.example") == 403
        assert await refused_status(server.url, origin="null") == 403
        for origin in ("http://localhost:5173", f"http://127.0.0.1:{server.port}", None):
            async with wire(server, origin=origin) as client:
                assert client.hello is not None
        assert sample(server, "wsserver_handshakes_refused_total", reason="origin") == 2


async def test_rebinding_host_is_refused_but_healthz_answers() -> None:
    async with running_server() as server:
        status, _, _ = await http(server, "/readyz", headers={"Host": "evil.example"})
        assert status == 403
        status, _, body = await http(server, "/healthz", headers={"Host": "evil.example"})
        assert (status, body) == (200, b"ok\n")
        status, _, _ = await http(server, "/readyz", headers={"Host": f"localhost:{server.port}"})
        assert status == 200


async def test_token_auth_over_the_wire() -> None:
    async with running_server(security__auth_token=TOKEN) as server:
        assert await refused_status(server.url) == 401
        assert (
            await refused_status(server.url, additional_headers={"Authorization": "Bearer nope"})
            == 401
        )
        assert (
            await refused_status(server.url, subprotocols=["wsserver.v1", "bearer.nope"])  # type: ignore[list-item]
            == 401
        )
        # Non-browser clients: Authorization header (the bundled client's token=).
        async with Client(server.url, token=TOKEN) as client:
            result = await client.generate("hi", max_tokens=5).result()
            assert result.done.reason == "length"
        # Browsers: the token as a subprotocol offer; the server picks wsserver.v1.
        offer = ["wsserver.v1", f"bearer.{TOKEN}"]
        async with connect(server.url, subprotocols=offer) as ws:  # type: ignore[arg-type]
            assert ws.subprotocol == "wsserver.v1"
            assert json.loads(await ws.recv())["type"] == "hello"
        # Everything but the probes needs the token too (/readyz: ready or not, no more).
        status, _, body = await http(server, "/readyz")
        assert (status, body) == (200, b"ready\n")
        for path in ("/metrics", "/"):
            status, headers, _ = await http(server, path)
            assert status == 401, path
            assert "bearer" in headers["www-authenticate"].lower()
        status, _, body = await http(
            server, "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert status == 200 and b"wsserver_connections_total" in body
        basic = base64.b64encode(f"me:{TOKEN}".encode()).decode()
        status, _, _ = await http(server, "/readyz", headers={"Authorization": f"Basic {basic}"})
        assert status == 200
        status, _, _ = await http(server, "/healthz")
        assert status == 200


async def test_methods_other_than_get_and_head_get_405() -> None:
    async with running_server() as server:
        for path in ("/healthz", "/readyz", "/metrics", "/nowhere"):
            status, headers, _ = await http(server, path, method="POST")
            assert status == 405, path
            assert headers["allow"] == "GET, HEAD"
        status, headers, body = await http(server, "/healthz", method="HEAD")
        assert (status, body) == (200, b"")
        assert headers["content-length"] == "3"
        status, _, _ = await http(server, "/metrics", method="DELETE")
        assert status == 405


async def test_connection_limits_per_ip_and_total() -> None:
    async with running_server(limits__max_connections_per_ip=2) as server:
        async with wire(server), wire(server):
            assert await refused_status(server.url) == 429
        assert sample(server, "wsserver_handshakes_refused_total", reason="connections_per_ip") == 1
    async with (
        running_server(limits__max_connections=1, limits__max_connections_per_ip=0) as server,
        wire(server),
    ):
        assert await refused_status(server.url) == 503


# ---------------------------------------------------------------- abusive clients


async def stream_completely(
    server: Any, request_id: str, max_tokens: int, started: asyncio.Event
) -> str:
    """A well-behaved client: streams one request to its end."""
    async with wire(server) as client:
        await client.send(
            {"type": "generate", "id": request_id, "prompt": "steady", "max_tokens": max_tokens}
        )
        await client.until(lambda f: f["type"] == "delta")
        started.set()
        text, frames = await client.done(request_id, units=30)
        assert frames[-1]["reason"] == "length"
        return text


async def test_oversized_frame_closes_1009_while_others_keep_streaming() -> None:
    async with running_server(
        server__max_frame_bytes=4096, backend__fake__tokens_per_s=200.0
    ) as server:
        started = asyncio.Event()
        steady = asyncio.create_task(stream_completely(server, "steady", 200, started))
        await asyncio.wait_for(started.wait(), timeout(10))
        async with wire(server) as big:
            await big.send({"type": "generate", "id": "big", "prompt": "x" * 10_000})
            with pytest.raises(ConnectionClosed):
                await big.recv()
            assert big.ws.close_code == 1009
        assert not steady.done(), "the steady stream should still be running"
        text = await asyncio.wait_for(steady, timeout(30))
        assert text == expected_fake_text("steady", 200)


async def test_flooding_client_is_rate_limited_then_cut_off_while_others_keep_streaming() -> None:
    async with running_server(
        limits__frames_per_s=20.0,
        limits__frames_burst=10,
        limits__flood_close_after=30,
        backend__fake__tokens_per_s=200.0,
    ) as server:
        started = asyncio.Event()
        steady = asyncio.create_task(stream_completely(server, "steady", 300, started))
        await asyncio.wait_for(started.wait(), timeout(10))
        async with wire(server) as flood:
            frames: list[dict[str, Any]] = []

            async def read() -> None:
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        frames.append(await flood.recv())

            reader = asyncio.create_task(read())
            with contextlib.suppress(ConnectionClosed):
                for n in range(10_000):
                    await flood.send({"type": "cancel", "id": f"x{n}"})
            await asyncio.wait_for(reader, timeout(10))
            assert flood.ws.close_code == 1008
        codes = [f["code"] for f in frames if f["type"] == "error"]
        assert codes.count("unknown_id") >= 10  # the burst was processed
        assert codes.count("rate_limited") >= 1
        assert not steady.done(), "the steady stream should still be running"
        text = await asyncio.wait_for(steady, timeout(30))
        assert text == expected_fake_text("steady", 300)
        assert sample(server, "wsserver_errors_total", code="rate_limited") >= 1


async def test_rate_limited_frame_is_refused_unprocessed() -> None:
    async with (
        running_server(limits__frames_per_s=0.5, limits__frames_burst=2) as server,
        wire(server) as client,
    ):
        await client.send({"type": "cancel", "id": "a"})
        await client.send({"type": "cancel", "id": "b"})
        await client.send({"type": "generate", "id": "c", "prompt": "p", "max_tokens": 3})
        frames = [await client.recv() for _ in range(3)]
        assert [(f["type"], f.get("code")) for f in frames] == [
            ("error", "unknown_id"),
            ("error", "unknown_id"),
            ("error", "rate_limited"),
        ]
        assert frames[2]["id"] is None


async def test_binding_beyond_loopback_without_a_token_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="wsserver")
    async with running_server(server__host="0.0.0.0"):
        pass
    assert any("without authentication" in r.getMessage() for r in caplog.records)
    caplog.clear()
    async with running_server():
        pass
    assert not any("without authentication" in r.getMessage() for r in caplog.records)


async def test_a_method_with_a_body_outside_v1_gets_405_not_silence() -> None:
    """Issue 26, also: websockets dropped a POST or PUT with a body without an answer."""
    async with running_server() as server:
        for request in (
            b"POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n\r\nhello",
            b"PUT /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n",
            b"DELETE / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}",
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(request)
            answer = await asyncio.wait_for(reader.read(), timeout(10))
            writer.close()
            assert answer.startswith(b"HTTP/1.1 405 Method Not Allowed\r\n"), answer
            assert b"\r\nAllow: GET, HEAD\r\n" in answer


async def test_a_request_pipelined_behind_a_handshake_is_the_peers_fault_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 26, fault 13: websockets parses bytes after the request as frames;
    they failed the connection (EOF sent) and answering the request then hit
    ``assert not self.eof_sent`` with a traceback."""
    async with running_server() as server:
        request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(request * 2)
        answer = await asyncio.wait_for(reader.read(), timeout(10))
        writer.close()
        assert answer.count(b"HTTP/1.1") <= 1
        tracebacks = [r for r in caplog.records if r.exc_info is not None]
        assert not tracebacks, [r.getMessage() for r in tracebacks]
