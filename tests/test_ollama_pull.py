"""``POST /api/pull``: Ollama's pull, wired to the server's pulls from the Hub
(a fake Hub, tests/fake_hub.py) — with the official ``ollama`` client, streamed
and not; a client that goes leaves the download; refusals in Ollama's shape."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import ollama
import pytest
from conftest import running_server, timeout
from fake_hub import FakeHub, sha256
from test_pull_protocol import TOKEN, config, files, hub  # noqa: F401 - fixtures

from wsserver.pull.hub import PullCancelled

pytest.importorskip("llama_cpp")

MiB = 1 << 20
BEARER = {"Authorization": f"Bearer {TOKEN}"}


def client(port: int) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=f"http://127.0.0.1:{port}", timeout=timeout(60), headers=BEARER)


async def test_a_pull_streams_status_objects_then_serves_the_model(
    hub: FakeHub,  # noqa: F811
    tmp_path: Path,
    tiny_gguf: Path,
) -> None:
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        server.pulls.interval = 0.02
        async with client(server.port) as c:
            parts = [p async for p in await c.pull("hf.co/org/real-GGUF", stream=True)]
            statuses = [p.status for p in parts]
            assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
            pulling = [p for p in parts if (p.status or "").startswith("pulling real-")]
            assert pulling and pulling[-1].total == tiny_gguf.stat().st_size
            assert all(p.completed is not None and p.completed <= (p.total or 0) for p in pulling)
            listed = [m.model for m in (await c.list()).models]
            assert "org/real-GGUF:latest" in listed
            reply = await c.generate(
                model="org/real-GGUF:latest", prompt="Hi", raw=True, options={"num_predict": 3}
            )
            assert reply.done is True and reply.eval_count == 3
            # Again, whole: already here.
            again = await c.pull("org/real-GGUF")
            assert again.status == "success"


async def test_a_client_that_goes_leaves_the_download(
    hub: FakeHub,  # noqa: F811
    files: dict[str, bytes],  # noqa: F811
    tmp_path: Path,
    tiny_gguf: Path,
) -> None:
    digest = sha256(files["tiny-Q4_K_M.gguf"])
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        server.pulls.interval = 0.02
        url = f"http://127.0.0.1:{server.port}/api/pull"
        with hub.held(digest, after=MiB):
            async with aiohttp.ClientSession() as session:
                async with session.post(url, json={"model": "org/tiny-GGUF"}, headers=BEARER) as r:
                    assert r.status == 200 and r.content_type == "application/x-ndjson"
                    while True:
                        line = json.loads(await r.content.readline())
                        if line.get("completed"):
                            break
                    (job,) = server.pulls._jobs.values()
            # Gone: nobody else waits, so the download stops.
            with pytest.raises(PullCancelled):
                await asyncio.wait_for(asyncio.shield(job.future), timeout(10))
            assert len(server.pulls) == 0


async def test_refusals_are_ollamas_shape(
    hub: FakeHub,  # noqa: F811
    tmp_path: Path,
    tiny_gguf: Path,
) -> None:
    async with running_server(config(hub, tmp_path, tiny_gguf)) as server:
        async with client(server.port) as c:
            with pytest.raises(ollama.ResponseError) as info:
                await c.pull("llama3.2")
            assert info.value.status_code == 400 and "org/repo:QUANT" in info.value.error
            with pytest.raises(ollama.ResponseError) as info:
                await c.pull("org/missing-GGUF")
            assert info.value.status_code == 404
            parts: list[Any] = []
            with pytest.raises(ollama.ResponseError) as info:
                async for part in await c.pull("org/missing-GGUF", stream=True):
                    parts.append(part)
            assert [p.status for p in parts] == ["pulling manifest"]
    async with running_server(config(hub, tmp_path, tiny_gguf, models__allow_pull=False)) as server:
        async with client(server.port) as c:
            with pytest.raises(ollama.ResponseError) as info:
                await c.pull("org/real-GGUF")
            assert info.value.status_code == 403 and "not enabled" in info.value.error
    # The two pulls of org/missing-GGUF asked the Hub; the refused ones did not.
    assert hub.api_calls == 2
