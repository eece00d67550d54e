"""Ollama's bodies, options and answers, without a server (sans-I/O)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from wsserver.core.protocol import CallPart, Delta, Done, Limits, Message, Timings, ToolCall, Usage
from wsserver.dialects.api_errors import ApiError
from wsserver.dialects.exchange import Failure
from wsserver.dialects.ollama.api import error_body, parse_chat, parse_generate
from wsserver.dialects.ollama.options import check_num_ctx, parse_keep_alive
from wsserver.dialects.ollama.render import OllamaAnswer, durations, loaded_object

LIMITS = Limits(max_tokens=100, max_prompt_chars=500, max_messages=8)
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> Any:
    return parse_chat({"model": "m", "messages": USER, **fields}, "r1", LIMITS)


def refusal(parse: Any, **fields: Any) -> str:
    with pytest.raises(ApiError) as info:
        parse({"model": "m", **fields}, "r1", LIMITS)
    assert info.value.status == 400
    return info.value.message


def clock() -> str:
    return "2026-01-01T00:00:00Z"


def test_a_chat_becomes_one_generate_with_its_options_mapped() -> None:
    request = chat(
        options={
            "num_predict": 7,
            "temperature": 0.5,
            "top_k": 3,
            "top_p": 0.9,
            "min_p": 0.1,
            "typical_p": 0.8,
            "repeat_penalty": 1.2,
            "repeat_last_n": 32,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "seed": 11,
            "stop": ["##"],
            # Load options: how Ollama loads a model, decided here by the configuration.
            "num_gpu": 99,
            "num_thread": 4,
            "use_mmap": True,
            # Neutral values of stages the engines do not have.
            "mirostat": 0,
            "mirostat_tau": 5.0,
            "tfs_z": 1.0,
            "penalize_newline": False,
            "num_keep": 4,
        },
        keep_alive="5m",
        format="json",
        think=True,
    )
    g = request.generate
    assert request.stream is True and request.kind == "chat" and request.model == "m"
    assert g.messages == (Message("user", "hi"),)
    assert (g.max_tokens, g.temperature, g.top_k, g.top_p, g.seed) == (7, 0.5, 3, 0.9, 11)
    assert (g.min_p, g.typical_p, g.repeat_penalty, g.repeat_last_n) == (0.1, 0.8, 1.2, 32)
    assert (g.presence_penalty, g.frequency_penalty, g.stop) == (0.5, 0.25, ("##",))
    assert g.keep_alive == 300.0 and request.keep_alive == 300.0
    assert orjson.loads(g.json_schema or "") == {"type": "object"}
    assert g.reasoning_format == "auto" and g.reasoning_budget_tokens is None


def test_defaults_are_ollamas_stream_and_the_servers_limit() -> None:
    request = chat()
    assert request.stream is True
    # Ollama's default num_predict is no limit: the server's max_tokens.
    assert request.generate.max_tokens == LIMITS.max_tokens
    assert chat(options={"num_predict": -1}).generate.max_tokens == LIMITS.max_tokens
    assert chat(options={"num_predict": -2}).generate.max_tokens == LIMITS.max_tokens
    assert chat(options={"seed": -1}).generate.seed is None
    assert chat(stream=False).stream is False


def test_think_false_closes_a_think_block_at_once_and_levels_are_refused() -> None:
    off = chat(think=False).generate
    assert off.reasoning_budget_tokens == 0 and off.reasoning_format == "auto"
    assert chat().generate.reasoning_format is None
    assert "levels" in refusal(parse_chat, messages=USER, think="high")


def test_a_schema_format_is_the_cores_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert orjson.loads(chat(format=schema).generate.json_schema or "") == schema
    assert chat(format="").generate.json_schema is None
    assert "format" in refusal(parse_chat, messages=USER, format="yaml")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"options": {"mirostat": 2}}, "options.mirostat"),
        ({"options": {"tfs_z": 0.5}}, "options.tfs_z"),
        ({"options": {"penalize_newline": True}}, "options.penalize_newline"),
        ({"options": {"nonsense": 1}}, "options.nonsense: unknown option"),
        ({"options": {"temperature": "hot"}}, "'options.temperature' must be a number"),
        ({"options": {"num_predict": 0}}, "options.num_predict"),
        ({"options": {"num_predict": 101}}, "'options.num_predict' exceeds the limit of 100"),
        ({"options": {"num_ctx": 0}}, "options.num_ctx"),
        ({"options": []}, "options: must be an object"),
        ({"format": 5}, "format: must be"),
        ({"images": ["aGk="]}, "images"),
        ({"truncate": True}, "truncate"),
        ({"shift": True}, "shift"),
        ({"keep_alive": "5 minutes"}, "keep_alive"),
        ({"stream": "yes"}, "stream"),
        ({"nonsense": 1}, "nonsense: unknown field"),
        ({"model": ""}, "model is required"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            "image 0 (messages[0].images): not a PNG, JPEG, GIF or BMP image",
        ),
        ({"messages": [{"role": "user", "content": "x"}] * 9}, "more than 8 messages"),
        ({"tools": [{"type": "function", "function": {"name": "f x"}}]}, "tools[0]"),
    ],
)
def test_chat_refusals_name_the_field(fields: dict[str, Any], named: str) -> None:
    """Each a 400 naming the field (a prompt over the limit is 413, below)."""
    fields.setdefault("messages", USER)
    if fields.get("model") == "":
        with pytest.raises(ApiError, match=named):
            parse_chat({**fields}, "r1", LIMITS)
        return
    assert named in refusal(parse_chat, **fields)


def test_a_prompt_over_the_limit_is_413() -> None:
    with pytest.raises(ApiError, match="exceed 500 characters") as info:
        chat(messages=[{"role": "user", "content": "x" * 600}])
    assert info.value.status == 413


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"context": [1, 2, 3]}, "the deprecated 'context'"),
        ({"suffix": "}"}, "suffix"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"images": ["aGk="]}, "images"),
        ({"width": 512}, "image generation"),
        ({"raw": True, "system": "s"}, "system: not with raw"),
        ({"raw": True, "think": True}, "think: not with raw"),
        ({"raw": "yes"}, "raw"),
        ({"prompt": 5}, "prompt"),
    ],
)
def test_generate_refusals_name_the_field(fields: dict[str, Any], named: str) -> None:
    fields.setdefault("prompt", "hi")
    assert named in refusal(parse_generate, **fields)


def test_generate_is_a_chat_of_system_and_prompt_or_raw_text() -> None:
    templated = parse_generate({"model": "m", "prompt": "p", "system": "s"}, "r", LIMITS)
    assert templated.generate is not None
    assert templated.generate.messages == (Message("system", "s"), Message("user", "p"))
    raw = parse_generate({"model": "m", "prompt": "p", "raw": True}, "r", LIMITS)
    assert raw.generate is not None and raw.generate.prompt == "p"
    # Empty values clients send for "none" are accepted.
    ok = parse_generate({"model": "m", "prompt": "p", "context": [], "suffix": ""}, "r", LIMITS)
    assert ok.generate is not None


def test_nothing_to_answer_is_a_load_or_an_unload() -> None:
    load = parse_generate({"model": "m"}, "r", LIMITS)
    assert load.generate is None and load.keep_alive is None
    unload = parse_chat({"model": "m", "messages": [], "keep_alive": 0}, "r", LIMITS)
    assert unload.generate is None and unload.keep_alive == 0
    body = orjson.loads(loaded_object("chat", "m", "unload", clock))
    assert body == {
        "model": "m",
        "created_at": clock(),
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "unload",
    }


def test_tool_calls_and_results_become_the_cores_calls() -> None:
    request = chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "thinking": "call both",
                "tool_calls": [
                    {"function": {"name": "weather", "arguments": {"city": "Oslo"}}},
                    {"id": "abc", "function": {"name": "time", "arguments": {}}},
                ],
            },
            {"role": "tool", "content": "12:00", "tool_name": "time"},
            {"role": "tool", "content": "sunny"},
        ]
    )
    _, assistant, first, second = request.generate.messages
    assert assistant.reasoning == "call both"
    assert assistant.tool_calls == (
        ToolCall("call_1_0", "weather", '{"city":"Oslo"}'),
        ToolCall("abc", "time", "{}"),
    )
    # By name, then the next one not answered.
    assert (first.tool_call_id, first.name) == ("abc", "time")
    assert (second.tool_call_id, second.name) == ("call_1_0", None)


def test_keep_alive_takes_seconds_and_go_durations() -> None:
    cases = {"5m": 300.0, "1h30m": 5400.0, "1.5s": 1.5, "300ms": 0.3, "0": 0.0, "-1": -1.0}
    for given, seconds in cases.items():
        assert parse_keep_alive(given) == pytest.approx(seconds), given
    assert parse_keep_alive(10) == 10.0 and parse_keep_alive(-5) == -1.0
    assert parse_keep_alive("-1m") == -1.0 and parse_keep_alive(None) is None
    for bad in ("5 m", "m", "5x", True, [], ""):
        with pytest.raises(ApiError, match="keep_alive"):
            parse_keep_alive(bad)


def test_num_ctx_above_the_models_context_is_refused_and_below_bounds() -> None:
    assert check_num_ctx(None, "m", 512) is None
    assert check_num_ctx(256, "m", 512) == 256
    assert check_num_ctx(4096, "m", None) == 4096  # an engine that does not say
    with pytest.raises(ApiError, match=r"options\.num_ctx: 1024 is more than the context"):
        check_num_ctx(1024, "m", 512)


# ---------------------------------------------------------------- answers


def done(reason: str = "stop", **timings: Any) -> Done:
    times = {"queued_ms": 2.0, "ttft_ms": 5.0, "total_ms": 9.5, "tokens_per_s": 1.0, **timings}
    return Done("r1", reason, Usage(7, 3, cached_tokens=2), Timings(**times))  # type: ignore[arg-type]


def lines(data: bytes) -> list[dict[str, Any]]:
    assert data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


def test_the_durations_are_the_drivers_timings_in_nanoseconds() -> None:
    assert durations(done().timings, done().usage) == {
        "total_duration": 9_500_000,
        "load_duration": 2_000_000,
        "prompt_eval_count": 7,
        "prompt_eval_duration": 3_000_000,
        "eval_count": 3,
        "eval_duration": 4_500_000,
    }
    # No output at all: the prompt's time runs to the end.
    silent = done(ttft_ms=None).timings
    assert durations(silent, Usage())["prompt_eval_duration"] == 7_500_000
    assert durations(silent, Usage())["eval_duration"] == 0


def test_a_streamed_chat_is_one_object_per_delta_then_the_last() -> None:
    answer = OllamaAnswer("chat", "m:latest", stream=True, logprobs=False, clock=clock)
    assert answer.media_type == "application/x-ndjson" and answer.keepalive == b""
    first = lines(answer.chunk(Delta("r1", 0, "", reasoning="hmm")))
    second = lines(answer.chunk(Delta("r1", 1, "Hi")))
    end = lines(answer.last(done("length")))
    assert first == [
        {
            "model": "m:latest",
            "created_at": clock(),
            "message": {"role": "assistant", "content": "", "thinking": "hmm"},
            "done": False,
        }
    ]
    assert second[0]["message"] == {"role": "assistant", "content": "Hi"}
    assert end == [
        {
            "model": "m:latest",
            "created_at": clock(),
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "length",
            **durations(done().timings, done().usage),
        }
    ]


def test_a_call_goes_out_whole_once_it_is_complete() -> None:
    answer = OllamaAnswer("chat", "m", stream=True, logprobs=False, clock=clock)
    assert answer.chunk(Delta("r1", 0, "", tool_calls=(CallPart(0, '{"ci', "call_a", "f"),))) == b""
    both = lines(
        answer.chunk(
            Delta(
                "r1",
                1,
                "",
                tool_calls=(CallPart(0, 'ty": "Oslo"}'), CallPart(1, "{", "call_b", "g")),
            )
        )
    )
    assert both[0]["message"]["tool_calls"] == [
        {"id": "call_a", "function": {"index": 0, "name": "f", "arguments": {"city": "Oslo"}}}
    ]
    # The last call is complete when the answer ends; one cut short has {} arguments.
    end = lines(answer.last(done("length")))
    assert end[0]["message"]["tool_calls"] == [
        {"id": "call_b", "function": {"index": 1, "name": "g", "arguments": {}}}
    ]
    assert end[0]["done"] is False and end[1]["done_reason"] == "length"


def test_a_whole_answer_gathers_everything_and_calls_end_as_stop() -> None:
    answer = OllamaAnswer("chat", "m", stream=False, logprobs=False, clock=clock)
    answer.gather(Delta("r1", 0, "", reasoning="think"))
    answer.gather(Delta("r1", 1, "A", tool_calls=(CallPart(0, "{}", "call_a", "f"),)))
    body = orjson.loads(answer.body(done("tool_calls")))
    assert body["message"] == {
        "role": "assistant",
        "content": "A",
        "thinking": "think",
        "tool_calls": [{"id": "call_a", "function": {"index": 0, "name": "f", "arguments": {}}}],
    }
    assert body["done"] is True and body["done_reason"] == "stop"
    generated = OllamaAnswer("generate", "m", stream=False, logprobs=False, clock=clock)
    generated.gather(Delta("r1", 0, "text"))
    assert orjson.loads(generated.body(done()))["response"] == "text"


def test_errors_are_ollamas_object_in_the_stream_and_whole() -> None:
    answer = OllamaAnswer("generate", "m", stream=True, logprobs=False, clock=clock)
    failure = Failure(500, "internal", "boom")
    assert answer.error_event(failure) == b'{"error":"boom"}\n'
    assert answer.error_body(failure) == (500, b'{"error":"boom"}')
    assert error_body(ApiError(404, "model 'x' not found", "model_not_found")) == (  # type: ignore[arg-type]
        404,
        b'{"error":"model \'x\' not found"}',
    )
    assert "'format'" in answer.refusal_wording("'json_schema' is not supported")
