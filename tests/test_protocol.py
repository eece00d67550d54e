"""Wire protocol v1, sans-I/O: every bad-input class, and every frame against the schema."""

from __future__ import annotations

import json

import orjson
import pytest
from conftest import CLIENT_FRAME, SERVER_FRAME

from wsserver.core import protocol
from wsserver.core.protocol import (
    Cancel,
    Delta,
    Done,
    Error,
    Generate,
    Hello,
    Limits,
    Message,
    Queued,
    Restart,
    Resumed,
    Started,
    Timings,
    Usage,
    parse_client_frame,
    parse_server_frame,
    serialize,
)
from wsserver.errors import WIRE_CODES, ProtocolError

LIMITS = Limits(max_frame_bytes=4096, max_prompt_chars=100, max_messages=3, max_tokens=50)


def parse(obj: object) -> object:
    return parse_client_frame(json.dumps(obj), LIMITS)


def refused(data: str | bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_client_frame(data, LIMITS)
    assert info.value.code in WIRE_CODES
    return info.value


# ---------------------------------------------------------------- valid frames


def test_generate_with_prompt_and_every_option() -> None:
    frame = parse(
        {
            "type": "generate",
            "id": "a-1.b:c_D",
            "prompt": "hi",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "seed": 42,
            "stop": "\n",
        }
    )
    assert frame == Generate(
        id="a-1.b:c_D",
        prompt="hi",
        max_tokens=5,
        temperature=0.0,
        top_p=0.5,
        top_k=3,
        seed=42,
        stop=("\n",),
    )


def test_generate_with_messages_and_stop_list() -> None:
    frame = parse(
        {
            "type": "generate",
            "id": "m",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
            "stop": ["a", "b"],
        }
    )
    assert isinstance(frame, Generate)
    assert frame.messages == (Message("system", "s"), Message("user", "u"))
    assert frame.prompt is None and frame.stop == ("a", "b")


def test_cancel_and_restart() -> None:
    assert parse({"type": "cancel", "id": "x"}) == Cancel(id="x")
    restart = parse({"type": "restart", "id": "x", "new_id": "y", "temperature": 1.5})
    assert restart == Restart(id="x", new_id="y", overrides={"temperature": 1.5})


def test_restart_apply_overrides_and_input_switch() -> None:
    old = Generate(id="o", prompt="p", max_tokens=9, seed=1)
    assert Restart("o", "n", {"max_tokens": 3}).apply(old) == Generate(
        id="n", prompt="p", max_tokens=3, seed=1
    )
    messages = (Message("user", "m"),)
    switched = Restart("o", "n", {"messages": messages}).apply(old)
    assert switched.prompt is None and switched.messages == messages
    back = Restart("n", "z", {"prompt": "q"}).apply(switched)
    assert back.prompt == "q" and back.messages is None


def test_id_length_bounds() -> None:
    assert parse({"type": "cancel", "id": "x" * 64}) == Cancel(id="x" * 64)
    assert refused(json.dumps({"type": "cancel", "id": "x" * 65})).code == "bad_request"
    assert refused(json.dumps({"type": "cancel", "id": ""})).code == "bad_request"


# ---------------------------------------------------------------- bad input, by class


@pytest.mark.parametrize(
    ("data", "code"),
    [
        # Not JSON, or not an object.
        ("", "bad_json"),
        ("{", "bad_json"),
        ("nan", "bad_json"),
        ("[]", "bad_json"),
        ("null", "bad_json"),
        ("42", "bad_json"),
        ('"generate"', "bad_json"),
        ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 1e999}', "bad_json"),
        ("[" * 2000 + "]" * 2000, "bad_json"),
        # Type missing, wrong or unknown.
        ("{}", "bad_request"),
        ('{"type": 5, "id": "a"}', "bad_request"),
        ('{"type": "GENERATE", "id": "a"}', "unknown_type"),
        ('{"type": "hello"}', "unknown_type"),
        # Fields missing, wrong-typed, out of range, or unknown.
        ('{"type": "generate", "id": "a"}', "bad_request"),
        (
            '{"type": "generate", "id": "a", "prompt": "x", "messages": [{"role":"user","content":"y"}]}',
            "bad_request",
        ),
        ('{"type": "generate", "id": 7, "prompt": "x"}', "bad_request"),
        ('{"type": "generate", "id": "a b", "prompt": "x"}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": null}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": true}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 1.5}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 0}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 51}', "bad_request"),
        (
            '{"type": "generate", "id": "a", "prompt": "x", "max_tokens": 99999999999999999999999}',
            "bad_request",
        ),
        ('{"type": "generate", "id": "a", "prompt": "x", "temperature": "hot"}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "temperature": -0.1}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "top_p": 1.5}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "top_k": -1}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "seed": -1}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "seed": 4294967296}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "stop": ""}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "stop": [1]}', "bad_request"),
        (
            '{"type": "generate", "id": "a", "prompt": "x", "stop": ["a","b","c","d","e"]}',
            "bad_request",
        ),
        ('{"type": "generate", "id": "a", "prompt": "x", "stop": {"a": 1}}', "bad_request"),
        ('{"type": "generate", "id": "a", "prompt": "x", "bogus": 1}', "bad_request"),
        ('{"type": "generate", "id": "a", "messages": []}', "bad_request"),
        ('{"type": "generate", "id": "a", "messages": "hi"}', "bad_request"),
        (
            '{"type": "generate", "id": "a", "messages": [{"role": "robot", "content": "x"}]}',
            "bad_request",
        ),
        (
            '{"type": "generate", "id": "a", "messages": [{"role": "user", "content": 1}]}',
            "bad_request",
        ),
        ('{"type": "generate", "id": "a", "messages": [{"role": "user"}]}', "bad_request"),
        (
            '{"type": "generate", "id": "a", "messages": [{"role": "user", "content": "x", "extra": "n"}]}',
            "bad_request",
        ),
        ('{"type": "generate", "id": "a", "messages": [1]}', "bad_request"),
        ('{"type": "cancel"}', "bad_request"),
        ('{"type": "cancel", "id": "a", "extra": true}', "bad_request"),
        ('{"type": "restart", "id": "a"}', "bad_request"),
        (
            '{"type": "restart", "id": "a", "new_id": "b", "prompt": "x", "messages": [{"role":"user","content":"y"}]}',
            "bad_request",
        ),
        # Too large.
        ('{"type": "generate", "id": "a", "prompt": "' + "x" * 101 + '"}', "too_large"),
        ("x" * 5000, "too_large"),
    ],
)
def test_bad_input_is_refused_with_its_code(data: str, code: str) -> None:
    assert refused(data).code == code


