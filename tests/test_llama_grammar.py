"""Grammar-constrained output on the real llama.cpp engine (tiny random GGUF).

The tiny model's output is gibberish: whatever a grammar or a schema lets
through is the grammar's doing. The engine directly, then the server over
the WebSocket and the official ``openai`` SDK.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

import openai  # noqa: E402
from conftest import make_config, running_server, timeout, wire  # noqa: E402
from test_llama_backend import RecordingSink, Running, loaded, request, run  # noqa: E402

from wsserver.backends.base import CancelEvent  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.backends.llama_grammar import GrammarCache, utf8_needed  # noqa: E402
from wsserver.core.protocol import Generate  # noqa: E402
from wsserver.errors import BackendError, ProtocolError  # noqa: E402

pytestmark = pytest.mark.llama

WORD_GRAMMAR = 'root ::= "<" [a-z]{1,8} ">"'
WORD = re.compile(r"<[a-z]{1,8}>")
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
    },
    "required": ["n", "ok", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def backend(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, parallel=4) as b:
        yield b


def test_a_grammar_constrains_every_seeded_sample(backend: LlamaBackend) -> None:
    for seed in range(8):
        outcome, sink = run(
            backend, request(temperature=1.0, seed=seed, max_tokens=40, grammar=WORD_GRAMMAR)
        )
        assert outcome.reason == "stop", (seed, sink.text)
        assert WORD.fullmatch(sink.text), (seed, sink.text)


def test_a_json_schema_gives_valid_json_for_every_seed_streamed_in_a_batch(
    backend: LlamaBackend,
) -> None:
    schema = json.dumps(SCHEMA)
    for batch in range(3):  # four sequences at a time, as the scheduler grants them
        seeds = range(4 * batch, 4 * batch + 4)
        runs = [
            Running(
                backend,
                request(id=f"j{s}", temperature=1.0, seed=s, max_tokens=200, json_schema=schema),
            )
            for s in seeds
        ]
        for seed, running in zip(seeds, runs, strict=True):
            outcome, sink = running.wait(30)
            assert outcome.reason == "stop", (seed, sink.text, outcome)
            assert len(sink.pieces) > 1  # streamed token by token, as always
            jsonschema.validate(json.loads(sink.text), SCHEMA)


def test_a_constrained_stream_beside_unconstrained_ones_leaves_their_text_alone(
    backend: LlamaBackend,
) -> None:
    plain = [run(backend, request(p, id=f"p{i}"))[1].text for i, p in enumerate(("Hello", "x"))]
    together = [
        Running(backend, request("Hello", id="a")),
        Running(backend, request(temperature=1.0, seed=1, grammar=WORD_GRAMMAR, id="g")),
        Running(backend, request("x", id="b")),
    ]
    texts = [r.wait()[1].text for r in together]
    assert [texts[0], texts[2]] == plain
    assert WORD.fullmatch(texts[1])


def test_cancel_mid_constrained_stream_and_the_next_request_is_free(
    backend: LlamaBackend,
) -> None:
    unconstrained = run(backend, request(max_tokens=24))[1].text
    cancel = CancelEvent()
    sink = RecordingSink(lambda s: cancel.set() if s.tokens == 3 else None)
    schema = json.dumps({"type": "array", "items": {"type": "integer"}})
    outcome, _ = run(backend, request(max_tokens=200, json_schema=schema), sink, cancel)
    assert outcome is None and sink.tokens == 3  # cancelled: no end from the engine
    assert sink.text.startswith("[")
    assert run(backend, request(max_tokens=24))[1].text == unconstrained


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"grammar": "root ::= undefined-rule"}, "'grammar' could not be parsed"),
        ({"grammar": 'start ::= "a"'}, "'grammar' could not be parsed"),
        ({"json_schema": '{"type": "foo"}'}, "'json_schema' could not be compiled"),
        ({"json_schema": '{"$ref": "#/definitions/none"}'}, "'json_schema' could not be compiled"),
        ({"logit_bias": ((10**6, 1.0),)}, "not in the model's vocabulary"),
    ],
)
def test_check_refuses_what_cannot_compile_before_the_request_starts(
    backend: LlamaBackend, fields: dict[str, Any], says: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        backend.check(Generate(id="bad", prompt="p", **fields))
    assert caught.value.code == "bad_request" and caught.value.request_id == "bad"
    assert says in caught.value.message


def test_compiled_grammars_are_cached_by_text_and_bounded_by_bytes(
    backend: LlamaBackend,
) -> None:
    assert backend.engine is not None
    cache = GrammarCache(backend.engine._vocab, max_bytes=200)
    try:
        first = cache.compile(grammar=WORD_GRAMMAR, json_schema=None)
        assert cache.compile(grammar=WORD_GRAMMAR, json_schema=None) is first
        assert cache.compiled == 1
        for n in range(1, 12):
            cache.compile(grammar=f'root ::= "{"a" * n}"', json_schema=None)
        assert cache.bytes <= 200 and len(cache) < 12
        # A big schema alone may exceed the bound: it is kept, alone.
        cache.compile(grammar=None, json_schema=json.dumps(SCHEMA))
        assert len(cache) == 1
        assert cache.instance(grammar=None, json_schema=None) is None
    finally:
        cache.close()


# ---------------------------------------------------------------- over the wires


def llama_config(path: Path) -> Any:
    return make_config(
        backend__kind="llama",
        backend__llama__model=str(path),
        backend__llama__n_threads=1,
        backend__llama__parallel=2,
    )


async def test_websocket_grammar_and_schema_stream_and_a_bad_one_is_refused_before_start(
    tiny_gguf: Path,
) -> None:
    async with running_server(llama_config(tiny_gguf)) as server, wire(server) as ws:
        base = {"type": "generate", "prompt": "Once", "temperature": 1.0, "max_tokens": 200}
        await ws.send({**base, "id": "s", "seed": 4, "json_schema": SCHEMA})
        text, frames = await ws.done("s", units=30)
        assert frames[-1]["reason"] == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        await ws.send({**base, "id": "g", "seed": 4, "grammar": WORD_GRAMMAR})
        text, _ = await ws.done("g", units=30)
        assert WORD.fullmatch(text)
        await ws.send({**base, "id": "bad", "grammar": "root ::= ("})
        (error,) = await ws.until(lambda f: f["type"] == "error")
        assert error["id"] == "bad" and error["code"] == "bad_request"
        assert not [f for f in ws.frames if f.get("id") == "bad" and f["type"] != "error"]
        await ws.send({**base, "id": "both", "grammar": WORD_GRAMMAR, "json_schema": {}})
        (error,) = await ws.until(lambda f: f["type"] == "error")
        assert "at most one of 'grammar' and 'json_schema'" in error["message"]


async def test_openai_response_format_json_schema_and_json_object(tiny_gguf: Path) -> None:
    async with running_server(llama_config(tiny_gguf)) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            messages = [{"role": "user", "content": "Give me JSON"}]
            schema_format: Any = {
                "type": "json_schema",
                "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
            }
            for seed in range(3):
                reply = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=200,
                    temperature=1.0,
                    seed=seed,
                    response_format=schema_format,
                )
                content = reply.choices[0].message.content
                assert content is not None
                jsonschema.validate(json.loads(content), SCHEMA)
                stream = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=200,
                    temperature=1.0,
                    seed=seed,
                    response_format=schema_format,
                    stream=True,
                )
                streamed = [c.choices[0].delta.content or "" async for c in stream if c.choices]
                assert len([s for s in streamed if s]) >= 1
                assert "".join(streamed) == content  # streamed and not agree
            # Any object: its strings are unbounded, and the random model may
            # not close them within max_tokens (then "length", cut short).
            finished = 0
            for seed in range(4):
                reply = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=200,
                    temperature=1.0,
                    seed=seed,
                    response_format={"type": "json_object"},
                )
                content = reply.choices[0].message.content or ""
                assert content.startswith("{")
                if reply.choices[0].finish_reason == "stop":
                    finished += 1
                    assert isinstance(json.loads(content), dict)
            assert finished
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model="tiny",
                    messages=messages,  # type: ignore[arg-type]
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "bad", "schema": {"type": "foo"}},
                    },
                )
            assert caught.value.status_code == 400
            assert "json_schema" in caught.value.message
            # Nothing was started for it.
            assert server.metrics.registry.get_sample_value(
                "wsserver_requests_total", {"reason": "error"}
            ) in (None, 0)
        finally:
            await client.close()


def test_a_schema_the_grammar_would_not_enforce_is_refused_by_name() -> None:
    """llama-cpp-python's converter reads past ``minimum``/``maximum`` and other
    validation keywords: such a schema was answered with JSON that broke it
    (the benchmark's 4 of 16, an ``age`` below its minimum). Refused instead."""
    from wsserver.backends.llama_grammar import schema_to_gbnf, unenforced

    assert unenforced(SCHEMA) == []
    person = {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18},
            "tags": {"type": "array", "items": {"type": "string", "format": "email"}},
            "nick": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8},
        },
        "$defs": {"pair": {"type": "array", "uniqueItems": True}},
    }
    assert unenforced(person) == [
        "'minimum' at properties.age",
        "'format' 'email' at properties.tags.items",
        "'minLength'/'maxLength' beside 'pattern', 'format' or no string type at properties.nick",
        "'uniqueItems' at $defs.pair",
    ]
    with pytest.raises(BackendError) as raised:
        schema_to_gbnf(json.dumps(person))
    assert raised.value.code == "unsupported_option" and "'minimum' at properties.age" in str(
        raised.value
    )
    # What it does enforce passes: lengths on a plain string, formats it knows.
    fine = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}
    assert unenforced(fine) == [] and schema_to_gbnf(json.dumps(fine))


