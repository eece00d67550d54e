"""Models whose file is a Hub reference (``model = "hf:org/repo:Q4_K_M"``), on a real server.

The tiny random GGUF (tests/tiny_gguf.py, a bigger one than usual: 4.5 MB, so
that a download can be caught in the middle) is served by the local imitation
of the Hub (tests/fake_hub.py); the server's cache is the test's temporary
directory. Real llama.cpp loads what was pulled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config, running_server, timeout, wire
from fake_hub import FakeHub, sha256

from wsserver.aio import Server
from wsserver.aio.pulls import Pulls
from wsserver.errors import PullError
from wsserver.pull.hub import Hub, HubSettings, PullCancelled
from wsserver.pull.progress import Progress
from wsserver.pull.reference import parse_reference

llama_cpp = pytest.importorskip("llama_cpp")

from tiny_gguf import write_tiny_gguf  # noqa: E402

MiB = 1 << 20
REPO = "org/tiny-GGUF"
GREEDY = {"prompt": "The capital of France", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    folder = tmp_path_factory.mktemp("hub-model")
    path = write_tiny_gguf(folder / "m.gguf", n_layer=4, n_embd=128, n_ff=512)
    data = path.read_bytes()
    assert len(data) > 4 * MiB
    return data


@pytest.fixture
def hub(model_bytes: bytes) -> Iterator[FakeHub]:
    with FakeHub() as fake:
        fake.add_repo(REPO, {"tiny-Q4_K_M.gguf": model_bytes, "tiny-Q8_0.gguf": b"\0" * 1000})
        yield fake


def hub_config(hub: FakeHub, cache: Path, local: Path, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "backend__kind": "llama",
        "backend__llama__model": str(local),
        "backend__llama__n_threads": 1,
        "backend__llama__n_ctx": 256,
        "backend__llama__parallel": 2,
        "backend__llama__models": [{"name": "hubtiny", "model": "hf:org/tiny-GGUF:Q4_K_M"}],
        "models__endpoint": hub.url,
        "models__cache_dir": str(cache),
        "stream__flush_ms": 0.0,
    }
    values.update(overrides)
    return make_config(**values)


@pytest.fixture
async def serving(hub: FakeHub, tmp_path: Path, tiny_gguf: Path) -> AsyncIterator[Server]:
    async with running_server(hub_config(hub, tmp_path / "cache", tiny_gguf)) as server:
        server.pulls.interval = 0.05
        yield server


async def test_a_hub_model_is_pulled_on_its_first_request_showing_its_progress(
    hub: FakeHub, model_bytes: bytes, serving: Server
) -> None:
    digest = sha256(model_bytes)
    async with wire(serving) as client:
        listed = {m["name"]: m["state"] for m in client.hello["models"]}  # type: ignore[index]
        assert listed["hubtiny"] == "unloaded"
        with hub.held(digest, after=2 * MiB + MiB // 2):
            await client.send({"type": "generate", "id": "g1", "model": "hubtiny", **GREEDY})
            # Waiting for the model: queued, loading, and how far its download is.
            frames = await client.until(
                lambda f: (
                    f["type"] == "queued" and f.get("download", {}).get("completed", 0) >= 2 * MiB
                )
            )
            queued = frames[-1]
            assert queued["loading"] is True and queued["position"] == 1
            assert queued["download"]["status"] == "downloading"
            assert queued["download"]["total"] == len(model_bytes)
            assert queued["download"]["file"] == "tiny-Q4_K_M.gguf"
        text, frames = await client.done("g1", units=60)
    assert [f["type"] for f in frames][-1] == "done" and text
    assert frames[-1]["model"] == "hubtiny"
    assert "started" in [f["type"] for f in frames]
    # The download's figures only grew.
    completed = [f["download"]["completed"] for f in frames if "download" in f]
    assert completed == sorted(completed)
    assert hub.total_sent(digest) == len(model_bytes)


async def test_cancelling_a_request_does_not_stop_or_corrupt_the_shared_download(
    hub: FakeHub, model_bytes: bytes, serving: Server
) -> None:
    digest = sha256(model_bytes)
    async with wire(serving) as one, wire(serving) as two:
        with hub.held(digest, after=3 * MiB):
            await one.send({"type": "generate", "id": "a", "model": "hubtiny", **GREEDY})
            await two.send({"type": "generate", "id": "b", "model": "hubtiny", **GREEDY})
            for client in (one, two):
                await client.until(lambda f: f["type"] == "queued" and "download" in f)
            await one.send({"type": "cancel", "id": "a"})
            _, frames = await one.done("a")
            assert frames[-1]["reason"] == "cancelled"
        # The other request goes on to its answer, from the one download.
        text, frames = await two.done("b", units=60)
        assert frames[-1]["reason"] == "length" and text
    assert len(hub.gets_of(digest)) == 1
    assert hub.total_sent(digest) == len(model_bytes)


async def test_a_download_nobody_waits_for_any_more_still_completes(
    hub: FakeHub, model_bytes: bytes, serving: Server
) -> None:
    digest = sha256(model_bytes)
    async with wire(serving) as client:
        with hub.held(digest, after=MiB):
            await client.send({"type": "generate", "id": "a", "model": "hubtiny", **GREEDY})
            await client.until(lambda f: f["type"] == "queued" and "download" in f)
            await client.send({"type": "cancel", "id": "a"})
            await client.done("a")
        # The model was configured: its download is kept, and it loads.
        async with asyncio.timeout(timeout(60)):
            while serving.models.models["hubtiny"].state == "loading":
                await serving.models.models["hubtiny"].changed.wait()
        await client.send({"type": "generate", "id": "b", "model": "hubtiny", **GREEDY})
        _, frames = await client.done("b", units=60)
    assert frames[-1]["reason"] == "length"
    assert hub.total_sent(digest) == len(model_bytes)


async def test_a_corrupted_download_is_refused_and_never_loaded(
    hub: FakeHub, model_bytes: bytes, serving: Server, tmp_path: Path
) -> None:
    hub.corrupt(sha256(model_bytes))
    async with wire(serving) as client:
        await client.send({"type": "generate", "id": "g", "model": "hubtiny", **GREEDY})
        frames = await client.until(lambda f: f["type"] == "error", units=60)
    error = frames[-1]
    assert error["code"] == "model_load_failed"
    assert "verification_failed" not in error["message"]  # the code is model_load_failed,
    assert "digest" in error["message"]  # the message says why
    assert serving.models.models["hubtiny"].state == "unloaded"
    blobs = tmp_path / "cache" / "models--org--tiny-GGUF" / "blobs"
    assert not any(blobs.iterdir()) if blobs.exists() else True


async def test_a_hub_model_as_the_default_is_pulled_before_the_server_is_ready(
    hub: FakeHub, model_bytes: bytes, tmp_path: Path
) -> None:
    config = make_config(
        backend__kind="llama",
        backend__llama__model="hf:org/tiny-GGUF",
        backend__llama__n_threads=1,
        backend__llama__n_ctx=256,
        models__endpoint=hub.url,
        models__cache_dir=str(tmp_path),
    )
    async with running_server(config) as server:
        assert server.backend.model_name == "org/tiny-GGUF"
        async with wire(server) as client:
            assert client.hello["model"] == "org/tiny-GGUF"  # type: ignore[index]
            await client.send({"type": "generate", "id": "g", **GREEDY})
            _, frames = await client.done("g")
        assert frames[-1]["model"] == "org/tiny-GGUF"
    # Offline, from the cache: the Hub is not asked.
    calls = (hub.api_calls, hub.heads, len(hub.gets))
    offline = make_config(
        backend__kind="llama",
        backend__llama__model="hf:org/tiny-GGUF",
        backend__llama__n_threads=1,
        backend__llama__n_ctx=256,
        models__endpoint=hub.url,
        models__cache_dir=str(tmp_path),
        models__offline=True,
    )
    async with running_server(offline) as server:
        async with wire(server) as client:
            await client.send({"type": "generate", "id": "g", **GREEDY})
            _, frames = await client.done("g")
        assert frames[-1]["reason"] == "length"
    assert (hub.api_calls, hub.heads, len(hub.gets)) == calls


def test_a_bad_reference_in_the_configuration_stops_the_server(tmp_path: Path) -> None:
    from wsserver.backends import create_models
    from wsserver.errors import ConfigError

    config = make_config(
        backend__kind="llama",
        backend__llama__models=[{"name": "x", "model": "hf:org/../etc/passwd.gguf"}],
    )
    with pytest.raises(
        ConfigError, match=r"backend.llama.models\[0\].model: .* not a model reference"
    ):
        create_models(config)


# ---------------------------------------------------------------- the registry of pulls


async def test_two_pulls_of_one_reference_share_one_download(
    hub: FakeHub, model_bytes: bytes, tmp_path: Path
) -> None:
    digest = sha256(model_bytes)
    pulls = Pulls(Hub(HubSettings(endpoint=hub.url, cache_dir=tmp_path)), interval=0.01)
    reference = parse_reference("org/tiny-GGUF")
    seen: dict[str, list[Progress]] = {"one": [], "two": []}
    with hub.held(digest, after=2 * MiB):
        one = pulls.start(reference)
        one.on_progress = seen["one"].append
        two = pulls.start(parse_reference("hf:org/tiny-GGUF"))
        two.on_progress = seen["two"].append
        assert len(pulls) == 1
    first, second = await asyncio.wait_for(asyncio.gather(one.wait(), two.wait()), timeout())
    assert first is second
    assert len(hub.gets_of(digest)) == 1
    assert seen["one"][-1].status == seen["two"][-1].status == "done"
    assert len(pulls) == 0


async def test_the_last_party_to_leave_stops_the_download_and_a_new_pull_resumes_it(
    hub: FakeHub, model_bytes: bytes, tmp_path: Path
) -> None:
    digest = sha256(model_bytes)
    pulls = Pulls(Hub(HubSettings(endpoint=hub.url, cache_dir=tmp_path)), interval=0.01)
    reference = parse_reference("org/tiny-GGUF")
    written = asyncio.Event()
    with hub.held(digest, after=2 * MiB + MiB // 2):
        one = pulls.start(reference)
        two = pulls.start(reference)
        one.on_progress = lambda p: written.set() if p.completed >= 2 * MiB else None
        await asyncio.wait_for(written.wait(), timeout())
        one.leave()
        assert len(pulls) == 1  # the other still waits: the download goes on
        two.leave()
        assert len(pulls) == 0
        with pytest.raises(PullCancelled):
            await two.wait()
    again = pulls.start(reference)
    pulled = await asyncio.wait_for(again.wait(), timeout())
    assert pulled.model_path.read_bytes() == model_bytes
    gets = hub.gets_of(digest)
    assert gets[-1].start == 2 * MiB and gets[-1].sent == len(model_bytes) - 2 * MiB


async def test_a_failed_pull_tells_every_party(hub: FakeHub, tmp_path: Path) -> None:
    pulls = Pulls(Hub(HubSettings(endpoint=hub.url, cache_dir=tmp_path)))
    one = pulls.start(parse_reference("org/nothing-here"))
    two = pulls.start(parse_reference("org/nothing-here"))
    for party in (one, two):
        with pytest.raises(PullError) as info:
            await asyncio.wait_for(party.wait(), timeout())
        assert info.value.code == "hub_not_found"