def test_binary_frames_are_refused() -> None:
    assert refused(b'{"type": "cancel", "id": "a"}').code == "bad_json"


def test_too_many_messages_and_message_chars() -> None:
    many = [{"role": "user", "content": "x"}] * 4
    assert (
        refused(json.dumps({"type": "generate", "id": "a", "messages": many})).code == "bad_request"
    )
    big = [{"role": "user", "content": "x" * 60}, {"role": "user", "content": "y" * 60}]
    assert refused(json.dumps({"type": "generate", "id": "a", "messages": big})).code == "too_large"


def test_errors_carry_the_request_id_when_it_is_readable() -> None:
    assert refused('{"type": "generate", "id": "mine", "prompt": 1}').request_id == "mine"
    assert (
        refused('{"type": "restart", "id": "old", "new_id": "new", "top_k": -1}').request_id
        == "new"
    )
    assert refused('{"type": "nope", "id": "x1"}').request_id == "x1"
    assert refused('{"type": "generate", "id": "bad id", "prompt": "x"}').request_id is None


def test_error_messages_are_short_and_never_echo_huge_input() -> None:
    error = refused(json.dumps({"type": "t" * 10000, "id": "a"}))
    assert len(error.message) < 200


def test_protocol_error_rejects_unknown_codes() -> None:
    with pytest.raises(ValueError):
        ProtocolError("nope", "x")


