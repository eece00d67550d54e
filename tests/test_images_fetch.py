"""Image URLs fetched behind the operator's allow-list ([images]), on real sockets.

A real HTTP server on 127.0.0.1 (aiohttp.web, in the test's loop) serves
the tiny PNGs; the official clients (openai, anthropic) send URLs to a real
server on the tiny vision pair: an allowed URL is read as its data URL is;
what is refused — a host not listed, a private address without
``fetch_private``, a body over the cap (with and without its
``Content-Length``, and the reading stopped), a server too slow, a redirect,
a 404, a page that is no image — is a 400 naming the image; a client that
goes cancels its fetch; a text-only model fetches nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web

pytest.importorskip("llama_cpp.mtmd_cpp")

from conftest import TINY_MODEL, running_server, timeout
from test_llama_backend import llama_config
from tiny_images import solid_png
from tiny_mmproj import write_tiny_mmproj

from wsserver.aio import Server
from wsserver.aio.image_fetch import _allowed, _unfit, fetch_images
from wsserver.config import ImagesConfig
from wsserver.core.images import ImageUrl

RED = solid_png((255, 0, 0))
CAP = 4096


class ImageHost:
    """A real HTTP server with images, and what it saw."""

    def __init__(self) -> None:
        self.port = 0
        self.seen: list[dict[str, str]] = []
        #: /slow holds its answer until this is set (the test's end).
        self.release = asyncio.Event()
        self.slow_started = asyncio.Event()
        self.slow_cancelled = asyncio.Event()
        #: The endless body's writer saw its reader go (bytes written by then).
        self.endless_stopped = asyncio.Event()
        self.endless_written = 0

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    async def red(self, request: web.Request) -> web.Response:
        self.seen.append(dict(request.headers))
        response = web.Response(body=RED, content_type="image/png")
        response.set_cookie("session", "s3cret")
        return response

    async def endless(self, request: web.Request) -> web.StreamResponse:
        """A PNG's header, then bytes without end and without a Content-Length."""
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            await response.write(RED)
            self.endless_written = len(RED)
            while True:
                await response.write(b"\0" * 65536)
                self.endless_written += 65536
        except (ConnectionError, asyncio.CancelledError):
            self.endless_stopped.set()
            raise
        return response  # never reached

    async def long(self, request: web.Request) -> web.StreamResponse:
        """A Content-Length over the cap (the body is never read)."""
        response = web.StreamResponse(headers={"Content-Type": "image/png"})
        response.content_length = 10 * CAP
        await response.prepare(request)
        with contextlib.suppress(ConnectionError):
            await response.write(RED + b"\0" * (10 * CAP - len(RED)))
        return response

    async def slow(self, request: web.Request) -> web.Response:
        self.slow_started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.slow_cancelled.set()
            raise
        return web.Response(body=RED, content_type="image/png")

    async def redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound("/red.png")

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(text="<html>no image</html>", content_type="text/html")


@contextlib.asynccontextmanager
async def image_host() -> AsyncIterator[ImageHost]:
    host = ImageHost()
    app = web.Application()
    app.router.add_get("/red.png", host.red)
    app.router.add_get("/endless.png", host.endless)
    app.router.add_get("/long.png", host.long)
    app.router.add_get("/slow.png", host.slow)
    app.router.add_get("/redirect.png", host.redirect)
    app.router.add_get("/page.png", host.page)
    # A handler is cancelled when its client goes: how the test sees a fetch end.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host.port = runner.addresses[0][1]
    try:
        yield host
    finally:
        host.release.set()
        await runner.cleanup()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny.mmproj.gguf")


def seer(tiny_gguf: Path, mmproj: Path, host: ImageHost, **images: Any) -> Any:
    settings = {
        "fetch_hosts": [f"127.0.0.1:{host.port}", f"localhost:{host.port}"],
        "fetch_http": True,
        "fetch_private": True,
        "fetch_max_bytes": CAP,
        "fetch_timeout_s": timeout(3),
    } | images
    return llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[{"name": "seer", "model": str(tiny_gguf), "mmproj": str(mmproj)}],
        **{f"images__{key}": value for key, value in settings.items()},
    )


@contextlib.asynccontextmanager
async def sdk(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1",
        api_key="client-secret",
        max_retries=0,
        timeout=timeout(30),
    )
    try:
        yield client
    finally:
        await client.close()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


async def chat(client: openai.AsyncOpenAI, *urls: str, model: str = "seer") -> Any:
    parts: list[Any] = [{"type": "text", "text": "Look at"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return await client.chat.completions.create(
        model=model,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "user", "content": parts}],
    )


async def refusal(client: openai.AsyncOpenAI, *urls: str) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        await chat(client, *urls)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict)
    return str(body["message"])


# ---------------------------------------------------------------- through the clients


