"""Ollama's API end to end: a real server, the official ``ollama`` Python client
(sync and async) as the client, streamed and not, on the fake engine."""

from __future__ import annotations

import asyncio
import json
import pathlib
import socket
from typing import Any

import aiohttp
import ollama
import pydantic
import pytest
from conftest import FAKE_MODEL, running_server, timeout, wire

from wsserver.aio import Server

USER = [{"role": "user", "content": "tell me"}]
CALL = (
    '<tool_call>\n{{"name": "add_two_numbers", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
)


def host(server: Server) -> str:
    return f"http://127.0.0.1:{server.port}"


def client(server: Server) -> ollama.Client:
    return ollama.Client(host=host(server), timeout=timeout(30))


def async_client(server: Server) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=host(server), timeout=timeout(30))


def requests_ended(server: Server, reason: str) -> float:
    value = server.metrics.registry.get_sample_value("wsserver_requests_total", {"reason": reason})
    return value or 0.0


def scripted(tmp_path: pathlib.Path, text: str) -> dict[str, Any]:
    path = tmp_path / "script.txt"
    path.write_text(text, encoding="utf-8")
    return {"backend__fake__tokens_per_s": 0.0, "backend__fake__text_file": str(path)}


async def ws_text(server: Server, **fields: Any) -> str:
    async with wire(server) as ws:
        await ws.send({"type": "generate", "id": "w", **fields})
        text, _ = await ws.done("w")
        return text


async def post(server: Server, path: str, body: Any) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session:
        async with session.post(host(server) + path, json=body) as response:
            return response.status, response.content_type, await response.read()


def add_two_numbers(a: int, b: int) -> int:
    """
    Add two numbers together.

    Args:
      a: The first number
      b: The second number

    Returns:
      int: The sum
    """
    return a + b


def check_durations(last: Any) -> None:
    """The last object's durations: measured, each part of the whole."""
    parts = last.load_duration + last.prompt_eval_duration + last.eval_duration
    # timing-ok: no speed is asserted — the durations exist (not invented zeros)
    # and the three parts add up to the whole, within nanosecond rounding.
    assert last.total_duration > 0 and last.eval_duration >= 0  # timing-ok: measured, not zeros
    assert abs(parts - last.total_duration) <= 3  # timing-ok: ns rounding


async def test_chat_sync_and_async_streamed_and_whole_give_the_websocket_text() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        expected = await ws_text(
            server, max_tokens=20, messages=[{"role": "system", "content": "be kind"}, *USER]
        )
        messages = [{"role": "system", "content": "be kind"}, *USER]
        options = {"num_predict": 20}

        def sync() -> tuple[Any, list[Any]]:
            with client(server) as c:
                whole = c.chat(model=FAKE_MODEL, messages=messages, options=options)
                parts = list(
                    c.chat(
                        model=FAKE_MODEL + ":latest",
                        messages=messages,
                        options=options,
                        stream=True,
                    )
                )
            return whole, parts

        whole, parts = await asyncio.to_thread(sync)
        assert whole.message.role == "assistant" and whole.message.content == expected
        assert whole.done is True and whole.done_reason == "length" and whole.model == FAKE_MODEL
        assert whole.eval_count == 20 and whole.prompt_eval_count > 0
        check_durations(whole)
        assert "".join(p.message.content for p in parts) == expected
        assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
        assert parts[-1].model == FAKE_MODEL + ":latest" and parts[-1].done_reason == "length"
        assert parts[-1].message.content == "" and parts[-1].eval_count == 20
        check_durations(parts[-1])

        async with async_client(server) as c:
            awhole = await c.chat(model=FAKE_MODEL, messages=messages, options=options)
            streamed = [
                p
                async for p in await c.chat(
                    model=FAKE_MODEL, messages=messages, options=options, stream=True
                )
            ]
        assert awhole.message.content == expected
        assert "".join(p.message.content for p in streamed) == expected


async def test_generate_templated_raw_and_system() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        templated = await ws_text(
            server,
            max_tokens=8,
            messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "p"}],
        )
        raw = await ws_text(server, max_tokens=8, prompt="p")
        async with async_client(server) as c:
            reply = await c.generate(
                model=FAKE_MODEL, prompt="p", system="s", options={"num_predict": 8}
            )
            assert reply.response == templated and reply.done_reason == "length"
            check_durations(reply)
            parts = [
                p
                async for p in await c.generate(
                    model=FAKE_MODEL, prompt="p", raw=True, options={"num_predict": 8}, stream=True
                )
            ]
            assert "".join(p.response for p in parts) == raw
            assert parts[-1].done is True and parts[-1].eval_count == 8