# ---------------------------------------------------------------- server frames


SAMPLES = [
    Hello(model="fake", server="wsserver/0.1.0", limits=Limits()),
    Hello(
        model="fake", server="wsserver/0.1.0", limits=Limits(), honours=("json_schema", "logprobs")
    ),
    Queued(id="a", position=1),
    Started(id="a"),
    Delta(id="a", seq=0, text="héllo 😀"),
    Done(id="a", reason="length", usage=Usage(3, 4), timings=Timings(0.1, 2.5, 10.0, 400.0)),
    Done(id="a", reason="cancelled", usage=Usage(3, 0), timings=Timings(0.1, None, 1.0, 0.0)),
    Done(
        id="a",
        reason="error",
        usage=Usage(3, 1),
        timings=Timings(0.1, 1.0, 5.0, 1.0),
        error_code="stalled",
        error_message="client did not read",
    ),
    Error(id=None, code="bad_json", message="invalid JSON"),
    Error(id="a", code="busy", message="busy"),
]


@pytest.mark.parametrize("frame", SAMPLES, ids=lambda f: type(f).__name__)
def test_server_frames_match_the_schema_and_round_trip(frame: object) -> None:
    data = serialize(frame)  # type: ignore[arg-type]
    obj = orjson.loads(data)
    SERVER_FRAME.validate(obj)
    assert parse_server_frame(data) == frame


#: One of each server frame kind (and each optional part), with the exact bytes
#: the serializer wrote before it was derived from one description per frame.
#: Key order is visible on the wire and in the docs' examples: it must not move.
WIRE_BYTES = [
    (
        Hello(model="fake", server="wsserver/0.1.0", limits=Limits()),
        '{"type":"hello","protocol":1,"server":"wsserver/0.1.0","model":"fake","limits":{"max_frame_bytes":1048576,"max_prompt_chars":100000,"max_messages":256,"max_tokens":4096,"default_max_tokens":256,"max_upload_bytes":0}}',
    ),
    (
        Hello(
            model="m", server="wsserver/0.1.0", limits=Limits(), honours=("json_schema", "min_p")
        ),
        '{"type":"hello","protocol":1,"server":"wsserver/0.1.0","model":"m","limits":{"max_frame_bytes":1048576,"max_prompt_chars":100000,"max_messages":256,"max_tokens":4096,"default_max_tokens":256,"max_upload_bytes":0},"honours":["json_schema","min_p"]}',
    ),
    (
        Queued(id="a", position=2),
        '{"type":"queued","id":"a","position":2}',
    ),
    (
        Started(id="a"),
        '{"type":"started","id":"a"}',
    ),
    (
        Started(id="a", resume_token="tok"),
        '{"type":"started","id":"a","resume_token":"tok"}',
    ),
    (
        Resumed(id="a", after_seq=-1),
        '{"type":"resumed","id":"a","after_seq":-1}',
    ),
    (
        Delta(id="a", seq=7, text='héllo "😀"\n'),
        '{"type":"delta","id":"a","seq":7,"text":"héllo \\"😀\\"\\n"}',
    ),
    (
        Done(
            id="a", reason="stop", usage=Usage(3, 4), timings=Timings(0.12345, 2.5004, 10.0, 400.0)
        ),
        '{"type":"done","id":"a","reason":"stop","usage":{"prompt_tokens":3,"completion_tokens":4,"cached_tokens":0},"timings":{"queued_ms":0.123,"ttft_ms":2.5,"total_ms":10.0,"tokens_per_s":400.0}}',
    ),
    (
        Done(id="a", reason="cancelled", usage=Usage(3, 0), timings=Timings(0.1, None, 1.0, 0.0)),
        '{"type":"done","id":"a","reason":"cancelled","usage":{"prompt_tokens":3,"completion_tokens":0,"cached_tokens":0},"timings":{"queued_ms":0.1,"ttft_ms":null,"total_ms":1.0,"tokens_per_s":0.0}}',
    ),
    (
        Done(
            id="a",
            reason="error",
            usage=Usage(3, 1),
            timings=Timings(0.1, 1.0, 5.0, 1.0),
            error_code="stalled",
            error_message="client did not read",
        ),
        '{"type":"done","id":"a","reason":"error","usage":{"prompt_tokens":3,"completion_tokens":1,"cached_tokens":0},"timings":{"queued_ms":0.1,"ttft_ms":1.0,"total_ms":5.0,"tokens_per_s":1.0},"error":{"code":"stalled","message":"client did not read"}}',
    ),
    (
        Done(
            id="a",
            reason="error",
            usage=Usage(),
            timings=Timings(0, 0, 0, 0),
            error_code="internal",
        ),
        '{"type":"done","id":"a","reason":"error","usage":{"prompt_tokens":0,"completion_tokens":0,"cached_tokens":0},"timings":{"queued_ms":0,"ttft_ms":0,"total_ms":0,"tokens_per_s":0},"error":{"code":"internal","message":""}}',
    ),
    (
        Done(
            id="a",
            reason="length",
            usage=Usage(1, 2),
            timings=Timings(1.0, 2.0, 3.0, 4.0),
            upstream_timings={"prompt_ms": 1.5, "predicted_per_second": 30.25},
        ),
        '{"type":"done","id":"a","reason":"length","usage":{"prompt_tokens":1,"completion_tokens":2,"cached_tokens":0},"timings":{"queued_ms":1.0,"ttft_ms":2.0,"total_ms":3.0,"tokens_per_s":4.0},"upstream_timings":{"prompt_ms":1.5,"predicted_per_second":30.25}}',
    ),
    (
        Error(id=None, code="bad_json", message="invalid JSON"),
        '{"type":"error","id":null,"code":"bad_json","message":"invalid JSON"}',
    ),
    (
        Error(id="a", code="busy", message="busy"),
        '{"type":"error","id":"a","code":"busy","message":"busy"}',
    ),
]


