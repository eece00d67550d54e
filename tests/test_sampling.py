"""The sampler chain's options on the wire (wsserver/sampling.py), and what engines refuse."""

from __future__ import annotations

import json
import math
from typing import Any

import openai
import pytest
from conftest import CLIENT_FRAME, FAKE_MODEL, running_server, timeout, wire

from wsserver.backends.base import GenerationRequest
from wsserver.core.protocol import Generate, Limits, Restart, parse_client_frame
from wsserver.core.sampling import DEFAULT_DRY_BREAKERS, Sampling, options_asked
from wsserver.dialects.openai.api import ApiError, parse_request
from wsserver.errors import ProtocolError

LIMITS = Limits()

EVERY_OPTION: dict[str, Any] = {
    "min_p": 0.1,
    "typical_p": 0.9,
    "repeat_penalty": 1.3,
    "repeat_last_n": -1,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {"15": 2.5, "Hello": False},
    "dry_multiplier": 0.8,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_penalty_last_n": 512,
    "dry_sequence_breakers": ["\n", ":"],
    "xtc_probability": 0.5,
    "xtc_threshold": 0.1,
}


def generate(**fields: Any) -> Generate:
    frame = {"type": "generate", "id": "r1", "prompt": "p", **fields}
    parsed = parse_client_frame(json.dumps(frame), LIMITS)
    assert isinstance(parsed, Generate)
    return parsed


def refused(**fields: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        generate(**fields)
    assert caught.value.code == "bad_request" and caught.value.request_id == "r1"
    return caught.value


def test_every_option_parses_into_the_request_and_validates_against_the_schema() -> None:
    frame = {"type": "generate", "id": "r1", "prompt": "p", **EVERY_OPTION}
    CLIENT_FRAME.validate(frame)
    request = GenerationRequest.from_frame(generate(**EVERY_OPTION), default_max_tokens=8)
    sampling = request.sampling
    assert sampling.min_p == 0.1 and sampling.repeat_last_n == -1
    assert sampling.logit_bias == ((15, 2.5), ("Hello", -math.inf))
    assert sampling.dry_sequence_breakers == ("\n", ":")
    assert sampling.penalties and sampling.dry and sampling.xtc


def test_defaults_are_llama_servers() -> None:
    request = GenerationRequest.from_frame(generate(), default_max_tokens=8)
    assert request.sampling == Sampling()
    assert (request.temperature, request.top_p, request.top_k) == (0.8, 0.95, 40)
    defaults = Sampling()
    assert (defaults.min_p, defaults.typical_p, defaults.repeat_last_n) == (0.05, 1.0, 64)
    assert (defaults.dry_base, defaults.dry_allowed_length, defaults.dry_penalty_last_n) == (
        1.75,
        2,
        -1,
    )
    assert defaults.dry_sequence_breakers == DEFAULT_DRY_BREAKERS == ("\n", ":", '"', "*")
    assert (defaults.xtc_probability, defaults.xtc_threshold) == (0.0, 0.1)
    assert not (defaults.penalties or defaults.dry or defaults.xtc)


def test_logit_bias_takes_pairs_too() -> None:
    frame = generate(logit_bias=[[15, -100], ["text", 3]])
    assert frame.logit_bias == ((15, -100.0), ("text", 3.0))


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"min_p": 1.5}, "'min_p' must be between 0 and 1"),
        ({"typical_p": "x"}, "'typical_p' must be a number"),
        ({"repeat_penalty": 0}, "'repeat_penalty' must be > 0"),
        ({"repeat_penalty": 11}, "'repeat_penalty' must be between 0 and 10"),
        ({"repeat_last_n": -2}, "'repeat_last_n' must be an integer from -1"),
        ({"presence_penalty": 2.5}, "'presence_penalty' must be between -2 and 2"),
        ({"frequency_penalty": True}, "'frequency_penalty' must be a number"),
        ({"dry_base": 0.5}, "'dry_base' must be between 1 and 100"),
        ({"dry_allowed_length": 1.5}, "'dry_allowed_length' must be an integer"),
        ({"dry_sequence_breakers": "\n"}, "'dry_sequence_breakers' must be a list"),
        ({"dry_sequence_breakers": [""]}, "each DRY sequence breaker"),
        ({"xtc_probability": -0.1}, "'xtc_probability' must be between 0 and 1"),
        ({"logit_bias": 3}, "'logit_bias' must be an object"),
        ({"logit_bias": {"15": 101}}, "between -100 and 100"),
        ({"logit_bias": {"": 1}}, "a 'logit_bias' key must be a token id or a non-empty text"),
        ({"logit_bias": [[1, 2, 3]]}, "holds [token or text, bias] pairs"),
        ({"logit_bias": [[-1, 2]]}, "token id must be an integer >= 0, not -1"),
        # A key that is a signed number is a token id (as llama-server reads
        # it), not text: -1 was biased as the text "-1" (issue 34).
        ({"logit_bias": {"-1": 2}}, "token id must be an integer >= 0, not -1"),
        ({"logit_bias": [["-7", 2]]}, "token id must be an integer >= 0, not -7"),
        ({"logit_bias": {"4294967296": 2}}, "token id must be an integer >= 0"),
        ({"logit_bias": {"9" * 5000: 2}}, "token id must be an integer >= 0"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "more than 1024 entries"),
    ],
)
def test_bad_values_are_refused_naming_the_field(fields: dict[str, Any], says: str) -> None:
    assert says in refused(**fields).message