async def test_the_stream_is_ndjson_and_errors_are_ollamas_shape() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        body = {"model": FAKE_MODEL, "messages": USER, "options": {"num_predict": 3}}
        status, kind, raw = await post(server, "/api/chat", body)
        assert (status, kind) == (200, "application/x-ndjson")
        objects = [json.loads(line) for line in raw.decode().splitlines()]
        assert objects[-1]["done"] is True and objects[-1]["done_reason"] == "length"
        assert {"model", "created_at", "message", "done"} <= set(objects[0])
        status, kind, raw = await post(server, "/api/chat", {**body, "stream": False})
        assert (status, kind) == (200, "application/json") and json.loads(raw)["done"] is True

        cases: list[tuple[str, Any, int, str]] = [
            ("/api/chat", {**body, "model": "nope"}, 404, "model 'nope' not found"),
            ("/api/chat", {**body, "options": {"mirostat": 1}}, 400, "options.mirostat"),
            ("/api/chat", {**body, "options": {"num_predict": 0}}, 400, "num_predict"),
            ("/api/chat", {**body, "think": "high"}, 400, "think"),
            ("/api/chat", {**body, "format": {"type": "integr"}}, 400, "format"),
            ("/api/chat", {**body, "wat": 1}, 400, "wat: unknown field"),
            ("/api/generate", {"model": FAKE_MODEL, "prompt": "x", "context": [1]}, 400, "context"),
            ("/api/generate", {"model": FAKE_MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
            ("/api/generate", {"model": FAKE_MODEL, "prompt": "x", "images": ["!"]}, 400, "images"),
            ("/api/chat", [1, 2], 400, "JSON object"),
        ]
        for path, sent, want, named in cases:
            status, kind, raw = await post(server, path, sent)
            answer = json.loads(raw)
            assert status == want and kind == "application/json", (sent, raw)
            assert set(answer) == {"error"} and named in answer["error"], answer

        def official() -> None:
            with client(server) as c:
                with pytest.raises(ollama.ResponseError) as info:
                    c.chat(model="nope:latest", messages=USER)
                assert info.value.status_code == 404 and "not found" in info.value.error
                with pytest.raises(ollama.ResponseError) as info:
                    c.chat(model=FAKE_MODEL, messages=USER, options={"tfs_z": 0.5})
                assert info.value.status_code == 400 and "options.tfs_z" in info.value.error

        await asyncio.to_thread(official)
        # Nothing else was harmed: the server still answers.
        status, _, _ = await post(server, "/api/chat", body)
        assert status == 200


async def test_an_alias_with_a_tag_names_the_model() -> None:
    async with running_server(
        backend__fake__tokens_per_s=0.0, backend__fake__aliases=["gemma3:270m"]
    ) as server:
        async with async_client(server) as c:
            reply = await c.chat(model="gemma3:270m", messages=USER, options={"num_predict": 2})
        assert reply.model == "gemma3:270m" and reply.eval_count == 2


async def test_tools_with_a_python_function_and_thinking(tmp_path: pathlib.Path) -> None:
    script = "<think>Add them.</think>" + CALL.format(a=2, b=3)
    async with running_server(**scripted(tmp_path, script)) as server:
        messages: list[Any] = [{"role": "user", "content": "2 + 3?"}]
        async with async_client(server) as c:
            reply = await c.chat(
                model=FAKE_MODEL, messages=messages, tools=[add_two_numbers], think=True
            )
            streamed = [
                p
                async for p in await c.chat(
                    model=FAKE_MODEL,
                    messages=messages,
                    tools=[add_two_numbers],
                    think=True,
                    stream=True,
                )
            ]
        assert reply.message.thinking == "Add them." and reply.message.content == ""
        (call,) = reply.message.tool_calls or []
        assert call.function.name == "add_two_numbers"
        assert call.function.arguments == {"a": 2, "b": 3}
        assert add_two_numbers(**call.function.arguments) == 5
        assert reply.done_reason == "stop"
        # Streamed: the thinking as it comes, the call whole in one object.
        assert "".join(p.message.thinking or "" for p in streamed) == "Add them."
        calls = [c for p in streamed for c in p.message.tool_calls or []]
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            ("add_two_numbers", {"a": 2, "b": 3})
        ]
        assert streamed[-1].done_reason == "stop"
        # The loop goes on with the result, as Ollama's examples do.
        messages += [
            reply.message,
            {"role": "tool", "content": "5", "tool_name": call.function.name},
        ]
        async with async_client(server) as c:
            follow = await c.chat(model=FAKE_MODEL, messages=messages, tools=[add_two_numbers])
        assert follow.done is True


async def test_think_false_closes_the_think_block_at_once(tmp_path: pathlib.Path) -> None:
    async with running_server(
        **scripted(tmp_path, "<think>long thoughts</think>Answer.")
    ) as server:
        async with async_client(server) as c:
            thinking = await c.chat(model=FAKE_MODEL, messages=USER, think=True)
            quiet = await c.chat(model=FAKE_MODEL, messages=USER, think=False)
    assert thinking.message.thinking == "long thoughts"
    assert thinking.message.content == "Answer."
    assert not quiet.message.thinking and quiet.message.content == "Answer."


class Pet(pydantic.BaseModel):
    name: str
    kind: str
    legs: int


async def test_format_with_a_pydantic_model_and_json() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        async with async_client(server) as c:
            reply = await c.chat(
                model=FAKE_MODEL, messages=USER, format=Pet.model_json_schema(), options={"seed": 3}
            )
            pet = Pet.model_validate_json(reply.message.content or "")
            assert isinstance(pet.legs, int)
            anything = await c.generate(model=FAKE_MODEL, prompt="x", format="json")
        assert isinstance(json.loads(anything.response or ""), dict)


async def test_an_empty_request_loads_and_keep_alive_zero_unloads() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        models = server.models
        async with async_client(server) as c:
            unloaded = await c.generate(model=FAKE_MODEL, keep_alive=0)
            assert unloaded.done_reason == "unload" and unloaded.response == ""
            await asyncio.wait_for(models.wait_state(FAKE_MODEL, "unloaded"), timeout(10))
            loaded = await c.chat(model=FAKE_MODEL, messages=[])
            assert loaded.done_reason == "load" and loaded.message.content == ""
            assert models.models[FAKE_MODEL].state == "loaded"


async def test_num_ctx_is_checked_against_the_models_context(tiny_gguf: pathlib.Path) -> None:
    pytest.importorskip("llama_cpp")
    async with running_server(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__n_ctx=256,
        backend__llama__n_threads=1,
        backend__llama__parallel=1,
    ) as server:
        async with async_client(server) as c:
            with pytest.raises(ollama.ResponseError) as info:
                await c.chat(model="tiny", messages=USER, options={"num_ctx": 8192})
            assert info.value.status_code == 400
            assert "options.num_ctx: 8192 is more than the context of 'tiny', 256" in str(
                info.value
            )
            # Below it, it bounds the output.
            reply = await c.chat(
                model="tiny", messages=USER, options={"num_ctx": 200, "num_predict": 500}
            )
        assert reply.eval_count is not None and reply.eval_count <= 200


async def test_a_disconnect_mid_prompt_frees_the_model() -> None:
    # One slot, and a prompt whose prefill would take hours: only a cancel frees it.
    long_chat = [{"role": "user", "content": "x" * 4000}]
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        backend__fake__parallel=1,
        backend__fake__prefill_ms_per_token=10_000.0,
    ) as server:
        body = {"model": FAKE_MODEL, "messages": long_chat, "options": {"num_predict": 10}}
        async with aiohttp.ClientSession() as session:
            async with session.post(host(server) + "/api/chat", json=body) as response:
                # The head comes when the engine is the request's: now the client goes.
                assert response.status == 200
        backend: Any = server.backend
        backend.prefill_ms_per_token = 0.0  # the next request's own prompt is instant
        async with async_client(server) as c:
            reply = await asyncio.wait_for(
                c.chat(model=FAKE_MODEL, messages=USER, options={"num_predict": 3}), timeout(30)
            )
        assert reply.done_reason == "length"
        assert requests_ended(server, "cancelled") == 1
        assert server.producer_threads() == 0


