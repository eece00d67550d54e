"""``POST /v1/embeddings``, ``/v1/rerank`` and ``/rerank`` end to end on the fake
engine: a real server, the official ``openai`` SDK (and aiohttp for what the
SDK cannot send). The fake's vectors are known (:func:`fake_vector`), so every
answer is checked value for value."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
from conftest import FAKE_MODEL, make_config, running_server, timeout

from wsserver.aio import Server
from wsserver.backends.base import CancelEvent
from wsserver.backends.embed_door import EmbedSubmission
from wsserver.backends.fake_embed import FAKE_DIMENSIONS, fake_score, fake_vector
from wsserver.core.embedding import Embed, floats_of


def base_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}/v1"


@contextlib.asynccontextmanager
async def sdk(server: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=base_url(server), api_key="unused", max_retries=0, timeout=timeout(30)
    )
    try:
        yield client
    finally:
        await client.close()


async def post(server: Server, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{server.port}{path}", json=body) as response,
    ):
        return response.status, await response.json()


def vector(item: str | tuple[int, ...]) -> list[float]:
    return floats_of(fake_vector(item))


# ---------------------------------------------------------------- embeddings


async def test_the_sdks_default_base64_path_gives_the_engines_vectors() -> None:
    async with running_server() as server, sdk(server) as client:
        reply = await client.embeddings.create(model=FAKE_MODEL, input=["hello", "world"])
    assert [d.index for d in reply.data] == [0, 1]
    # The SDK asked for base64 and decoded it: float32 values, exactly.
    assert reply.data[0].embedding == vector("hello")
    assert reply.data[1].embedding == vector("world")
    assert len(reply.data[0].embedding) == FAKE_DIMENSIONS
    assert reply.model == FAKE_MODEL
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == 2


async def test_float_and_base64_carry_the_same_float32_values() -> None:
    async with running_server() as server:
        status, floats = await post(
            server, "/v1/embeddings", {"input": "café", "encoding_format": "float"}
        )
        assert status == 200
        status, b64 = await post(
            server, "/v1/embeddings", {"input": "café", "encoding_format": "base64"}
        )
        assert status == 200
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack(f"<{FAKE_DIMENSIONS}f", raw)) == floats["data"][0]["embedding"]
    assert floats["data"][0]["embedding"] == vector("café")
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


async def test_token_arrays_are_inputs_too() -> None:
    async with running_server() as server, sdk(server) as client:
        one = await client.embeddings.create(model=FAKE_MODEL, input=[1, 2, 3])
        many = await client.embeddings.create(model=FAKE_MODEL, input=[[1, 2], [3], [4, 5, 6]])
    assert [d.embedding for d in one.data] == [vector((1, 2, 3))]
    assert [d.embedding for d in many.data] == [vector((1, 2)), vector((3,)), vector((4, 5, 6))]
    assert one.usage.prompt_tokens == 3
    assert many.usage.prompt_tokens == 6


@pytest.mark.parametrize(
    ("body", "code", "param", "says"),
    [
        ({}, "bad_request", "input", "'input' is required"),
        ({"input": []}, "bad_request", "input", "empty array"),
        ({"input": ""}, "bad_request", "input", "input 0 is an empty string"),
        ({"input": ["a", ""]}, "bad_request", "input", "input 1 is an empty string"),
        ({"input": [[]]}, "bad_request", "input", "input 0 is an empty token array"),
        ({"input": ["a", 3.5]}, "bad_request", "input", "input 1 is neither"),
        ({"input": ["a", {"text": "b"}]}, "bad_request", "input", "input 1 is neither"),
        ({"input": [[1, -2]]}, "bad_request", "input", "integers >= 0"),
        ({"input": [True]}, "bad_request", "input", "input 0 is neither"),
        ({"input": 5}, "bad_request", "input", "must be a string"),
        ({"input": ["a"] * 100_000}, "bad_request", "input", "at most 2048"),
        ({"input": "a", "encoding_format": "int8"}, "bad_request", "encoding_format", "float"),
        ({"input": "a", "dimensions": 8}, "unsupported_option", "dimensions", "'dimensions'"),
        ({"input": "a", "truncate_prompt_tokens": 8}, "unsupported_option", None, "truncated"),
        ({"input": "a", "embd_normalize": 2}, "unsupported_option", None, "as the model"),
        ({"input": "a", "colour": "blue"}, "bad_request", "colour", "not a field"),
        ({"input": "a", "model": 3}, "bad_request", "model", "'model' must be a string"),
    ],
)
async def test_bad_input_is_a_400_that_says_what(
    body: dict[str, Any], code: str, param: str | None, says: str
) -> None:
    async with running_server() as server:
        status, answer = await post(server, "/v1/embeddings", body)
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == code
    assert says in error["message"]
    if param is not None:
        assert error["param"] == param


async def test_an_input_over_the_models_length_is_refused_with_its_index() -> None:
    async with running_server() as server:
        status, answer = await post(server, "/v1/embeddings", {"input": ["ok", "x" * 4000]})
    assert status == 400
    assert answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["message"].startswith("input 1 is 1000 tokens")
    assert answer["error"]["param"] == "input"


async def test_token_ids_outside_the_vocabulary_are_refused_with_the_input() -> None:
    async with running_server() as server:
        status, answer = await post(server, "/v1/embeddings", {"input": [[1], [2, 100_000]]})
    assert status == 400
    assert "input 1: token 100000 is not in the model's vocabulary" in answer["error"]["message"]


async def test_an_unknown_model_is_a_404() -> None:
    async with running_server() as server, sdk(server) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.embeddings.create(model="nope", input="a")
    assert caught.value.code == "model_not_found"


async def test_only_post() -> None:
    async with (
        running_server() as server,
        aiohttp.ClientSession() as session,
        session.get(base_url(server) + "/embeddings") as response,
    ):
        assert response.status == 405


async def test_a_client_gone_cancels_its_embedding_and_frees_the_slot() -> None:
    # One slot, a second per token: the abandoned request would hold it for minutes.
    async with running_server(
        backend__fake__parallel=1, backend__fake__prefill_ms_per_token=1000.0
    ) as server:
        backend = server.backend
        started = asyncio.Event()
        door = backend.embed_door
        real_start = door.start

        def start(request: Embed, *, cancel: CancelEvent) -> EmbedSubmission:
            started.set()
            return real_start(request, cancel=cancel)

        door.start = start  # type: ignore[method-assign]
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(
                session.post(base_url(server) + "/embeddings", json={"input": ["x" * 400] * 8})
            )
            async with asyncio.timeout(timeout(10)):
                await started.wait()
            # The embedding request owns its slot: the scheduler's books balance
            # however long it runs (before, /readyz went 503 after a second).
            now = asyncio.get_running_loop().time()
            assert server.orphaned_slots(now) == []
            assert server.orphaned_slots(now + 60.0) == []
            task.cancel()  # the client walks away: its connection closes
            with contextlib.suppress(asyncio.CancelledError):
                await task
        door.start = real_start  # type: ignore[method-assign]
        # The next request gets the one slot at once, and its answer is quick
        # (one token: one simulated second) — not after the abandoned 800 s.
        async with asyncio.timeout(timeout(10)):
            status, answer = await post(server, "/v1/embeddings", {"input": "abcd"})
        assert status == 200, answer
        assert server.scheduler.busy == 0


# ---------------------------------------------------------------- rerank


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
async def test_rerank_sorts_by_relevance_cuts_to_top_n_and_returns_documents(path: str) -> None:
    documents = ["pandas eat bamboo", "the sky is blue", "bears", "paris is in france"]
    async with running_server() as server:
        status, answer = await post(
            server,
            path,
            {"query": "panda", "documents": documents, "top_n": 3, "return_documents": True},
        )
    assert status == 200, answer
    scores = [fake_score("panda", d) for d in documents]
    best = sorted(range(4), key=lambda i: -scores[i])[:3]
    assert [r["index"] for r in answer["results"]] == best
    assert [r["relevance_score"] for r in answer["results"]] == [scores[i] for i in best]
    assert [r["document"]["text"] for r in answer["results"]] == [documents[i] for i in best]
    assert answer["model"] == FAKE_MODEL
    assert answer["usage"]["prompt_tokens"] > 0


async def test_rerank_without_top_n_returns_every_document_without_its_text() -> None:
    async with running_server() as server:
        status, answer = await post(server, "/v1/rerank", {"query": "q", "documents": ["a", "b"]})
    assert status == 200
    assert sorted(r["index"] for r in answer["results"]) == [0, 1]
    assert all("document" not in r for r in answer["results"])


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"documents": ["a"]}, "'query'"),
        ({"query": "q", "documents": []}, "'documents'"),
        ({"query": "q", "documents": ["a", 3]}, "document 1"),
        ({"query": "q", "documents": ["a", ""]}, "document 1"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "'top_n'"),
        ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "'return_documents'"),
        ({"query": "q", "documents": ["a"] * 100_000}, "at most 2048"),
    ],
)
async def test_bad_rerank_bodies_are_400s(body: dict[str, Any], says: str) -> None:
    async with running_server() as server:
        status, answer = await post(server, "/v1/rerank", body)
    assert status == 400
    assert says in answer["error"]["message"]


async def test_the_models_list_says_which_models_embed() -> None:
    async with running_server() as server:
        async with (
            aiohttp.ClientSession() as session,
            session.get(base_url(server) + "/models") as response,
        ):
            listed = await response.json()
    assert listed["data"][0]["embeddings"] == "embed"


async def test_the_relay_passes_embeddings_and_rerank_through() -> None:
    """Through the openai relay to an upstream that has the endpoints: the
    upstream's vectors (asked as base64; read as floats too) and scores,
    in input order, rendered as for a local model; an upstream without
    them (404) is refused by name, never a silent empty answer."""
    from fake_upstream import FakeUpstream

    from wsserver.backends.openai import OpenAIBackend

    async with FakeUpstream() as up:
        up.embeddings = True
        backend = OpenAIBackend(urls=[up.url], backoff_s=0.05, max_backoff_s=0.5)
        server = Server(
            make_config(backend__kind="openai", backend__openai__urls=[up.url]), backend
        )
        await server.start()
        try:
            async with asyncio.timeout(timeout(20)):
                await server.wait_ready()
            status, answer = await post(server, "/v1/embeddings", {"input": ["a", "bc"]})
            up.float_vectors = True
            _, floats = await post(server, "/v1/embeddings", {"input": [[1, 2], "bc"]})
            rerank_status, rerank = await post(
                server, "/v1/rerank", {"query": "q", "documents": ["a", "b", "c"], "top_n": 2}
            )
            up.embeddings = False
            missing_status, missing = await post(server, "/v1/embeddings", {"input": "a"})
            rerank_missing_status, rerank_missing = await post(
                server, "/v1/rerank", {"query": "q", "documents": ["a"]}
            )
        finally:
            await server.stop(grace=0)
    assert status == 200, answer
    assert [d["embedding"] for d in answer["data"]] == [
        pytest.approx(list(struct.unpack("<16f", fake_vector(t)))) for t in ("a", "bc")
    ]
    assert answer["model"] == "fake-upstream" and answer["usage"]["prompt_tokens"] == 7
    assert up.embed_bodies[0] == {
        "model": "fake-upstream",
        "input": ["a", "bc"],
        "encoding_format": "base64",
    }
    assert up.embed_bodies[1]["input"] == [[1, 2], "bc"]
    assert [d["embedding"] for d in floats["data"]] == [
        pytest.approx(list(struct.unpack("<16f", fake_vector(t)))) for t in ((1, 2), "bc")
    ]
    assert rerank_status == 200, rerank
    scores = {i: fake_score("q", d) for i, d in enumerate(["a", "b", "c"])}
    best = sorted(scores, key=lambda i: -scores[i])[:2]
    assert [r["index"] for r in rerank["results"]] == best
    assert up.embed_bodies[2]["top_n"] == 3  # all scored upstream; cut here
    assert missing_status == 400 and missing["error"]["code"] == "unsupported_option"
    assert "embeddings are not served by the upstream" in missing["error"]["message"]
    assert rerank_missing_status == 400
    assert "rerank is not served by the upstream" in rerank_missing["error"]["message"]


async def test_embedding_requests_are_counted_by_how_they_ended() -> None:
    async with running_server() as server:
        assert (await post(server, "/v1/embeddings", {"input": "abcd"}))[0] == 200
        # A token outside the vocabulary: refused once it had its slot (the engine's check).
        assert (await post(server, "/v1/embeddings", {"input": [[10**6]]}))[0] == 400
        rerank = {"query": "q", "documents": ["a"]}
        assert (await post(server, "/v1/rerank", rerank))[0] == 200
        registry = server.metrics.registry

        def ended(kind: str, reason: str) -> float:
            labels = {"kind": kind, "reason": reason}
            return registry.get_sample_value("wsserver_embedding_requests_total", labels) or 0.0

        assert ended("embed", "complete") == 1.0
        assert ended("embed", "error") == 1.0
        assert ended("rerank", "complete") == 1.0
        assert registry.get_sample_value("wsserver_embedding_request_seconds_count") == 3.0


async def test_a_large_answer_has_room_for_two_segments_and_the_next_the_configured_buffer() -> (
    None
):
    """A whole answer larger than ``server.sndbuf``: on loopback (segments of
    32 KiB and more) a 16 KiB buffer sends one segment at a time, each after
    the client's delayed ACK — a 6 MB answer took 3 s (WholeAnswerBuffer,
    docs/benchmarks.md section 18). It goes out with room for two segments;
    the next answer on the connection, a stream, gets the configured size;
    and a large non-streamed completion (the exchange's whole answer) is
    widened as well."""
    with socket.socket() as scratch:  # what Linux makes of the configured size
        scratch.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        configured = scratch.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    inputs = [f"input number {i}" for i in range(2000)]
    async with (
        running_server(
            make_config(server__sndbuf=16384, backend__fake__tokens_per_s=1e6)
        ) as server,
        aiohttp.ClientSession() as session,
    ):
        url = f"http://127.0.0.1:{server.port}/v1"
        body = {"input": inputs, "encoding_format": "float"}
        async with session.post(url + "/embeddings", json=body) as response:
            answer = await response.json()
        assert response.status == 200 and len(answer["data"]) == len(inputs)
        assert answer["data"][1999]["embedding"] == vector(inputs[1999])
        (connection,) = server.api.live.values()
        sock = connection._transport.get_extra_info("socket")
        segment = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG)
        assert 2 * segment > 16384, "loopback's segments are larger than the buffer"
        assert connection.out.send_buffer.widened
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * segment
        stream = {"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}
        async with session.post(url + "/completions", json=stream) as response:
            events = [line async for line in response.content if line.startswith(b"data:")]
        assert events[-1].strip() == b"data: [DONE]"
        assert server.api.live == {connection.conn_id: connection}, "the same connection"
        assert not connection.out.send_buffer.widened
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == configured
        whole = {"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 20000}
        async with session.post(url + "/completions", json=whole) as response:
            text = await response.read()
        assert response.status == 200 and len(text) > 2 * 16384
        assert connection.out.send_buffer.widened
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * segment