async def test_an_allowed_url_is_read_as_its_data_url_on_every_wire_that_takes_urls(
    tiny_gguf: Path, mmproj: Path
) -> None:
    async with image_host() as host:
        config = seer(tiny_gguf, mmproj, host)
        async with running_server(config) as server, sdk(server) as client:
            expected = await chat(client, data_url(RED))
            for url in (host.url("/red.png"), host.url("/red.png", "localhost")):
                got = await chat(client, url)
                assert got.choices[0].message.content == expected.choices[0].message.content
                assert got.usage is not None and expected.usage is not None
                assert got.usage.prompt_tokens == expected.usage.prompt_tokens
            # The Responses API: the same image, by URL and by data URL.
            answers = []
            for url in (host.url("/red.png"), data_url(RED)):
                response = await client.responses.create(
                    model="seer",
                    max_output_tokens=8,
                    temperature=0,
                    input=[
                        {
                            "role": "user",
                            "content": [
                                {"type": "input_text", "text": "Look at"},
                                {"type": "input_image", "image_url": url, "detail": "auto"},
                            ],
                        }
                    ],
                )
                answers.append((response.output_text, response.usage, response.id))
            assert answers[0][:2] == answers[1][:2]
            # Stored with the fetched bytes: the next turn does not fetch again.
            fetches = len(host.seen)
            follow_up = await client.responses.create(
                model="seer",
                max_output_tokens=4,
                previous_response_id=answers[0][2],
                input="and now?",
            )
            assert follow_up.usage is not None and answers[0][1] is not None
            assert follow_up.usage.input_tokens > answers[0][1].input_tokens
            assert len(host.seen) == fetches
            # Anthropic's url source.
            messages = anthropic.AsyncAnthropic(
                base_url=f"http://127.0.0.1:{server.port}", api_key="k", max_retries=0
            )
            texts = []
            for source in (
                {"type": "url", "url": host.url("/red.png")},
                {
                    "type": "base64",
                    "media_type": "image/png",
                    "data": base64.b64encode(RED).decode(),
                },
            ):
                message = await messages.messages.create(
                    model="seer",
                    max_tokens=8,
                    extra_body={"temperature": 0},
                    messages=[
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "Look at"},
                                {"type": "image", "source": source},  # type: ignore[misc,list-item]
                            ],
                        }
                    ],
                )
                texts.append((message.content, message.usage.input_tokens))
            await messages.close()
            assert texts[0] == texts[1]
    # Nothing of the client's went along: not its key, not the cookie set before.
    assert len(host.seen) == 4  # two chats (by address, by name), Responses, Anthropic
    for headers in host.seen:
        assert "Authorization" not in headers and "Cookie" not in headers, headers
        assert headers["Accept-Encoding"] == "identity"


async def test_what_is_refused_is_a_400_naming_the_image(tiny_gguf: Path, mmproj: Path) -> None:
    async with image_host() as host:
        async with running_server(seer(tiny_gguf, mmproj, host)) as server, sdk(server) as client:
            first = data_url(RED)  # the refused image is the second: image 1
            cases = {
                "http://127.0.0.1:1/red.png": "the host 127.0.0.1:1 is not one this server fetches",
                "http://example.com/red.png": "the host example.com:80 is not one",
                host.url("/long.png"): f"its Content-Length is {10 * CAP} bytes, over {CAP}",
                host.url("/endless.png"): f"it is over {CAP} bytes (reading stopped there)",
                host.url("/redirect.png"): "answered 302, a redirect",
                host.url("/missing.png"): "answered 404",
                host.url("/page.png"): "text/html, not an image",
                f"http://user:pw@127.0.0.1:{host.port}/red.png": "a user or password",
            }
            for url, said in cases.items():
                message = await refusal(client, first, url)
                assert message.startswith("image 1 (messages[0].content): "), message
                assert said in message, message
            # The endless body's reading stopped at the cap: its writer saw
            # its reader go (a reader that went on would never end).
            await asyncio.wait_for(host.endless_stopped.wait(), timeout(10))
            # The server serves on, and a text-only model fetches nothing.
            seen = len(host.seen)
            with pytest.raises(openai.BadRequestError, match="takes no images"):
                await chat(client, host.url("/red.png"), model=TINY_MODEL)
            assert len(host.seen) == seen
            assert (await chat(client, host.url("/red.png"))).choices[0].message.content


async def test_a_slow_server_times_out_and_a_client_that_goes_cancels_the_fetch(
    tiny_gguf: Path, mmproj: Path
) -> None:
    async with image_host() as host:
        config = seer(tiny_gguf, mmproj, host, fetch_timeout_s=timeout(0.5))
        async with running_server(config) as server, sdk(server) as client:
            message = await refusal(client, host.url("/slow.png"))
            assert message.startswith("image 0 (messages[0].content): not fetched within")
            await asyncio.wait_for(host.slow_cancelled.wait(), timeout(10))
    async with image_host() as host:
        config = seer(tiny_gguf, mmproj, host, fetch_timeout_s=timeout(60))
        async with running_server(config) as server, sdk(server) as client:
            asked = asyncio.create_task(chat(client, host.url("/slow.png")))
            await asyncio.wait_for(host.slow_started.wait(), timeout(10))
            asked.cancel()  # the client goes: its fetch is cancelled, long before its timeout
            with contextlib.suppress(asyncio.CancelledError):
                await asked
            await asyncio.wait_for(host.slow_cancelled.wait(), timeout(10))


