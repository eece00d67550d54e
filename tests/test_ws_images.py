"""Images over the WebSocket protocol, on a real server and real WebSocket clients.

A user message's ``images`` — base64 inside the frame, or uploads sent in
binary frames first — read by the tiny vision model (a tiny llama and a tiny
LLaVA ``mlp`` projector: tests/tiny_mmproj.py): the image changes the greedy
answer, which equals what OpenAI's chat API gives for the same image and
prompt; the refusals name the image; the connection's uploads are bounded
and dropped by the next request.
"""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp.mtmd_cpp")

from conftest import TINY_MODEL, Wire, running_server, wire
from test_anthropic_http import post
from test_llama_backend import llama_config
from tiny_images import gradient_png, png_header_only, solid_png
from tiny_mmproj import IMAGE_TOKENS, write_tiny_mmproj

from wsserver.aio.peer import memory_bound
from wsserver.core.image_check import MAX_IMAGES

RED = solid_png((255, 0, 0))
GRADIENT = gradient_png()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny.mmproj.gguf")


def seer(tiny_gguf: Path, mmproj: Path, **overrides: Any) -> Any:
    return llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[{"name": "seer", "model": str(tiny_gguf), "mmproj": str(mmproj)}],
        **overrides,
    )


def b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


async def upload(client: Wire, upload_id: str, data: bytes, chunk: int = 4096) -> None:
    """``data`` in binary frames of at most ``chunk`` bytes."""
    for at in range(0, len(data), chunk):
        await client.send(upload_id.encode() + b"\n" + data[at : at + chunk])


def look(request_id: str, *images: Any, model: str = "seer") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "user", "content": "Look at"}
    if images:
        message["images"] = list(images)
    return {
        "type": "generate",
        "id": request_id,
        "model": model,
        "messages": [message],
        "max_tokens": 12,
        "temperature": 0,
    }


async def answer(client: Wire, frame: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    await client.send(frame)
    text, frames = await client.done(frame["id"], units=30)
    done = frames[-1]
    assert done["type"] == "done" and done["reason"] == "length", done
    return text, done


async def refused(client: Wire, frame: dict[str, Any]) -> dict[str, Any]:
    await client.send(frame)
    frames = await client.until(
        lambda f: f.get("id") == frame["id"] and f["type"] in ("error", "done"), units=30
    )
    error = frames[-1]
    assert error["type"] == "error", error
    assert all(f["type"] == "queued" for f in frames[:-1] if f.get("id") == frame["id"])
    return error


async def test_an_image_by_upload_or_base64_reads_as_the_openai_wires_does(
    tiny_gguf: Path, mmproj: Path
) -> None:
    async with running_server(seer(tiny_gguf, mmproj)) as server:
        async with wire(server) as client:
            assert client.hello is not None
            assert client.hello["limits"]["max_upload_bytes"] == 20 << 20
            text_only, plain = await answer(client, look("t"))
            await upload(client, "img-1", RED, chunk=40)  # three binary frames
            by_upload, done = await answer(client, look("u", {"upload": "img-1"}))
            by_base64, _ = await answer(client, look("b", b64(RED)))
            other, _ = await answer(client, look("g", b64(GRADIENT)))
        # OpenAI's chat API, the image before the same text: the same prompt.
        body = {
            "model": "seer",
            "max_tokens": 12,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64," + b64(RED)},
                        },
                        {"type": "text", "text": "Look at"},
                    ],
                }
            ],
        }
        status, openai = await post(server, "/v1/chat/completions", body)
    assert status == 200, openai
    assert by_upload == by_base64 == openai["choices"][0]["message"]["content"]
    assert done["usage"]["prompt_tokens"] == openai["usage"]["prompt_tokens"]
    assert done["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"] >= IMAGE_TOKENS
    assert len({text_only, by_upload, other}) == 3  # the image changes the answer