async def test_breaking_out_of_the_clients_stream_cancels_the_request() -> None:
    async with running_server(
        backend__fake__tokens_per_s=50.0, backend__fake__parallel=1
    ) as server:

        def read_one_then_leave() -> str:
            with client(server) as c:
                stream = c.chat(
                    model=FAKE_MODEL, messages=USER, stream=True, options={"num_predict": 100_000}
                )
                first = next(iter(stream))
                stream.close()  # leaves the response: the connection closes
                return first.message.content or ""

        assert await asyncio.to_thread(read_one_then_leave)
        async with async_client(server) as c:
            reply = await asyncio.wait_for(
                c.chat(model=FAKE_MODEL, messages=USER, options={"num_predict": 2}), timeout(30)
            )
        assert reply.eval_count == 2
        assert requests_ended(server, "cancelled") == 1


async def test_a_client_that_never_reads_holds_bounded_memory_and_its_close_is_a_cancel() -> None:
    """The channel (queue_tokens pieces) + the write buffer (write_limit) + one
    merged object, under 64 KiB; the engine waits on the full channel."""
    max_tokens = 60000
    async with running_server(
        backend__fake__tokens_per_s=0.0,
        backend__fake__parallel=1,
        stream__queue_tokens=64,
        server__sndbuf=16384,
        server__write_limit=16384,
        stream__stall_timeout_s=60.0,
    ) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        body = json.dumps(
            {"model": FAKE_MODEL, "messages": USER, "options": {"num_predict": max_tokens}}
        ).encode()
        writer.write(
            b"POST /api/chat HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout(20))
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"application/x-ndjson" in head
        (connection,) = server.api.live.values()
        ((generation,),) = [c.generations.values() for c in server.api.live.values()]
        await asyncio.wait_for(connection.out.writing_paused.wait(), timeout(20))
        assert await asyncio.to_thread(generation.channel.blocked.wait, timeout(20))
        held = connection.buffered_bytes()
        assert held < 64 * 1024, f"{held} bytes held for one slow client"
        assert generation.channel.tokens < max_tokens
        writer.close()  # gone without reading: the request is cancelled, the engine freed
        assert generation.task is not None
        await asyncio.wait_for(generation.task, timeout(10))
        assert requests_ended(server, "cancelled") == 1


async def test_logprobs_come_with_their_tokens_streamed_and_whole() -> None:
    async with running_server(backend__fake__tokens_per_s=0.0) as server:
        async with async_client(server) as c:
            asked: dict[str, Any] = {
                "model": FAKE_MODEL,
                "messages": USER,
                "options": {"num_predict": 6},
                "logprobs": True,
                "top_logprobs": 2,
            }
            whole = await c.chat(**asked)
            parts = [p async for p in await c.chat(**asked, stream=True)]
            plain = await c.chat(model=FAKE_MODEL, messages=USER, options={"num_predict": 6})
        tokens = whole.logprobs or []
        assert len(tokens) == 6 and all(len(t.top_logprobs or []) == 2 for t in tokens)
        # Each token's text (a token that ends inside a character shows U+FFFD).
        text = "".join(t.token for t in tokens).rstrip("\ufffd")
        assert text and (whole.message.content or "").startswith(text)
        streamed = [t for p in parts for t in p.logprobs or []]
        assert [t.token for t in streamed] == [t.token for t in tokens]
        assert all(t.logprob == 0.0 for t in streamed)  # the fake had no choice
        assert plain.logprobs is None


async def test_through_the_relay_the_upstreams_models_are_listed_and_answer() -> None:
    from fake_upstream import PIECES, FakeUpstream
    from test_openai_backend import relay

    async with FakeUpstream() as up, relay(up.url) as server, async_client(server) as c:
        listed = [m.model for m in (await c.list()).models]
        assert listed == [up.model + ":latest"]
        reply = await c.chat(model=up.model + ":latest", messages=USER, options={"num_predict": 50})
        assert reply.message.content == "".join(PIECES) and reply.model == up.model + ":latest"
        sent = up.streams[0].body
        assert sent["model"] == up.model and sent["max_tokens"] == 50
        shown = await c.show(up.model)
        assert shown.details is not None and shown.details.format == ""