async def test_a_private_address_needs_fetch_private(tiny_gguf: Path, mmproj: Path) -> None:
    async with image_host() as host:
        config = seer(tiny_gguf, mmproj, host, fetch_private=False)
        async with running_server(config) as server, sdk(server) as client:
            for name in ("127.0.0.1", "localhost"):
                message = await refusal(client, host.url("/red.png", name))
                assert message.startswith("image 0 (messages[0].content): its host "), message
                assert "a loopback address ([images] fetch_private)" in message
    assert host.seen == []


async def test_plain_http_needs_fetch_http_and_the_default_fetches_nothing() -> None:
    async with image_host() as host:
        hosts = [f"127.0.0.1:{host.port}"]
        url = ImageUrl(host.url("/red.png"), 0, "messages[0].content")
        with pytest.raises(Exception, match="https only"):
            await fetch_images(ImagesConfig(fetch_hosts=hosts, fetch_private=True), [url], 0)
        with pytest.raises(Exception, match="not fetched by this server"):
            await fetch_images(ImagesConfig(), [url], 0)
        allowed = ImagesConfig(fetch_hosts=hosts, fetch_private=True, fetch_http=True)
        assert await fetch_images(allowed, [url], 0) == {0: RED}
        # What the request's other images hold leaves less room.
        with pytest.raises(Exception, match="exceed 20971520 bytes together"):
            await fetch_images(allowed, [url], 20 << 20)
    assert len(host.seen) == 1


# ---------------------------------------------------------------- the rules, sans-I/O


def test_the_allow_list_matches_names_wildcards_and_ports() -> None:
    from yarl import URL

    config = ImagesConfig(fetch_hosts=["img.example.com", "*.cdn.example.org", "[::1]:8443"])
    assert _allowed(config, URL("https://IMG.example.com./a.png")) == ("img.example.com", 443)
    assert _allowed(config, URL("https://a.b.cdn.example.org/x")) == ("a.b.cdn.example.org", 443)
    assert _allowed(config, URL("https://[::1]:8443/x")) == ("::1", 8443)
    for refused in (
        "https://img.example.com:8443/a.png",  # not the default port
        "https://cdn.example.org/x",  # the wildcard's domain itself
        "https://evilcdn.example.org/x",
        "https://img.example.com.evil.net/a.png",
        "https://[::1]/x",
        "ftp://img.example.com/a.png",
    ):
        with pytest.raises(Exception, match=r"not one this server fetches from|not an http"):
            _allowed(config, URL(refused))


@pytest.mark.parametrize(
    "address",
    ["10.0.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "::1", "fe80::1", "fd00::1",
     "::ffff:127.0.0.1", "224.0.0.1", "0.0.0.0"],
)  # fmt: skip
def test_addresses_that_are_not_public_are_refused(address: str) -> None:
    assert _unfit(ipaddress.ip_address(address), private=False) is not None
    multicast = ipaddress.ip_address(address).is_multicast or address == "0.0.0.0"
    assert (_unfit(ipaddress.ip_address(address), private=True) is None) != multicast
    assert _unfit(ipaddress.ip_address("93.184.216.34"), private=False) is None


async def test_the_connection_goes_to_the_checked_address(monkeypatch: Any) -> None:
    """The name is resolved once, by the check: aiohttp's resolver answers
    only the addresses checked (a later answer of the DNS is never asked)."""
    async with image_host() as host:
        config = ImagesConfig(
            fetch_hosts=[f"localhost:{host.port}"], fetch_http=True, fetch_private=True
        )
        asked: list[str] = []
        real = asyncio.get_running_loop().getaddrinfo

        async def counted(name: Any, *args: Any, **kwargs: Any) -> Any:
            asked.append(name)
            return await real(name, *args, **kwargs)

        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", counted)
        url = ImageUrl(host.url("/red.png", "localhost"), 0, "messages[0].content")
        assert await fetch_images(config, [url], 0) == {0: RED}
        assert asked == ["localhost"]


def test_fetch_hosts_entries_are_checked_at_load() -> None:
    from wsserver.config import load_config
    from wsserver.errors import ConfigError

    good = ["img.example.com", "*.example.com", "example.com:8443", "10.0.0.1", "[::1]:80"]
    loaded = load_config(env={}, overrides={"images.fetch_hosts": good}).config
    assert loaded.images.fetch_hosts == good
    for bad in ("http://img.example.com", "img.example.com/x", "*.", "a:0", "a:70000", "*x.com"):
        with pytest.raises(ConfigError, match=r"images\.fetch_hosts"):
            load_config(env={}, overrides={"images.fetch_hosts": [bad]})