async def test_refusals_name_the_image_and_the_server_serves_on(
    tiny_gguf: Path, mmproj: Path
) -> None:
    async with running_server(seer(tiny_gguf, mmproj)) as server, wire(server) as client:
        error = await refused(client, look("r1", b64(RED), {"upload": "nope"}))
        assert error["code"] == "bad_request"
        assert "image 1 (messages[0].images[1])" in error["message"]
        assert "no upload 'nope'" in error["message"]
        error = await refused(client, look("r2", *[b64(RED)] * (MAX_IMAGES + 1)))
        assert "at most" in error["message"] and "messages[0].images" in error["message"]
        bomb = png_header_only(50_000, 50_000)
        await upload(client, "bomb", bomb)
        error = await refused(client, look("r3", {"upload": "bomb"}))
        assert "image 0 (messages[0].images[0])" in error["message"]
        assert "50000x50000" in error["message"]
        corrupt = RED[:40] + b"\x00" * 20 + RED[60:]  # a fine header, pixels that do not decode
        await upload(client, "c", corrupt)
        # Its pixels are found bad once the request has the model (libmtmd
        # decodes them): the request's one terminal frame is its done.
        await client.send(look("r4", {"upload": "c"}))
        _, frames = await client.done("r4", units=30)
        done = frames[-1]
        assert done["reason"] == "error" and done["error"]["code"] == "bad_request"
        assert "image 0" in done["error"]["message"], done
        await upload(client, "t", RED)
        error = await refused(client, look("r5", {"upload": "t"}, model=TINY_MODEL))
        assert "image 0" in error["message"] and "takes no images" in error["message"]
        # The refused request took its upload: naming it again is refused.
        error = await refused(client, look("r6", {"upload": "t"}))
        assert "no upload 't'" in error["message"]
        await client.send(b"no newline here")
        error = await client.recv()
        assert error["type"] == "error" and error["id"] is None
        assert error["code"] == "bad_json" and "binary frame" in error["message"]
        text, _ = await answer(client, look("ok", b64(RED)))
        assert text


async def test_the_connections_upload_ceiling_and_the_next_request_drops_the_rest(
    tiny_gguf: Path, mmproj: Path
) -> None:
    ceiling = len(RED) + 100
    config = seer(tiny_gguf, mmproj, limits__max_upload_bytes=ceiling)
    async with running_server(config) as server, wire(server) as client:
        assert client.hello is not None
        assert client.hello["limits"]["max_upload_bytes"] == ceiling
        (connection,) = server.connections.values()
        await upload(client, "kept", RED)
        await upload(client, "over", GRADIENT)  # passes the ceiling
        error = await client.recv()
        assert error["type"] == "error" and error["id"] == "over"
        assert error["code"] == "too_large" and "upload 'over' refused" in error["message"]
        held = connection.held_bytes()
        assert held["upload"] == len(RED) <= memory_bound(server.config)["upload"] == ceiling
        error = await refused(client, look("r", {"upload": "kept"}, {"upload": "over"}))
        assert "image 1" in error["message"] and "it was refused" in error["message"]
        assert connection.held_bytes()["upload"] == 0  # the request took them all
        # An upload no request names is dropped by the next one.
        await upload(client, "unused", RED)
        await answer(client, look("a", b64(RED)))
        assert connection.held_bytes()["upload"] == 0
        await upload(client, "kept", RED)
        text, _ = await answer(client, look("b", {"upload": "kept"}))
        assert text


def noise_png(size: int) -> bytes:
    """A PNG of random pixels (which no compression shrinks) of about ``size`` bytes."""
    import os
    import struct
    import zlib

    width = 1024
    height = size // (3 * width + 1)
    rows = b"".join(b"\x00" + os.urandom(3 * width) for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 1))
        + chunk(b"IEND", b"")
    )