@pytest.mark.parametrize(
    ("text", "passes"),
    [
        ('"caf\\u00e9 \\n \\uFFFD"', True),
        ('"\\uD81e"', False),  # an unpaired surrogate: orjson refuses it (so did a tool call)
        ('"\\udfff"', False),
        ('"a\nb"', False),  # a raw control character
        ('"\U0001f600"', True),  # beyond the BMP, as itself
    ],
)
def test_a_schema_string_holds_only_what_strict_json_parsers_accept(
    backend: LlamaBackend, text: str, passes: bool
) -> None:
    """The grammar of a JSON string, fed byte by byte: what it lets through
    parses with orjson (as our tool-call and schema checks do)."""
    import orjson

    engine = backend.engine
    assert engine is not None
    grammar = engine.grammars.instance(grammar=None, json_schema='{"type": "string"}')
    candidates = engine.samplers._candidates
    try:
        accepted = True
        inside = 0
        for byte in text.encode():
            token = int(candidates.probe_tokens[byte])
            assert token >= 0, f"the tiny vocabulary has a token for byte {byte:#x}"
            if not candidates.accepts(grammar, token, inside=inside > 0):
                accepted = False
                break
            llama_cpp.llama_sampler_accept(grammar, token)
            inside = utf8_needed(inside, bytes([byte]))
    finally:
        llama_cpp.llama_sampler_free(grammar)
    assert accepted == passes, text
    if passes:
        orjson.loads(text)


