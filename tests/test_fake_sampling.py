"""What the fake engine honours of the sampler chain and structured output:
a seeded ``logit_bias`` over its vocabulary and a JSON-shaped mode for
``json_schema``/``response_format``; the rest stays ``unsupported_option``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from conftest import FAKE_MODEL, running_server, wire
from test_openai_http import sdk

from wsserver.backends.fake import fake_vocabulary, word_weights
from wsserver.errors import BackendError

WORDS = fake_vocabulary()
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1},
        "pet": {"anyOf": [{"type": "null"}, {"type": "string"}]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def words_of(text: str) -> list[str]:
    return text.split()


async def test_a_seeded_logit_bias_forces_bans_and_reproduces() -> None:
    base = {"type": "generate", "prompt": "p", "max_tokens": 30, "seed": 7}
    async with running_server(backend__fake__tokens_per_s=0) as server, wire(server) as ws:
        await ws.send({**base, "id": "plain"})
        plain, _ = await ws.done("plain")
        await ws.send({**base, "id": "forced", "logit_bias": {"1": 100}})
        forced, _ = await ws.done("forced")
        assert set(words_of(forced)) == {WORDS[1]}
        banned_word = words_of(plain)[0]
        await ws.send({**base, "id": "ban", "logit_bias": {banned_word: False}})
        banned, _ = await ws.done("ban")
        assert banned_word not in words_of(banned)
        await ws.send({**base, "id": "ban2", "logit_bias": {banned_word: False}})
        again, _ = await ws.done("ban2")
        assert again == banned  # seeded: reproducible
        await ws.send({**base, "id": "ban3", "seed": 8, "logit_bias": {banned_word: False}})
        other, _ = await ws.done("ban3")
        assert other != banned
        await ws.send({**base, "id": "oov", "logit_bias": {"99": 1}})
        (error,) = [f for f in await ws.until(lambda f: f["type"] == "error")]
        assert error["code"] == "bad_request" and "vocabulary" in error["message"]
        await ws.send({**base, "id": "pen", "repeat_penalty": 1.5})
        (error,) = [f for f in await ws.until(lambda f: f["type"] == "error")]
        assert error["code"] == "unsupported_option" and "repeat_penalty" in error["message"]


@pytest.mark.parametrize("token", [-1, len(WORDS)])
def test_a_token_id_outside_the_fakes_vocabulary_is_refused(token: int) -> None:
    # -1 biased the last word (a negative index; issue 34).
    with pytest.raises(BackendError, match=f"token {token} is not in the fake"):
        word_weights(((token, 1.0),))


async def test_a_bias_is_refused_where_the_fake_streams_a_fixed_text() -> None:
    async with running_server(backend__fake__echo=True) as server, wire(server) as ws:
        await ws.send({"type": "generate", "id": "a", "prompt": "p", "logit_bias": {"1": 5}})
        (error,) = [f for f in await ws.until(lambda f: f["type"] == "error")]
    assert error["code"] == "unsupported_option" and "logit_bias" in error["message"]


async def test_json_schema_gives_a_valid_document_for_every_seed() -> None:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    async with running_server(backend__fake__tokens_per_s=0) as server, wire(server) as ws:
        texts = set()
        for seed in range(20):
            request_id = f"s{seed}"
            await ws.send(
                {
                    "type": "generate",
                    "id": request_id,
                    "prompt": "p",
                    "seed": seed,
                    "temperature": 1,
                    "json_schema": SCHEMA,
                }
            )
            text, frames = await ws.done(request_id)
            assert frames[-1]["reason"] == "stop"
            validator.validate(json.loads(text))
            texts.add(text)
        assert len(texts) > 10  # seeded, not constant
        await ws.send(
            {
                "type": "generate",
                "id": "x",
                "prompt": "p",
                "json_schema": {"type": "string", "pattern": "a+"},
            }
        )
        (error,) = [f for f in await ws.until(lambda f: f["type"] == "error")]
        assert error["code"] == "unsupported_option" and "pattern" in error["message"]
        await ws.send({"type": "generate", "id": "g", "prompt": "p", "grammar": 'root ::= "a"'})
        (error,) = [f for f in await ws.until(lambda f: f["type"] == "error")]
        assert error["code"] == "unsupported_option" and "grammar" in error["message"]


async def test_openai_response_format_streamed_and_not() -> None:
    validator = jsonschema.Draft202012Validator(SCHEMA)
    messages = [{"role": "user", "content": "a person"}]
    schema_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    async with running_server(backend__fake__tokens_per_s=0) as server, sdk(server) as client:
        for seed in range(5):
            whole = await client.chat.completions.create(
                model=FAKE_MODEL, messages=messages, seed=seed, response_format=schema_format
            )
            validator.validate(json.loads(whole.choices[0].message.content or ""))
            text = ""
            async for chunk in await client.chat.completions.create(
                model=FAKE_MODEL,
                messages=messages,
                seed=seed,
                response_format=schema_format,
                stream=True,
            ):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            assert text == whole.choices[0].message.content
        obj = await client.chat.completions.create(
            model=FAKE_MODEL, messages=messages, response_format={"type": "json_object"}
        )
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=FAKE_MODEL,
                messages=messages,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/x"}},
                },
            )
        assert caught.value.code == "unsupported_option" and "$ref" in str(caught.value)
