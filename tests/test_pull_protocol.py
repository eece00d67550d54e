"""The WebSocket ``pull`` request: its state machine (sans-I/O), then on a real
server — progress frames checked against the schema, exactly one ``pull_done``,
cancel by id, shared downloads, who may pull."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import handlers_finished, make_config, running_server, timeout, wire
from fake_hub import FakeHub, sha256

from wsserver.core.models import ModelInfo
from wsserver.core.protocol import Pull, PullDone, Pulling, parse_server_frame, serialize
from wsserver.errors import ProtocolError
from wsserver.pull.progress import Progress
from wsserver.pull.reference import parse_reference
from wsserver.pull.requests import PullRequests

MiB = 1 << 20
TOKEN = "s3cret-token"
AUTH = {"additional_headers": {"Authorization": f"Bearer {TOKEN}"}}

# ---------------------------------------------------------------- the state machine


def pull(request_id: str, reference: str = "org/repo") -> Pull:
    return Pull(id=request_id, model=parse_reference(reference))


def test_an_accepted_pull_ends_exactly_once() -> None:
    book = PullRequests()
    book.accept(pull("p1"), allowed=None, id_taken=False)
    assert book.is_running("p1") and book.knows("p1")
    assert book.progress("p1", Progress("downloading", 1, 2)) == Pulling(
        "p1", Progress("downloading", 1, 2)
    )
    done = book.cancel("p1")
    assert done == PullDone(id="p1", reason="cancelled")
    # Late reports of the download find no running pull: nothing follows the end.
    assert book.progress("p1", Progress("downloading", 2, 2)) is None
    assert book.complete("p1", ModelInfo("m", "unloaded"), 2) is None
    assert book.fail("p1", "hub_error", "x") is None
    assert book.cancel("p1") is None
    assert book.knows("p1") and not book.is_running("p1")


def test_complete_and_failure_are_the_end_too() -> None:
    book = PullRequests()
    book.accept(pull("a"), allowed=None, id_taken=False)
    book.accept(pull("b"), allowed=None, id_taken=False)
    done = book.complete("a", ModelInfo("org/repo", "unloaded"), 10)
    assert done is not None and done.reason == "complete" and done.downloaded == 10
    failed = book.fail("b", "disk_full", "no room")
    assert failed is not None and (failed.reason, failed.error_code) == ("error", "disk_full")
    assert book.cancel("a") is None and book.cancel("b") is None


def test_refusals_touch_nothing() -> None:
    book = PullRequests(max_running=1)
    with pytest.raises(ProtocolError) as info:
        book.accept(pull("p"), allowed="not here", id_taken=False)
    assert (info.value.code, info.value.request_id) == ("pull_not_allowed", "p")
    assert not book.knows("p")
    with pytest.raises(ProtocolError) as info:
        book.accept(pull("g1"), allowed=None, id_taken=True)  # a generation's id
    assert info.value.code == "duplicate_id"
    book.accept(pull("p"), allowed=None, id_taken=False)
    with pytest.raises(ProtocolError) as info:
        book.accept(pull("p"), allowed=None, id_taken=False)
    assert info.value.code == "duplicate_id"
    with pytest.raises(ProtocolError) as info:
        book.accept(pull("q"), allowed=None, id_taken=False)
    assert info.value.code == "busy"


def test_pull_frames_round_trip() -> None:
    frames = [
        Pulling("p", Progress("downloading", 5, 10, "a.gguf", 1.5, 4.0)),
        Pulling("p", Progress("resolving")),
        PullDone("p", "complete", ModelInfo("org/r:Q4_K_M", "unloaded", 256, 2, 64), 10),
        PullDone("p", "cancelled"),
        PullDone("p", "error", error_code="hub_not_found", error_message="no such repo"),
    ]
    for frame in frames:
        assert parse_server_frame(serialize(frame)) == frame


# ---------------------------------------------------------------- on a server

llama_cpp = pytest.importorskip("llama_cpp")


@pytest.fixture
def files() -> dict[str, bytes]:
    return {"tiny-Q4_K_M.gguf": os.urandom(5 * MiB), "tiny-Q8_0.gguf": os.urandom(1000)}


@pytest.fixture
def hub(files: dict[str, bytes], tiny_gguf: Path) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        fake.add_repo("org/tiny-GGUF", files)
        fake.add_repo("org/real-GGUF", {"real-Q4_K_M.gguf": tiny_gguf.read_bytes()})
        yield fake


def v1_models(port: int) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(request, timeout=timeout()) as response:
        return json.load(response)


def config(hub: FakeHub, cache: Path, tiny: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "backend__kind": "llama",
        "backend__llama__model": str(tiny),
        "backend__llama__n_threads": 1,
        "backend__llama__n_ctx": 256,
        "models__endpoint": hub.url,
        "models__cache_dir": str(cache),
        "models__allow_pull": True,
        "security__auth_token": TOKEN,
        "stream__flush_ms": 0.0,
    }
    values.update(overrides)
    return make_config(**values)


async def test_a_pull_streams_progress_then_serves_the_model(
    hub: FakeHub, tmp_path: Path, tiny_gguf: Path
) -> None:
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        server.pulls.interval = 0.02
        async with wire(server, **AUTH) as client:
            assert client.hello["pull"] is True  # type: ignore[index]
            await client.send({"type": "pull", "id": "p1", "model": "hf:org/real-GGUF"})
            frames = await client.until(lambda f: f["type"] == "pull_done", units=30)
            assert {f["type"] for f in frames} == {"pull_progress", "pull_done"}
            statuses = [f["progress"]["status"] for f in frames[:-1]]
            assert statuses[0] == "resolving" and statuses[-1] == "done"
            assert "downloading" in statuses
            done = frames[-1]
            assert done["reason"] == "complete"
            assert done["model"]["name"] == "org/real-GGUF"
            assert done["model"]["state"] == "unloaded"
            assert done["downloaded"] == tiny_gguf.stat().st_size
            # The model is served: a generation on it, and new connections list it.
            await client.send(
                {
                    "type": "generate",
                    "id": "g",
                    "model": "org/real-GGUF",
                    "prompt": "Hi",
                    "max_tokens": 4,
                }
            )
            _, generated = await client.done("g", units=30)
            assert generated[-1]["reason"] == "length" and generated[-1]["model"] == "org/real-GGUF"
        async with wire(server, **AUTH) as other:
            names = [m["name"] for m in other.hello["models"]]  # type: ignore[index]
            assert "org/real-GGUF" in names
            listed = await asyncio.to_thread(v1_models, server.port)
            assert "org/real-GGUF" in [m["id"] for m in listed["data"]]
            # Pulling it again: already here, nothing downloaded.
            await other.send({"type": "pull", "id": "again", "model": "org/real-GGUF"})
            frames = await other.until(lambda f: f["type"] == "pull_done")
            assert frames[-1]["reason"] == "complete" and frames[-1]["downloaded"] == 0


async def test_cancel_answers_at_once_and_a_new_pull_resumes(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path, tiny_gguf: Path
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        server.pulls.interval = 0.02
        async with wire(server, **AUTH) as client:
            with hub.held(digest, after=2 * MiB + MiB // 2):
                await client.send({"type": "pull", "id": "p1", "model": "org/tiny-GGUF"})
                await client.until(
                    lambda f: f["type"] == "pull_progress" and f["progress"]["completed"] >= 2 * MiB
                )
                await client.send({"type": "cancel", "id": "p1"})
                frames = await client.until(lambda f: f["type"] == "pull_done")
                assert frames[-1] == {"type": "pull_done", "id": "p1", "reason": "cancelled"}
                assert len(server.pulls) == 0  # nobody else waited: the download stopped
                # Its id is spent, for pulls and generations alike.
                await client.send({"type": "generate", "id": "p1", "prompt": "x"})
                refused = await client.until(lambda f: f["type"] == "error")
                assert refused[-1]["code"] == "duplicate_id"
            await client.send({"type": "pull", "id": "p2", "model": "org/tiny-GGUF"})
            frames = await client.until(lambda f: f["type"] == "pull_done" and f["id"] == "p2")
            # Nothing about p1 came after its pull_done.
            assert all(f.get("id") != "p1" for f in frames)
    assert frames[-1]["reason"] == "complete"
    # The second pull asked only for what the first had not written: the first's
    # thread stopped at its next chunk and kept its 2 MiB for the second.
    last = hub.gets_of(digest)[-1]
    assert last.start == 2 * MiB and last.sent == len(files["tiny-Q4_K_M.gguf"]) - 2 * MiB


async def test_two_connections_pulling_one_model_share_the_download(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path, tiny_gguf: Path
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        async with wire(server, **AUTH) as one, wire(server, **AUTH) as two:
            with hub.held(digest, after=MiB):
                await one.send({"type": "pull", "id": "a", "model": "org/tiny-GGUF:Q4_K_M"})
                await one.until(lambda f: f["type"] == "pull_progress")
                await two.send({"type": "pull", "id": "b", "model": "org/tiny-GGUF:Q4_K_M"})
                await two.until(lambda f: f["type"] == "pull_progress")
                assert len(server.pulls) == 1
                # One leaves: the other's download goes on.
                await one.send({"type": "cancel", "id": "a"})
                await one.until(lambda f: f["type"] == "pull_done")
                assert len(server.pulls) == 1
            frames = await two.until(lambda f: f["type"] == "pull_done", units=30)
            assert frames[-1]["reason"] == "complete"
    assert len(hub.gets_of(digest)) == 1


async def test_a_lost_connection_stops_its_download(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path, tiny_gguf: Path
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        with hub.held(digest, after=MiB):
            async with wire(server, **AUTH) as client:
                await client.send({"type": "pull", "id": "a", "model": "org/tiny-GGUF"})
                await client.until(lambda f: f["type"] == "pull_progress")
                assert len(server.pulls) == 1
            await handlers_finished(server)  # its teardown left the download
            assert len(server.pulls) == 0
        blobs = tmp_path / "models--org--tiny-GGUF" / "blobs"
        assert not (blobs / digest).exists()


async def test_failures_end_with_pull_done_error_and_refusals_with_error(
    hub: FakeHub, tmp_path: Path, tiny_gguf: Path
) -> None:
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        async with wire(server, **AUTH) as client:
            await client.send({"type": "pull", "id": "x", "model": "org/no-such-GGUF"})
            frames = await client.until(lambda f: f["type"] == "pull_done")
            assert frames[-1]["reason"] == "error"
            assert frames[-1]["error"]["code"] == "hub_not_found"
            await client.send({"type": "pull", "id": "y", "model": "org/tiny-GGUF:Q2_K"})
            frames = await client.until(lambda f: f["type"] == "pull_done")
            assert frames[-1]["error"]["code"] == "hub_not_found"
            assert "tiny-Q4_K_M.gguf" in frames[-1]["error"]["message"]
            # Refused before anything starts: an error frame, no pull_done.
            for bad in ("../../etc/passwd", "org/repo/../x.gguf", "https://evil.example/x.gguf"):
                await client.send({"type": "pull", "id": "z", "model": bad})
                error = (await client.until(lambda f: f["type"] == "error"))[-1]
                assert (error["id"], error["code"]) == ("z", "bad_reference")
            await client.send({"type": "pull", "id": "z", "model": "org/tiny-GGUF", "x": 1})
            error = (await client.until(lambda f: f["type"] == "error"))[-1]
            assert error["code"] == "bad_request"
            await client.send({"type": "generate", "id": "g1", "prompt": "x", "max_tokens": 2})
            await client.done("g1")
            await client.send({"type": "pull", "id": "g1", "model": "org/tiny-GGUF"})
            error = (await client.until(lambda f: f["type"] == "error"))[-1]
            assert (error["id"], error["code"]) == ("g1", "duplicate_id")
        assert server.pulls is not None and len(server.pulls) == 0


async def test_a_cap_on_the_size_ends_the_pull(
    hub: FakeHub, tmp_path: Path, tiny_gguf: Path
) -> None:
    capped = config(hub, tmp_path, tiny_gguf, models__max_download_bytes=MiB)
    async with running_server(capped) as server:
        async with wire(server, **AUTH) as client:
            await client.send({"type": "pull", "id": "p", "model": "org/tiny-GGUF"})
            frames = await client.until(lambda f: f["type"] == "pull_done")
    assert frames[-1]["error"]["code"] == "download_too_large"
    assert hub.gets == []


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"models__allow_pull": False}, "not enabled on this server"),
        ({"backend__kind": "fake"}, "serves no GGUF files"),
    ],
)
async def test_pulls_are_refused_where_the_operator_did_not_allow_them(
    hub: FakeHub, tmp_path: Path, tiny_gguf: Path, overrides: dict[str, Any], why: str
) -> None:
    async with running_server(config(hub, tmp_path, tiny_gguf, **overrides)) as server:
        async with wire(server, **AUTH) as client:
            assert client.hello["pull"] is False  # type: ignore[index]
            await client.send({"type": "pull", "id": "p", "model": "org/tiny-GGUF"})
            error = (await client.until(lambda f: f["type"] == "error"))[-1]
            assert error["code"] == "pull_not_allowed" and why in error["message"]
    assert hub.api_calls == 0


async def test_a_connection_runs_a_few_pulls_at_once(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path, tiny_gguf: Path
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        async with wire(server, **AUTH) as client:
            with hub.held(digest, after=MiB):
                for n in range(4):
                    await client.send({"type": "pull", "id": f"p{n}", "model": "org/tiny-GGUF"})
                await client.send({"type": "pull", "id": "p4", "model": "org/tiny-GGUF"})
                error = (await client.until(lambda f: f["type"] == "error"))[-1]
                assert (error["id"], error["code"]) == ("p4", "busy")
                # A generation runs beside them.
                await client.send({"type": "generate", "id": "g", "prompt": "x", "max_tokens": 2})
                _, frames = await client.done("g")
                assert frames[-1]["reason"] == "length"
            for n in range(4):
                await client.until(
                    lambda f, n=n: f["type"] == "pull_done" and f["id"] == f"p{n}", units=30
                )


# ---------------------------------------------------------------- the Python clients


async def test_the_async_client_pulls_with_progress_and_cancels(
    hub: FakeHub, files: dict[str, bytes], tmp_path: Path, tiny_gguf: Path
) -> None:
    from wsserver_client import Client, GenerationError

    digest = sha256(files["tiny-Q4_K_M.gguf"])
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        server.pulls.interval = 0.02
        async with Client(server.url, token=TOKEN) as client:
            assert client.hello is not None and client.hello.pull is True
            pull = client.pull("org/real-GGUF")
            statuses = [progress.status async for progress in pull]
            assert statuses[0] == "resolving" and statuses[-1] == "done"
            done = await pull.result()
            assert done.reason == "complete" and done.model is not None
            assert done.model.name == "org/real-GGUF"
            result = await client.generate("Hi", model="org/real-GGUF", max_tokens=3).result()
            assert result.done.model == "org/real-GGUF"

            with hub.held(digest, after=MiB):
                slow = client.pull("org/tiny-GGUF")
                async for progress in slow:
                    if progress.status == "downloading":
                        break
                cancelled = await slow.cancel()
            assert cancelled.reason == "cancelled"

            refused = client.pull("org/../etc/passwd")
            with pytest.raises(GenerationError) as info:
                await refused.result()
            assert info.value.code == "bad_reference"


async def test_the_sync_client_pulls_too(hub: FakeHub, tmp_path: Path, tiny_gguf: Path) -> None:
    from wsserver_client.sync import Client

    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:

        def pull() -> tuple[list[str], str]:
            with Client(server.url, token=TOKEN) as client:
                handle = client.pull("org/real-GGUF")
                statuses = [progress.status for progress in handle]
                return statuses, handle.result().reason

        statuses, reason = await asyncio.to_thread(pull)
    assert statuses[-1] == "done" and reason == "complete"
