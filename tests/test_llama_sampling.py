"""The full sampler chain on the real llama.cpp engine (tiny random GGUF).

The engine is driven directly (test_llama_backend.py's helpers), then the
server over the WebSocket and the official ``openai`` SDK. The tiny model's
greedy output repeats itself, which is what the penalties are for.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

import openai  # noqa: E402
from conftest import make_config, running_server, timeout, wire  # noqa: E402
from test_llama_backend import loaded, request, run  # noqa: E402

from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.core.protocol import Generate  # noqa: E402
from wsserver.core.sampling import Sampling  # noqa: E402
from wsserver.errors import ProtocolError  # noqa: E402

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def backend(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, parallel=2) as b:
        yield b


class Tokens:
    """Records the sampled tokens of the one request running (wraps ``piece``)."""

    def __init__(self, backend: LlamaBackend) -> None:
        assert backend.engine is not None
        self.engine = backend.engine
        self.piece = self.engine._piece
        self.seen: list[int] = []
        self.lock = threading.Lock()

    def __enter__(self) -> Tokens:
        def recording(token: int) -> bytes:
            with self.lock:
                self.seen.append(token)
            return self.piece(token)

        self.engine._piece = recording
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine._piece = self.piece


def tokens_of(backend: LlamaBackend, **fields: Any) -> list[int]:
    with Tokens(backend) as recorded:
        outcome, _ = run(backend, request(**fields))
    assert outcome is not None and outcome.reason in ("length", "stop"), outcome
    return recorded.seen


def repeats(tokens: list[int]) -> int:
    """How many sampled tokens had been sampled before."""
    return len(tokens) - len(set(tokens))


def with_sampling(**options: Any) -> Sampling:
    return Sampling.from_options(options)


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_minus_100_removes_the_greedy_token_and_plus_100_forces_one(
    backend: LlamaBackend,
) -> None:
    greedy = tokens_of(backend, max_tokens=8)
    first = greedy[0]
    banned = tokens_of(backend, max_tokens=8, sampling=with_sampling(logit_bias=((first, -100.0),)))
    assert first not in banned
    forced_token = 5 if first != 5 else 6
    forced = tokens_of(
        backend, max_tokens=8, sampling=with_sampling(logit_bias=((forced_token, 100.0),))
    )
    assert forced == [forced_token] * 8
    # ``false`` on the wire: never.
    never = tokens_of(
        backend, max_tokens=8, sampling=with_sampling(logit_bias=((first, float("-inf")),))
    )
    assert first not in never


def test_logit_bias_by_text_biases_each_of_its_tokens(backend: LlamaBackend) -> None:
    text = "hello"
    ids = backend.vocab.tokenize_text(text)
    assert ids
    forced = tokens_of(backend, max_tokens=4, sampling=with_sampling(logit_bias=((text, 100.0),)))
    assert set(forced) <= set(ids)


@pytest.mark.parametrize("token", [10**9, -1])
def test_logit_bias_outside_the_vocabulary_is_a_bad_request(
    backend: LlamaBackend, token: int
) -> None:
    outcome, sink = run(backend, request(sampling=with_sampling(logit_bias=((token, 1.0),))))
    assert outcome.reason == "error" and outcome.error_code == "bad_request"
    assert "vocabulary" in outcome.error_message and str(token) in outcome.error_message
    assert sink.text == ""
    # The admission check names it too, before anything starts.
    with pytest.raises(ProtocolError, match=f"logit_bias: token {token} is not in"):
        backend.check(Generate(id="b", prompt="p", logit_bias=((token, 1.0),)))


# ---------------------------------------------------------------- penalties, DRY, XTC


def test_penalties_make_a_looping_greedy_output_repeat_itself_less(backend: LlamaBackend) -> None:
    plain = tokens_of(backend, max_tokens=96)
    assert repeats(plain) > 16, "the tiny model's greedy output should repeat itself"
    for options in (
        {"repeat_penalty": 1.5},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 1.5},
    ):
        penalised = tokens_of(backend, max_tokens=96, sampling=with_sampling(**options))
        assert repeats(penalised) < repeats(plain), options
    # A negative presence penalty goes the other way: fewer distinct tokens.
    loved = tokens_of(backend, max_tokens=96, sampling=with_sampling(presence_penalty=-2.0))
    assert len(set(loved)) <= len(set(plain))


def test_dry_breaks_a_loop_the_greedy_sampler_is_stuck_in(backend: LlamaBackend) -> None:
    # Two tokens biased far above the rest: greedy repeats the stronger one.
    bias = ((5, 50.0), (6, 50.0))
    looping = tokens_of(backend, max_tokens=16, sampling=with_sampling(logit_bias=bias))
    assert len(set(looping[:8])) == 1
    dry = tokens_of(
        backend, max_tokens=16, sampling=with_sampling(logit_bias=bias, dry_multiplier=5.0)
    )
    assert set(dry) == {5, 6}
    # A breaker cuts the sequences DRY matches: both tokens break, nothing repeats.
    pieces = [backend.vocab.piece(t).decode("utf-8", "replace") for t in (5, 6)]
    if all(pieces):
        broken = tokens_of(
            backend,
            max_tokens=16,
            sampling=with_sampling(
                logit_bias=bias, dry_multiplier=5.0, dry_sequence_breakers=tuple(pieces)
            ),
        )
        assert broken == looping


def test_a_penalty_window_of_0_turns_the_penalties_off(backend: LlamaBackend) -> None:
    plain = tokens_of(backend, max_tokens=24)
    off = tokens_of(
        backend, max_tokens=24, sampling=with_sampling(repeat_penalty=1.5, repeat_last_n=0)
    )
    assert off == plain


def test_seeded_runs_with_the_whole_chain_are_reproducible(backend: LlamaBackend) -> None:
    chain = with_sampling(
        min_p=0.02,
        typical_p=0.9,
        repeat_penalty=1.1,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        logit_bias=((7, 2.0),),
        dry_multiplier=0.8,
        xtc_probability=0.5,
        xtc_threshold=0.05,
    )
    fields: dict[str, Any] = {"temperature": 1.0, "max_tokens": 32, "sampling": chain}
    first = tokens_of(backend, seed=21, **fields)
    assert tokens_of(backend, seed=21, **fields) == first
    assert tokens_of(backend, seed=22, **fields) != first


def test_xtc_changes_a_seeded_sample(backend: LlamaBackend) -> None:
    fields: dict[str, Any] = {"temperature": 1.0, "max_tokens": 32, "seed": 5}
    plain = tokens_of(backend, **fields)
    xtc = tokens_of(
        backend, sampling=with_sampling(xtc_probability=1.0, xtc_threshold=0.0001), **fields
    )
    assert xtc != plain


def test_min_p_1_keeps_only_the_most_likely_token(backend: LlamaBackend) -> None:
    greedy = tokens_of(backend, max_tokens=16)
    sampled = tokens_of(
        backend, temperature=1.5, seed=3, max_tokens=16, sampling=with_sampling(min_p=1.0)
    )
    assert sampled == greedy


# ---------------------------------------------------------------- over the wires


def llama_config(path: Path) -> Any:
    return make_config(
        backend__kind="llama",
        backend__llama__model=str(path),
        backend__llama__n_threads=1,
        backend__llama__parallel=1,
    )


async def test_websocket_generate_takes_the_chain_and_refuses_bad_values(tiny_gguf: Path) -> None:
    async with running_server(llama_config(tiny_gguf)) as server, wire(server) as ws:
        base = {"type": "generate", "prompt": "Once upon a time", "max_tokens": 12}
        await ws.send({**base, "id": "plain", "temperature": 0})
        plain, _ = await ws.done("plain", units=30)
        await ws.send(
            {**base, "id": "pen", "temperature": 0, "repeat_penalty": 1.5, "logit_bias": {"5": 1}}
        )
        penalised, frames = await ws.done("pen", units=30)
        assert frames[-1]["reason"] == "length"
        assert penalised != plain
        await ws.send({**base, "id": "bad", "min_p": 2})
        error = await ws.until(lambda f: f["type"] == "error")
        assert error[-1]["code"] == "bad_request" and "min_p" in error[-1]["message"]
        # Checked against the vocabulary before the request starts.
        await ws.send({**base, "id": "oov", "logit_bias": [[10**8, False]]})
        error = await ws.until(lambda f: f["type"] == "error")
        assert error[-1]["id"] == "oov" and error[-1]["code"] == "bad_request"
        assert "vocabulary" in error[-1]["message"]
        assert not [f for f in ws.frames if f.get("id") == "oov" and f["type"] != "error"]


async def test_openai_sdk_sends_penalties_and_logit_bias(tiny_gguf: Path) -> None:
    async with running_server(llama_config(tiny_gguf)) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            kwargs: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 24}
            plain = await client.completions.create(temperature=0, **kwargs)
            penalised = await client.completions.create(
                temperature=0, presence_penalty=2.0, frequency_penalty=2.0, **kwargs
            )
            assert penalised.choices[0].text != plain.choices[0].text
            forced = await client.completions.create(
                temperature=0, logit_bias={"5": 100}, extra_body={"repeat_penalty": 1.0}, **kwargs
            )
            assert server.backend is not None
            piece = server.backend.vocab.piece(5).decode("utf-8", "ignore")  # type: ignore[attr-defined]
            assert forced.choices[0].text == piece * 24
            with pytest.raises(openai.BadRequestError) as caught:
                await client.completions.create(presence_penalty=3.0, **kwargs)
            assert "presence_penalty" in str(caught.value)
            # No token of any vocabulary: refused by name (it was a 200,
            # biasing the text "-1"; issue 34).
            for bias in ({"-1": 5}, {"100000": 5}):
                with pytest.raises(openai.BadRequestError) as caught:
                    await client.completions.create(logit_bias=bias, **kwargs)
                assert "logit_bias" in str(caught.value), caught.value
                assert next(iter(bias)) in str(caught.value), caught.value
        finally:
            await client.close()