async def test_an_unenforceable_schema_is_refused_before_start_on_both_wires(
    tiny_gguf: Path,
) -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer", "maximum": 99}}}
    async with running_server(llama_config(tiny_gguf)) as server:
        async with wire(server) as ws:
            await ws.send({"type": "generate", "id": "m", "prompt": "x", "json_schema": schema})
            (error,) = await ws.until(lambda f: f["type"] in ("error", "started"))
            assert error["type"] == "error" and error["code"] == "unsupported_option"
            assert "'maximum' at properties.age" in error["message"]
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            with pytest.raises(openai.BadRequestError) as raised:
                await client.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "JSON please"}],
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "p", "schema": schema},
                    },
                    stream=True,
                )
            assert raised.value.code == "unsupported_option"
        finally:
            await client.close()


def test_constrained_requests_wait_while_a_grammar_given_up_on_still_runs(
    backend: LlamaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar computation given up on past its deadline keeps a core busy
    until its native call returns: while one runs, a new constrained request
    (grammar, schema) is refused as overloaded, naming why; a plain one runs.
    Without the cap, repeating such a grammar could tie up every core."""
    engine = backend.engine
    assert engine is not None
    plain = Generate(id="plain", prompt="Once", max_tokens=4)
    asks = [
        Generate(id="g", prompt="Once", max_tokens=4, grammar=WORD_GRAMMAR),
        Generate(id="s", prompt="Once", max_tokens=4, json_schema=json.dumps(SCHEMA)),
    ]
    for frame in [plain, *asks]:
        backend.check(frame)  # none given up on: all pass
    monkeypatch.setattr(engine, "grammar_calls_running", lambda: 1)
    backend.check(plain)
    for frame in asks:
        with pytest.raises(ProtocolError) as refused:
            backend.check(frame)
        assert refused.value.code == "overloaded"
        assert "grammar_deadline_ms" in refused.value.message