@pytest.mark.parametrize(
    ("frame", "wire"), WIRE_BYTES, ids=[type(f).__name__ for f, _ in WIRE_BYTES]
)
def test_serialize_writes_the_exact_bytes_of_v1(frame: object, wire: str) -> None:
    assert serialize(frame) == wire.encode()  # type: ignore[arg-type]


def test_the_delta_fast_path_writes_what_the_description_says() -> None:
    # serialize() writes a delta by hand (the hot path); the description decides.
    frame = Delta(id="a", seq=3, text="x")
    assert serialize(frame) == orjson.dumps(protocol._to_wire(frame))


def test_serialize_refuses_non_frames() -> None:
    with pytest.raises(TypeError):
        serialize(object())  # type: ignore[arg-type]


def test_parse_server_frame_refuses_unknown_types() -> None:
    with pytest.raises(ValueError):
        parse_server_frame(b'{"type": "mystery"}')


def test_client_frames_the_parser_accepts_match_the_schema() -> None:
    for obj in (
        {"type": "generate", "id": "a", "prompt": "x", "stop": ["s"], "seed": 1},
        {"type": "generate", "id": "a", "messages": [{"role": "user", "content": "x"}]},
        {"type": "cancel", "id": "a"},
        {"type": "restart", "id": "a", "new_id": "b", "max_tokens": 3},
    ):
        parse(obj)
        CLIENT_FRAME.validate(obj)


def test_hello_lists_every_limit() -> None:
    wire = Limits().to_wire()
    assert set(wire) == {
        "max_frame_bytes",
        "max_prompt_chars",
        "max_messages",
        "max_tokens",
        "default_max_tokens",
        "max_upload_bytes",
    }


def test_clients_ignore_limits_they_do_not_know() -> None:
    data = b'{"type":"hello","protocol":1,"server":"wsserver/9","model":"m","limits":{"max_tokens":5,"future_limit":1}}'
    hello = parse_server_frame(data)
    assert isinstance(hello, Hello) and hello.limits.max_tokens == 5