def test_unknown_fields_are_still_refused() -> None:
    assert "unknown field" in refused(mirostat=2).message


def test_restart_overrides_options_and_keeps_the_rest() -> None:
    old = generate(min_p=0.2, repeat_penalty=1.2)
    restart = parse_client_frame(
        json.dumps({"type": "restart", "id": "r1", "new_id": "r2", "repeat_penalty": 1.5}), LIMITS
    )
    assert isinstance(restart, Restart)
    new = restart.apply(old)
    assert (new.min_p, new.repeat_penalty) == (0.2, 1.5)


def test_options_asked_lists_the_stages_given_a_non_neutral_value() -> None:
    assert options_asked(generate()) == set()
    neutral = generate(repeat_penalty=1.0, presence_penalty=0, logit_bias={}, min_p=0)
    assert options_asked(neutral) == set()
    assert options_asked(generate(repeat_last_n=10, dry_base=2)) == set()  # parameters only
    asked = options_asked(generate(**EVERY_OPTION))
    assert asked == {
        "min_p",
        "typical_p",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "dry_multiplier",
        "xtc_probability",
    }


# ---------------------------------------------------------------- the OpenAI API


def test_openai_bodies_map_the_penalties_logit_bias_and_llama_server_extensions() -> None:
    body = {
        "model": FAKE_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "logit_bias": {"50256": -100},
        "min_p": 0.1,
        "repeat_penalty": 1.1,
        "dry_multiplier": 0.8,
        "xtc_probability": 0.5,
    }
    request = parse_request("chat", json.dumps(body).encode(), "x", LIMITS)
    frame = request.generate
    assert (frame.presence_penalty, frame.frequency_penalty) == (0.5, 0.25)
    assert frame.logit_bias == ((50256, -100.0),)
    assert (frame.min_p, frame.repeat_penalty) == (0.1, 1.1)
    assert (frame.dry_multiplier, frame.xtc_probability) == (0.8, 0.5)


def test_openai_refuses_a_bad_penalty_with_a_400() -> None:
    body = {"model": FAKE_MODEL, "prompt": "p", "frequency_penalty": 9}
    with pytest.raises(ApiError) as caught:
        parse_request("completion", json.dumps(body).encode(), "x", LIMITS)
    assert caught.value.status == 400 and "frequency_penalty" in caught.value.message


# ---------------------------------------------------------------- never silently ignored


async def test_the_fake_engine_refuses_what_it_cannot_honour_naming_the_field() -> None:
    # (It honours logit_bias, json_schema and logprobs: test_fake_sampling.py.)
    async with running_server() as server:
        async with wire(server) as ws:
            base = {"type": "generate", "prompt": "p", "max_tokens": 3}
            for field, value in (
                ("presence_penalty", 0.5),
                ("min_p", 0.2),
                ("dry_multiplier", 0.5),
                ("grammar", 'root ::= "a"'),
            ):
                await ws.send({**base, "id": field, field: value})
                (error,) = await ws.until(lambda f: f["type"] == "error")
                assert error["id"] == field and error["code"] == "unsupported_option"
                assert f"'{field}'" in error["message"]
            # Neutral values and a stage's parameters alone ask for nothing.
            await ws.send({**base, "id": "ok", "presence_penalty": 0, "repeat_last_n": 8})
            _, frames = await ws.done("ok")
            assert frames[-1]["reason"] == "length"
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(10),
        )
        try:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(
                    model="fake",
                    messages=[{"role": "user", "content": "hi"}],
                    extra_body={"grammar": 'root ::= "a"'},
                )
            assert caught.value.status_code == 400
            assert "'grammar'" in caught.value.message
            body = caught.value.body
            assert isinstance(body, dict) and body.get("code") == "unsupported_option"
        finally:
            await client.close()