class Counted:
    """Bytes a websockets client wrote to and read from its TCP connection."""

    def __init__(self, ws: Any) -> None:
        self.sent = self.received = 0
        write, received = ws.transport.write, ws.data_received

        def counting_write(data: bytes) -> None:
            self.sent += len(data)
            write(data)

        def counting_received(data: bytes) -> None:
            self.received += len(data)
            received(data)

        ws.transport.write = counting_write
        ws.data_received = counting_received


async def test_a_4_mib_image_on_the_wire_each_way(tiny_gguf: Path, mmproj: Path) -> None:
    """What a 4 MiB image costs on the TCP connection, both ways: as base64
    inside the JSON frame, and as an upload in binary frames (the server
    negotiates no permessage-deflate: what is sent is what goes over the
    wire). Prints the figures (docs/images.md records them); asserts no timing."""
    from websockets.asyncio.client import connect

    image = noise_png(4 << 20)
    size = len(image)
    # base64 in the frame needs a larger frame limit; uploads fit the default 1 MiB.
    config = seer(tiny_gguf, mmproj, server__max_frame_bytes=6 << 20)
    rows = []
    async with running_server(config) as server:
        for how in ("base64", "upload"):
            async with connect(server.url, max_size=None) as ws:
                client = Wire(ws)
                client.hello = await client.recv()
                counted = Counted(ws)
                if how == "upload":
                    chunk = (1 << 20) - 16  # within the default max_frame_bytes
                    await upload(client, "img", image, chunk=chunk)
                    frame = look(how, {"upload": "img"})
                else:
                    frame = look(how, b64(image))
                text, done = await answer(client, frame)
                assert text and done["usage"]["prompt_tokens"] > IMAGE_TOKENS
                rows.append((how, counted.sent, counted.received))
    print(f"\nimage: {size} bytes (base64: {len(b64(image))} characters)")
    print(f"{'images as':<9} {'client->server':>15} {'server->client':>15}")
    for how, sent, received in rows:
        print(f"{how:<9} {sent:>15} {received:>15}  ({sent / size:.3f}x the image)")
    sent = {how: sent for how, sent, _ in rows}
    assert sent["upload"] < size * 1.01 < sent["base64"]  # base64 costs a third more


# ---------------------------------------------------------------- the Python clients


def openai_text(image: bytes | None) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if image is not None:
        parts.append(
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(image)}}
        )
    parts.append({"type": "text", "text": "Look at"})
    return {
        "model": "seer",
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": parts}],
    }


