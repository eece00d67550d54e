"""Ollama's /api/embed and /api/embeddings, through the official ``ollama`` client.

On the fake engine (its vectors are known: :func:`fake_vector`) the wire:
normalisation, the older endpoint's raw vector, truncation, loading with
nothing to embed, refusals; on the llama engine with a tiny embedding GGUF,
vectors equal to llama-cpp-python's ``Llama.embed`` normalised, and the
capabilities ``/api/show`` reports.
"""

from __future__ import annotations

import math
import pathlib
import struct
from typing import Any

import aiohttp
import gguf
import llama_cpp
import numpy as np
import ollama
import pytest
from conftest import FAKE_MODEL, make_config, running_server
from test_ollama_http import async_client, host
from tiny_gguf import write_tiny_gguf

from wsserver.backends.fake_embed import FAKE_DIMENSIONS, FAKE_EMBED_TOKENS, fake_vector

TEXTS = ["The capital of France is Paris.", "café ünïcode 日本語"]


def unit(vector: bytes) -> list[float]:
    values = list(struct.unpack(f"<{FAKE_DIMENSIONS}f", vector))
    norm = math.sqrt(sum(v * v for v in values))
    return [v / norm for v in values]


async def test_embed_answers_each_input_l2_normalised_in_order() -> None:
    async with running_server() as server, async_client(server) as c:
        reply = await c.embed(model=FAKE_MODEL, input=TEXTS)
        assert reply.model == FAKE_MODEL
        assert len(reply.embeddings) == len(TEXTS)
        for got, text in zip(reply.embeddings, TEXTS, strict=True):
            assert np.allclose(got, unit(fake_vector(text)), atol=1e-6)
            assert abs(np.linalg.norm(got) - 1.0) < 1e-6
        # The fake counts four bytes a token.
        assert reply.prompt_eval_count == sum(max(1, len(t.encode()) // 4) for t in TEXTS)
        assert reply.total_duration is not None and reply.load_duration is not None
        # The wait for the engine is part of the whole: an order, not a speed.
        assert reply.total_duration >= reply.load_duration >= 0  # timing-ok: order only
        # One string is one input.
        single = await c.embed(model=FAKE_MODEL, input=TEXTS[0])
        assert np.allclose(single.embeddings[0], reply.embeddings[0])


async def test_the_older_endpoint_gives_the_models_own_vector() -> None:
    async with running_server() as server, async_client(server) as c:
        reply = await c.embeddings(model=FAKE_MODEL, prompt=TEXTS[0])
        raw = struct.unpack(f"<{FAKE_DIMENSIONS}f", fake_vector(TEXTS[0]))
        assert np.allclose(reply.embedding, raw, atol=1e-6)
        assert abs(np.linalg.norm(reply.embedding) - 1.0) > 1e-3  # not normalised


async def test_nothing_to_embed_loads_the_model_or_unloads_it() -> None:
    async with running_server() as server, async_client(server) as c:
        reply = await c.embed(model=FAKE_MODEL, input=[])
        assert reply.embeddings == [] and reply.prompt_eval_count == 0
        assert server.models.models[FAKE_MODEL].state == "loaded"
        assert (await c.embeddings(model=FAKE_MODEL, prompt="")).embedding == []
        await c.embed(model=FAKE_MODEL, input="", keep_alive=0)
        # keep_alive 0: unloaded once idle (it is: nothing runs).
        assert server.models.models[FAKE_MODEL].state != "loaded"


async def test_an_input_too_long_is_cut_unless_the_request_says_not_to() -> None:
    long = "word " * (FAKE_EMBED_TOKENS * 2)  # twice what the fake embeds
    cut = long.encode()[: FAKE_EMBED_TOKENS * 4].decode()
    async with running_server() as server, async_client(server) as c:
        reply = await c.embed(model=FAKE_MODEL, input=["short", long])  # truncate: true by default
        assert np.allclose(reply.embeddings[1], unit(fake_vector(cut)), atol=1e-6)
        with pytest.raises(ollama.ResponseError) as info:
            await c.embed(model=FAKE_MODEL, input=["short", long], truncate=False)
        assert info.value.status_code == 400
        assert "input 1" in info.value.error and str(FAKE_EMBED_TOKENS) in info.value.error


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "options": {"num_ctx": 64}}, "num_ctx"),
        ({"input": "x", "options": {"mirostat": 2}}, "mirostat"),
        ({"input": "x", "truncate": "yes"}, "truncate"),
        ({"input": ["a", 3]}, "input 1"),
        ({"input": ["a", ""]}, "input 1"),
        ({"input": {"text": "a"}}, "input"),
        ({"input": "x", "suffix": "y"}, "suffix"),
        ({"input": ["x"] * 2049}, "2049"),
        ({"input": "x", "keep_alive": "soon"}, "keep_alive"),
    ],
)
async def test_bad_bodies_are_refused_naming_what(body: dict[str, Any], named: str) -> None:
    async with running_server() as server, aiohttp.ClientSession() as session:
        async with session.post(
            host(server) + "/api/embed", json={"model": FAKE_MODEL, **body}
        ) as response:
            answer = await response.json()
        assert response.status == 400, answer
        assert set(answer) == {"error"} and named in answer["error"], answer
        # Nothing was queued, and the server serves the next request.
        assert server.scheduler.busy == 0
        async with session.post(
            host(server) + "/api/embeddings", json={"model": FAKE_MODEL, "prompt": 3}
        ) as response:
            assert response.status == 400 and "prompt" in (await response.json())["error"]


