"""llama-server's ``timings`` and an early usage, through the openai backend.

llama-server ends its stream with a chunk that carries a ``timings`` object
(its own prompt and decode figures); wsserver passes the known keys on as
``done.upstream_timings``. An upstream that says the prompt's token count
before its end (a usage chunk first) has it in the ``done`` of a request that
is cancelled midway. Against the real fault-injecting upstream, every frame
checked against the JSON Schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import wire
from fake_upstream import PIECES, FakeUpstream
from test_openai_backend import gen, relay

from wsserver.backends.openai_wire import UPSTREAM_TIMINGS, parse_chunk
from wsserver.core.protocol import Done, parse_server_frame

ROOT = Path(__file__).resolve().parents[1]

#: What llama-server sends (tools/server/server-common.cpp, server_slot_stats::to_json),
#: plus what wsserver must drop: an unknown key, a bool, a negative number, a string.
LLAMA_SERVER_TIMINGS: dict[str, Any] = {
    "cache_n": 3,
    "prompt_n": 4,
    "prompt_ms": 12.5,
    "prompt_per_token_ms": 3.125,
    "prompt_per_second": 320.0,
    "predicted_n": len(PIECES),
    "predicted_ms": 101.25,
    "predicted_per_token_ms": 9.2,
    "predicted_per_second": 108.6,
    "n_something_new": 1,
    "draft_n": True,
    "draft_n_accepted": -1,
    "cache_hit": "yes",
}
KEPT = {
    "cache_n": 3,
    "prompt_n": 4,
    "prompt_ms": 12.5,
    "prompt_per_token_ms": 3.125,
    "prompt_per_second": 320.0,
    "predicted_n": len(PIECES),
    "predicted_ms": 101.25,
    "predicted_per_token_ms": 9.2,
    "predicted_per_second": 108.6,
}


def test_the_known_timings_of_a_chunk_are_kept() -> None:
    chunk = parse_chunk(json.dumps({"choices": [], "timings": LLAMA_SERVER_TIMINGS}))
    assert chunk.timings == KEPT
    assert parse_chunk(json.dumps({"choices": [], "timings": "soon"})).timings is None
    assert parse_chunk(json.dumps({"choices": [], "timings": {"x": 1}})).timings is None
    assert parse_chunk(json.dumps({"choices": []})).timings is None


def test_the_schema_lists_exactly_the_keys_passed_on() -> None:
    schema = json.loads((ROOT / "docs" / "protocol.schema.json").read_text())
    done = schema["$defs"]["Done"]["properties"]["upstream_timings"]
    assert set(done["properties"]) == set(UPSTREAM_TIMINGS)
    assert done["additionalProperties"] is False


async def test_llama_servers_timings_reach_the_done_frame() -> None:
    async with FakeUpstream() as up, relay(up.url) as server:
        up.timings = LLAMA_SERVER_TIMINGS
        async with wire(server) as client:
            await client.send(gen("a", max_tokens=50))
            _, frames = await client.done("a")
            up.timings = None
            await client.send(gen("b", max_tokens=50))
            _, plain = await client.done("b")
    done = frames[-1]
    assert done["reason"] == "stop"
    assert done["upstream_timings"] == KEPT
    # wsserver's own timings are still there, and a client library reads both.
    assert set(done["timings"]) == {"queued_ms", "ttft_ms", "total_ms", "tokens_per_s"}
    parsed = parse_server_frame(json.dumps(done))
    assert isinstance(parsed, Done) and parsed.upstream_timings == KEPT
    # An upstream that sends none: no field at all.
    assert "upstream_timings" not in plain[-1]


async def test_chat_timings_in_the_usage_chunk_are_taken_too() -> None:
    async with FakeUpstream() as up, relay(up.url) as server:
        up.timings = {"prompt_n": 9, "predicted_n": 2}
        async with wire(server) as client:
            await client.send(
                {"type": "generate", "id": "c", "messages": [{"role": "user", "content": "hi"}]}
            )
            _, frames = await client.done("c")
    assert frames[-1]["upstream_timings"] == {"prompt_n": 9, "predicted_n": 2}


async def test_a_cancelled_request_reports_the_prompt_tokens_the_upstream_gave() -> None:
    async with FakeUpstream() as up, relay(up.url) as server:
        up.mode = "endless"
        up.token_delay = 0.01
        async with wire(server) as client:
            # Without an early usage the count is unknown at the cancel: 0.
            await client.send(gen("plain", max_tokens=100_000))
            await client.until(lambda f: f["type"] == "delta")
            await client.send({"type": "cancel", "id": "plain"})
            _, frames = await client.done("plain")
            assert frames[-1]["reason"] == "cancelled"
            assert frames[-1]["usage"]["prompt_tokens"] == 0
            # A usage chunk before the first text: the cancelled done has it.
            up.usage_first = True
            await client.send(gen("early", max_tokens=100_000))
            await client.until(lambda f: f["type"] == "delta" and f["id"] == "early")
            await client.send({"type": "cancel", "id": "early"})
            _, frames = await client.done("early")
    done = frames[-1]
    assert done["reason"] == "cancelled"
    assert done["usage"]["prompt_tokens"] == 7
    assert done["usage"]["completion_tokens"] >= 1
    assert "upstream_timings" not in done
