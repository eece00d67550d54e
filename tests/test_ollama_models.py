"""Ollama's model endpoints: ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``, the probes, and the endpoints this server does not have —
with the official ``ollama`` client, on the tiny GGUF (its header read back
with the ``gguf`` package as the oracle) and the fake engine."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
import gguf
import ollama
import pytest
from conftest import FAKE_MODEL, TINY_MODEL, running_server, timeout
from test_ollama_http import async_client, host

from wsserver.dialects.ollama.catalog import (
    API_VERSION,
    QUANTIZATION,
    capabilities,
    listed_name,
    parameter_size,
)

THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
)


def tiny(path: pathlib.Path, **settings: Any) -> dict[str, Any]:
    return {
        "backend__kind": "llama",
        "backend__llama__model": str(path),
        "backend__llama__n_threads": 1,
        "backend__llama__parallel": 1,
        "backend__llama__n_ctx": 512,
        **settings,
    }


def header_value(path: pathlib.Path, key: str) -> Any:
    field = gguf.GGUFReader(str(path)).fields[key]
    return field.parts[field.data[0]][0]


# ---------------------------------------------------------------- sans-I/O


def test_the_quantization_names_are_llama_cpps_file_types() -> None:
    for member in gguf.LlamaFileType:
        if member.name == "GUESSED":
            continue
        name = member.name.removeprefix("MOSTLY_").removeprefix("ALL_")
        assert QUANTIZATION[member.value] == name


def test_names_sizes_and_capabilities_as_ollama_writes_them() -> None:
    assert listed_name("tiny") == "tiny:latest" and listed_name("gemma3:270m") == "gemma3:270m"
    sizes = {
        268_098_176: "268.10M",
        1_235_814_400: "1.2B",
        7_000_000_000: "7B",
        123_400_000_000: "123.4B",
        2_500: "2K",
        950: "950",
    }
    for count, text in sizes.items():
        assert parameter_size(count) == text
    assert capabilities(tools=False, template="") == ("completion",)
    assert capabilities(tools=True, template="{% if enable_thinking %}") == (
        "completion",
        "tools",
        "thinking",
    )
    # An embedding GGUF (it declares a pooling type) writes no text; a reranker embeds nothing.
    assert capabilities(tools=True, template="", embedding=True, encoder=True) == ("embedding",)
    assert capabilities(tools=True, template="", embedding=False, encoder=True) == ()
    assert capabilities(tools=False, template="", embedding=True) == ("completion", "embedding")


# ---------------------------------------------------------------- the server


async def test_list_show_ps_and_version_on_a_gguf(
    tiny_gguf: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    pytest.importorskip("llama_cpp")
    from tiny_gguf import write_tiny_gguf

    thinking = write_tiny_gguf(tmp_path / "thinker.gguf", chat_template=THINKING_TEMPLATE)
    settings = tiny(tiny_gguf, backend__llama__keep_alive_s=600.0)
    settings["backend__llama__models"] = [{"name": "thinker", "model": str(thinking)}]
    async with running_server(**settings) as server, async_client(server) as c:
        listed = await c.list()
        assert [m.model for m in listed.models] == ["tiny:latest", "thinker:latest"]
        entry = listed.models[0]
        assert entry.size == tiny_gguf.stat().st_size and len(entry.digest or "") == 64
        assert entry.modified_at is not None
        assert abs(entry.modified_at.timestamp() - tiny_gguf.stat().st_mtime) < 1
        details = entry.details
        assert details is not None and details.format == "gguf"
        assert details.family == "llama" and details.families == ["llama"]
        file_type = int(header_value(tiny_gguf, "general.file_type"))
        assert details.quantization_level == QUANTIZATION[file_type] == "F32"

        shown = await c.show(TINY_MODEL)
        info = shown.modelinfo or {}
        assert info["general.architecture"] == "llama"
        assert info["llama.context_length"] == header_value(tiny_gguf, "llama.context_length")
        assert info["llama.block_count"] == header_value(tiny_gguf, "llama.block_count")
        # Loaded (the default model): its engine embeds it (mean pooling).
        assert shown.capabilities == ["completion", "embedding", "tools"]
        assert (await c.show("tiny:latest")).details == shown.details
        thinker = await c.show("thinker")
        assert thinker.template == THINKING_TEMPLATE
        # Not loaded: a generative GGUF's header says nothing of embeddings.
        assert thinker.capabilities == ["completion", "tools", "thinking"]

        # Loaded: the default (at start), with its keep-alive of 600 s once idle.
        before = time.time()
        ps = await c.ps()
        (running,) = ps.models
        assert running.model == "tiny:latest" and running.context_length == 512
        assert running.size == server.models.models[TINY_MODEL].bytes > entry.size
        assert running.expires_at is not None
        assert before + 590 <= running.expires_at.timestamp() <= time.time() + 600
        # A request's own keep_alive moves it (a load's: answered once the
        # model is idle again, so the timer is the request's by then).
        loaded = await c.generate(model=TINY_MODEL, keep_alive="1h")
        assert loaded.done_reason == "load"
        (running,) = (await c.ps()).models
        assert running.expires_at is not None
        assert running.expires_at.timestamp() > time.time() + 3500
        # And a load of the other model puts it there too.
        await c.generate(model="thinker")
        assert [m.model for m in (await c.ps()).models] == ["tiny:latest", "thinker:latest"]

        async with aiohttp.ClientSession() as session:
            async with session.get(host(server) + "/api/version") as response:
                assert response.status == 200
                assert await response.json() == {"version": API_VERSION}


async def test_the_fake_engine_is_listed_without_a_file() -> None:
    async with running_server() as server, async_client(server) as c:
        (entry,) = (await c.list()).models
        assert entry.model == "fake:latest" and entry.size == 0 and entry.details is not None
        assert entry.details.format == "" and entry.details.family == ""
        shown = await c.show(FAKE_MODEL)
        # The fake embeds too (its vectors are deterministic: docs/embeddings.md).
        assert shown.capabilities == ["completion", "embedding", "tools"]
        assert shown.modelinfo == {}
        (running,) = (await c.ps()).models
        # Kept until its memory is needed (no keep_alive_s): "forever".
        assert running.expires_at == datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)


async def test_unknown_models_and_unsupported_endpoints_are_named_in_ollamas_shape() -> None:
    async with running_server() as server:
        async with async_client(server) as c:
            with pytest.raises(ollama.ResponseError) as info:
                await c.show("nope")
            assert info.value.status_code == 404 and "model 'nope' not found" in info.value.error
            calls: list[tuple[Any, str]] = [
                (c.delete(FAKE_MODEL), "/api/delete"),
                (c.copy(FAKE_MODEL, "other"), "/api/copy"),
                (c.push("x/y"), "/api/push"),
                (c.create(model="x", from_=FAKE_MODEL), "/api/create"),
            ]
            for call, named in calls:
                with pytest.raises(ollama.ResponseError) as info:
                    await call
                assert info.value.status_code == 501, info.value
                assert info.value.error.startswith(named + ": "), info.value.error
                assert "not supported" in info.value.error
        async with aiohttp.ClientSession() as session:
            url = host(server)
            async with session.head(url + "/api/blobs/sha256:00") as response:
                assert response.status == 501
            async with session.post(url + "/api/blobs/sha256:00", data=b"x") as response:
                assert response.status == 501
                assert "blobs" in (await response.json())["error"]
            async with session.get(url + "/api/nowhere") as response:
                assert response.status == 404 and set(await response.json()) == {"error"}
            async with session.post(url + "/api/tags") as response:
                assert response.status == 405 and set(await response.json()) == {"error"}
            # The probes Ollama's tools use: HEAD / and GET /.
            async with session.head(url + "/") as response:
                assert response.status == 200
            async with session.get(url + "/") as response:
                assert response.status == 200


async def test_a_token_is_asked_of_ollamas_clients_as_a_bearer() -> None:
    async with running_server(security__auth_token="s3cret") as server:
        async with aiohttp.ClientSession() as session:
            async with session.get(host(server) + "/api/tags") as response:
                assert response.status == 401
                assert set(json.loads(await response.read())) == {"error"}
        # The official client sends OLLAMA_API_KEY as a Bearer; headers= does the same here.
        async with ollama.AsyncClient(
            host=host(server), timeout=timeout(30), headers={"Authorization": "Bearer s3cret"}
        ) as c:
            listed = await asyncio.wait_for(c.list(), timeout(10))
        assert [m.model for m in listed.models] == ["fake:latest"]
