"""Grammars and schemas that crashed or jammed the engine (issue 34, faults 0
and 5), on the real llama engine (the tiny GGUF) in a server *process*: until
they were bounded, the first crashed it (SIGSEGV) and the others jammed it,
which must cost this test run nothing but a failed test.

Each request goes through ``/v1/chat/completions`` as an application sends it
(``response_format``, or llama-server's ``grammar`` extension).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest

pytest.importorskip("llama_cpp")

from conftest import timeout
from grammars import DEEP_SCHEMA, JAM, PYDANTIC_LIKE
from test_shutdown import ServerProcess, server_process

pytestmark = pytest.mark.llama


@contextlib.asynccontextmanager
async def tiny_process(tiny_gguf: Path, *settings: str) -> AsyncIterator[ServerProcess]:
    async with server_process(
        f"backend.llama.model={tiny_gguf}",
        "backend.llama.n_threads=1",
        "backend.llama.parallel=2",
        *settings,
        backend="llama",
    ) as server:
        yield server


async def chat(server: ServerProcess, **body: Any) -> tuple[int, dict[str, Any]]:
    """One non-streamed chat completion: its status and JSON body."""
    payload = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 16, **body}
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(timeout(30))) as r:
            return r.status, await r.json()


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def serves(server: ServerProcess) -> None:
    """The process is alive and answers a plain request."""
    status, body = await chat(server)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"]
    assert server.proc.returncode is None


async def test_schemas_that_crashed_the_process_are_refused_and_it_serves_on(
    tiny_gguf: Path,
) -> None:
    async with tiny_process(tiny_gguf) as server:
        # 100,000 and 20,000 overflowed the native parser's stack (SIGSEGV);
        # 1,100 llama.cpp refused after recursing that deep.
        for count in (100_000, 20_000, 1100):
            schema = {**DEEP_SCHEMA, "maxItems": count}
            status, body = await chat(server, response_format=json_format(schema))
            assert status == 400, body
            message = body["error"]["message"]
            assert f"maxItems {count}" in message and "at most 1000" in message, message
            await serves(server)
        # The same as a raw grammar: groups nested 20,000 deep.
        deep = "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000
        status, body = await chat(server, grammar=deep)
        assert status == 400 and "1000 deep" in body["error"]["message"], body
        await serves(server)


async def test_a_malformed_repetition_is_refused_at_once(tiny_gguf: Path) -> None:
    async with tiny_process(tiny_gguf) as server:
        # llama.cpp generated rules for it without end (the request hung).
        status, body = await chat(server, grammar='root ::= "a"{5,2}')
        assert status == 400, body
        assert body["error"]["message"] == (
            "'grammar' has the repetition {5,2}, whose minimum is above its maximum"
        )
        await serves(server)


async def test_the_nested_repetition_that_jammed_the_engine_is_refused(tiny_gguf: Path) -> None:
    async with tiny_process(tiny_gguf) as server:
        status, body = await chat(server, grammar=JAM)
        assert status == 400, body
        assert "multiply to more than 256" in body["error"]["message"], body
        # Three levels of {1,10}: seconds a token once started.
        status, body = await chat(server, grammar='root ::= ((("a"{1,10}){1,10}){1,10})')
        assert status == 400 and "multiply" in body["error"]["message"], body
        await serves(server)


async def test_grammars_and_schemas_within_the_bounds_work(tiny_gguf: Path) -> None:
    async with tiny_process(tiny_gguf) as server:
        # Two nested counts multiplying to 256, the most served.
        status, body = await chat(server, grammar='root ::= ("<" [a-z]{0,15} ">"){1,15}')
        assert status == 200, body
        assert body["choices"][0]["message"]["content"].startswith("<")
        # 1,000 items: the largest maxItems served.
        schema = {**DEEP_SCHEMA, "maxItems": 1000}
        status, body = await chat(server, response_format=json_format(schema), max_tokens=64)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"].startswith("[")
        # A pydantic-like model (bounded strings and lists, nested and
        # recursive objects, enums): its answer validates.
        for seed in range(3):
            status, body = await chat(
                server,
                response_format=json_format(PYDANTIC_LIKE),
                temperature=1.0,
                seed=seed,
                max_tokens=800,
            )
            assert status == 200, body
            choice = body["choices"][0]
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), PYDANTIC_LIKE)


#: Within every static bound, but each "a" doubles llama.cpp's parse stacks
#: (two alternatives that differ only in what they close with).
AMBIGUOUS = 'root ::= ("a" root "b" | "a" root "c" | "")'


async def test_an_ambiguous_grammar_ends_at_its_deadline_and_the_others_go_on(
    tiny_gguf: Path,
) -> None:
    async with tiny_process(tiny_gguf, "backend.llama.grammar_deadline_ms=200") as server:
        # The byte token of "a" (tests/tiny_gguf.py: <unk>, <s>, </s>, then
        # the 256 byte tokens), pushed to the top: every token doubles the
        # stacks until one step's grammar work passes the deadline.
        a_token = 3 + ord("a")
        plain = asyncio.create_task(chat(server, max_tokens=400))
        status, body = await chat(
            server, grammar=AMBIGUOUS, logit_bias={str(a_token): 100}, max_tokens=200
        )
        assert status == 400, body
        message = body["error"]["message"]
        assert "more than 200 ms of work for one token" in message, message
        assert "grammar_deadline_ms" in message
        status, body = await plain
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        await serves(server)
        await server.wait_line(r"its grammar's work for one token exceeded 200 ms")


async def test_a_cancel_frees_the_engine_from_a_grammar_at_once(tiny_gguf: Path) -> None:
    """The ambiguous grammar with a deadline far away: the client leaves
    while its grammar work grows, and the engine serves the next request at
    once instead of waiting for that work (which runs on, on its own thread)."""
    from websockets.asyncio.client import connect

    async with tiny_process(tiny_gguf, "backend.llama.grammar_deadline_ms=600000") as server:
        async with connect(server.url) as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
            frame = {
                "type": "generate",
                "id": "g",
                "prompt": "x",
                "grammar": AMBIGUOUS,
                "logit_bias": {str(3 + ord("a")): 100},
                "max_tokens": 200,
            }
            await ws.send(json.dumps(frame))
            text = ""
            while len(text) < 12:  # each "a" doubles the work of the next token
                message = json.loads(await ws.recv())
                assert message["type"] in ("started", "delta", "queued"), message
                text += message.get("text", "")
            await ws.send(json.dumps({"type": "cancel", "id": "g"}))
            while (message := json.loads(await ws.recv()))["type"] != "done":
                pass
            assert message["reason"] == "cancelled"
        # Both sequences free: two plain requests at once, each to its end.
        results = await asyncio.gather(chat(server, max_tokens=64), chat(server, max_tokens=64))
        assert [status for status, _ in results] == [200, 200], results
        await serves(server)