async def test_the_python_clients_send_paths_and_bytes(
    tiny_gguf: Path, mmproj: Path, tmp_path: Path
) -> None:
    from wsserver_client import Client
    from wsserver_client.sync import Client as SyncClient

    red_file = tmp_path / "red.png"
    red_file.write_bytes(RED)
    options = {"model": "seer", "max_tokens": 12, "temperature": 0}

    def asking(*images: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Look at", "images": list(images)}]

    async with running_server(seer(tiny_gguf, mmproj)) as server:
        status, openai = await post(server, "/v1/chat/completions", openai_text(RED))
        assert status == 200, openai
        expected = openai["choices"][0]["message"]["content"]
        async with Client(server.url) as client:
            by_path = await client.generate(messages=asking(red_file), **options).result()
            by_bytes = await client.generate(messages=asking(RED), **options).result()
            by_str = await client.generate(messages=asking(str(red_file)), **options).result()
            # A regenerate runs the kept input again, its image with it.
            again = await client.restart(by_bytes.done.id, temperature=0).result()  # type: ignore[union-attr]
            with pytest.raises(Exception) as caught:
                await client.generate(messages=asking(b"not an image"), **options).result()
            assert "image 0 (messages[0].images[0])" in str(caught.value)
        assert by_path.text == by_bytes.text == by_str.text == again.text == expected
        assert by_path.done is not None
        assert by_path.done.usage.prompt_tokens == openai["usage"]["prompt_tokens"]

        def sync_side() -> str:
            with SyncClient(server.url) as client:
                return client.generate(messages=asking(red_file), **options).result().text

        assert await asyncio.to_thread(sync_side) == expected


async def test_the_python_client_sends_base64_to_a_server_without_uploads(
    tiny_gguf: Path, mmproj: Path
) -> None:
    from wsserver_client import Client

    async with running_server(seer(tiny_gguf, mmproj, limits__max_upload_bytes=0)) as server:
        async with Client(server.url) as client:
            assert client.hello is not None and client.hello.limits.max_upload_bytes == 0
            stream = client.generate(
                messages=[{"role": "user", "content": "Look at", "images": [RED]}],
                model="seer",
                max_tokens=12,
                temperature=0,
            )
            assert stream.uploads == []
            assert stream.frame["messages"][0]["images"] == [b64(RED)]
            result = await stream.result()
        status, openai = await post(server, "/v1/chat/completions", openai_text(RED))
    assert status == 200, openai
    assert result.text == openai["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- the JS client


async def test_the_js_client_sends_blobs_and_bytes(tiny_gguf: Path, mmproj: Path) -> None:
    """clients/js/test/images.test.js under Node, against the tiny vision model."""
    from test_js_node import ControlledServer, assert_all_passed, node_command, run_node_tests

    command = node_command()
    async with ControlledServer(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_threads=1,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[{"name": "seer", "model": str(tiny_gguf), "mmproj": str(mmproj)}],
    ) as server:
        returncode, output = await run_node_tests(
            command,
            server,
            "images.test.js",
            WSSERVER_RED=b64(RED),
            WSSERVER_GRADIENT=b64(GRADIENT),
        )
    assert_all_passed(returncode, output)


async def test_a_piece_of_an_upload_lost_to_the_frame_rate_drops_the_upload() -> None:
    """The receive loop refuses a frame over the rate before the dialect reads
    it; for a binary frame the dialect still drops that upload (its image
    would be cut), so a request naming it is refused saying why."""
    from wsserver.aio.connection import ProtocolDialect
    from wsserver.errors import ProtocolError

    async with running_server() as server, wire(server) as client:
        (connection,) = server.connections.values()
        dialect = connection.dialect
        assert isinstance(dialect, ProtocolDialect)
        await upload(client, "a", RED[:50])
        await client.send({"type": "cancel", "id": "nothing"})  # answered after the upload
        assert (await client.recv())["code"] == "unknown_id"
        assert dialect.uploads.bytes == 50
        await dialect.refuse(ProtocolError("rate_limited", "too many frames"), b"a\n" + RED[50:])
        assert (await client.recv())["code"] == "rate_limited"
        assert dialect.uploads.bytes == 0
        error = await refused(client, look("g", {"upload": "a"}))
        assert "no upload 'a'" in error["message"] and "rate_limited" in error["message"]


async def test_wsserver_chat_sends_an_image_file_with_the_next_message(
    tiny_gguf: Path, mmproj: Path, tmp_path: Path
) -> None:
    import io

    from wsserver_client import Client
    from wsserver_client.cli import Chat

    red_file = tmp_path / "red.png"
    red_file.write_bytes(RED)
    async with running_server(seer(tiny_gguf, mmproj)) as server:
        status, openai = await post(server, "/v1/chat/completions", openai_text(RED))
        assert status == 200, openai
        async with Client(server.url) as client:
            out = io.StringIO()
            chat = Chat(
                client, out=out, options={"model": "seer", "max_tokens": 12, "temperature": 0}
            )
            assert await chat.handle(f"/image {tmp_path / 'nothing.png'}\n")
            assert "[no file" in out.getvalue()
            assert await chat.handle(f"/image {red_file}\n")
            assert "red.png goes with your next message" in out.getvalue()
            before = len(out.getvalue())
            assert await chat.handle("Look at\n")
            assert chat.images == []
    answer = out.getvalue()[before:]
    assert answer.startswith(openai["choices"][0]["message"]["content"] + "\n["), answer