async def test_an_unknown_model_is_ollamas_404() -> None:
    async with running_server() as server, async_client(server) as c:
        with pytest.raises(ollama.ResponseError) as info:
            await c.embed(model="nope", input="x")
        assert info.value.status_code == 404 and "model 'nope' not found" in info.value.error


# ---------------------------------------------------------------- the llama engine


@pytest.fixture(scope="module")
def embedding_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    folder = tmp_path_factory.mktemp("ollama-embed")
    return {
        "mean": write_tiny_gguf(folder / "mean.gguf", pooling=gguf.PoolingType.MEAN),
        "rank": write_tiny_gguf(folder / "rank.gguf", pooling=gguf.PoolingType.RANK),
        "none": write_tiny_gguf(folder / "none.gguf"),
    }


def llama(path: pathlib.Path) -> Any:
    return running_server(
        make_config(
            backend__kind="llama",
            backend__llama__model=str(path),
            backend__llama__n_threads=1,
            backend__llama__n_ctx=512,
        )
    )


async def test_llama_vectors_are_llama_cpp_pythons_normalised(
    embedding_ggufs: dict[str, pathlib.Path],
) -> None:
    path = embedding_ggufs["mean"]
    model = llama_cpp.Llama(
        str(path), embedding=True, n_ctx=512, n_batch=512, n_threads=1, verbose=False
    )
    try:
        expected = np.array(model.embed(TEXTS, normalize=True), dtype=np.float64)
        raw = np.array(model.embed(TEXTS[:1]), dtype=np.float64)
    finally:
        model.close()
    async with llama(path) as server, async_client(server) as c:
        # Before its load, the header says it embeds; it writes no text.
        assert (await c.show("mean")).capabilities == ["embedding"]
        reply = await c.embed(model="mean", input=TEXTS)
        legacy = await c.embeddings(model="mean", prompt=TEXTS[0])
        assert (await c.show("mean:latest")).capabilities == ["embedding"]
    got = np.array(reply.embeddings, dtype=np.float64)
    assert got.shape == expected.shape == (len(TEXTS), 64)
    assert np.abs(got - expected).max() <= 1e-4
    assert np.abs(np.array(legacy.embedding) - raw[0]).max() <= 1e-4


async def test_a_reranker_and_a_generative_model_on_api_embed(
    embedding_ggufs: dict[str, pathlib.Path],
) -> None:
    async with llama(embedding_ggufs["rank"]) as server, async_client(server) as c:
        assert (await c.show("rank")).capabilities == []
        with pytest.raises(ollama.ResponseError) as info:
            await c.embed(model="rank", input="x")
        assert info.value.status_code == 400 and "reranker" in info.value.error
    async with llama(embedding_ggufs["none"]) as server, async_client(server) as c:
        # A generative model embeds with mean pooling; its capabilities say so once loaded.
        reply = await c.embed(model="none", input=TEXTS)
        assert len(reply.embeddings) == 2 and len(reply.embeddings[0]) == 64
        assert (await c.show("none")).capabilities == ["completion", "embedding", "tools"]


async def test_a_long_input_is_cut_to_embed_batch_by_default(
    embedding_ggufs: dict[str, pathlib.Path],
) -> None:
    path = embedding_ggufs["mean"]
    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    long = " ".join(["hello world"] * 400)
    tokens = vocab.tokenize(long.encode(), add_bos=True, special=False)
    vocab.close()
    assert len(tokens) > 512
    async with llama(path) as server, async_client(server) as c:
        reply = await c.embed(model="mean", input=long)
        assert reply.prompt_eval_count == 512  # backend.llama.embed_batch
        with pytest.raises(ollama.ResponseError) as info:
            await c.embed(model="mean", input=long, truncate=False)
        assert info.value.status_code == 400 and "input 0" in info.value.error
