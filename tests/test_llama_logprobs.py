"""Log-probabilities from the real llama.cpp engine (tiny random GGUF).

They are the model's own distribution, before the sampler chain
(wsserver/logprobs.py), so they must match llama-cpp-python's
``create_completion(logprobs=…)`` on the same model; the engine computes them
only for the sequences that asked. Then the OpenAI API, streamed and not,
through the official SDK.
"""

from __future__ import annotations

import contextlib
import io
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

import openai  # noqa: E402
from conftest import running_server, timeout  # noqa: E402
from test_llama_backend import Running, loaded, request, run  # noqa: E402
from test_llama_sampling import llama_config  # noqa: E402

from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.core.logprobs import TokenLogprob  # noqa: E402
from wsserver.core.sampling import Sampling  # noqa: E402

pytestmark = pytest.mark.llama

PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def backend(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, parallel=2) as b:
        yield b


@pytest.fixture(scope="module")
def reference(tiny_gguf: Path) -> Iterator[Any]:
    """llama-cpp-python's own Llama, keeping every position's logits (its logprobs need them)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        # Flash attention as the engine's default ("auto": on, on a CPU).
        llm = llama_cpp.Llama(
            str(tiny_gguf), n_ctx=512, n_threads=1, logits_all=True, flash_attn=True, verbose=True
        )
    llm.verbose = False
    yield llm
    llm.close()


def entries_of(backend: LlamaBackend, **fields: Any) -> tuple[str, list[TokenLogprob]]:
    outcome, sink = run(backend, request(**fields))
    assert outcome is not None and outcome.reason in ("length", "stop"), outcome
    assert len(sink.logprobs) == outcome.completion_tokens
    return sink.text, sink.logprobs


def test_top_logprobs_have_the_asked_count_sorted_with_the_greedy_token_first(
    backend: LlamaBackend,
) -> None:
    for top in (0, 1, 5, 20):
        _, entries = entries_of(backend, max_tokens=16, logprobs=top)
        assert len(entries) == 16
        for entry in entries:
            assert len(entry.top) == top
            values = [t.logprob for t in entry.top]
            assert values == sorted(values, reverse=True)
            assert all(v <= 0.0 for v in [*values, entry.logprob])
            assert entry.token == entry.bytes.decode("utf-8", "replace")
            if top:
                # Temperature 0: the chosen token is the most likely one.
                assert entry.top[0].bytes == entry.bytes
                assert entry.top[0].logprob == pytest.approx(entry.logprob)


def test_they_match_llama_cpp_pythons_create_completion(
    backend: LlamaBackend, reference: Any
) -> None:
    for prompt in PROMPTS:
        reference.reset()
        expected = reference.create_completion(prompt, max_tokens=12, temperature=0, logprobs=5)
        theirs = expected["choices"][0]["logprobs"]
        text, entries = entries_of(backend, prompt=prompt, max_tokens=12, logprobs=5)
        assert text == expected["choices"][0]["text"]
        assert len(entries) == len(theirs["token_logprobs"]) == 12
        for entry, value, top in zip(
            entries, theirs["token_logprobs"], theirs["top_logprobs"], strict=True
        ):
            assert entry.logprob == pytest.approx(value, abs=1e-3)
            ours = [entry.logprob] + [t.logprob for t in entry.top]
            # Their alternatives are keyed by text (equal texts collide): each
            # of their values is one of ours, and the best agree.
            for other in top.values():
                assert min(abs(other - v) for v in ours) < 1e-3
            assert max(top.values()) == pytest.approx(entry.top[0].logprob, abs=1e-3)


def test_they_come_from_before_the_sampler_chain(backend: LlamaBackend) -> None:
    _, plain = entries_of(backend, max_tokens=4, logprobs=3)
    forced_token = 5 if plain[0].bytes != backend.vocab.piece(5) else 6
    bias = Sampling.from_options({"logit_bias": ((forced_token, 100.0),)})
    _, forced = entries_of(backend, max_tokens=4, logprobs=3, sampling=bias)
    # The bias chose the token; the numbers are still the model's own.
    assert all(e.bytes == backend.vocab.piece(forced_token) for e in forced)
    assert forced[0].logprob < forced[0].top[0].logprob
    same_distribution(forced[0], plain[0])
    # Sampled at temperature 1.5: the same distribution at the first position.
    _, sampled = entries_of(backend, max_tokens=1, logprobs=3, temperature=1.5, seed=4)
    same_distribution(sampled[0], plain[0])


def same_distribution(a: TokenLogprob, b: TokenLogprob) -> None:
    """The same alternatives (another sequence of the batch may differ in the last bits)."""
    assert [t.bytes for t in a.top] == [t.bytes for t in b.top]
    assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-4)


def test_only_the_sequences_that_ask_pay_for_them(backend: LlamaBackend) -> None:
    engine = backend.engine
    assert engine is not None
    reader = engine.logprobs
    original = reader.entry
    calls: list[int] = []
    lock = threading.Lock()

    def counting(logits: Any, token: int, top: int) -> TokenLogprob:
        with lock:
            calls.append(top)
        return original(logits, token, top)

    reader.entry = counting  # type: ignore[method-assign]
    try:
        asking = Running(backend, request(id="asks", max_tokens=24, logprobs=2))
        other = Running(backend, request(id="other", prompt="Hello", max_tokens=24))
        asked_outcome, asked_sink = asking.wait()
        other_outcome, other_sink = other.wait()
    finally:
        reader.entry = original  # type: ignore[method-assign]
    assert asked_outcome.completion_tokens == len(asked_sink.logprobs) == 24
    assert other_outcome.completion_tokens == 24 and other_sink.logprobs == []
    assert calls == [2] * 24


async def test_the_openai_api_streamed_and_not_agree(tiny_gguf: Path) -> None:
    async with running_server(llama_config(tiny_gguf)) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 16, "temperature": 0}
            messages = [{"role": "user", "content": "Say hello"}]
            whole = await client.chat.completions.create(
                messages=messages, logprobs=True, top_logprobs=3, **kwargs
            )
            content = whole.choices[0].logprobs.content
            assert len(content) == whole.usage.completion_tokens
            streamed: list[Any] = []
            async for chunk in await client.chat.completions.create(
                messages=messages, logprobs=True, top_logprobs=3, stream=True, **kwargs
            ):
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    streamed.extend(chunk.choices[0].logprobs.content or [])
            # The same tokens and numbers (the second request's prompt came
            # from the cache: the last bits may differ).
            assert len(streamed) == len(content)
            for a, b in zip(streamed, content, strict=True):
                assert (a.token, a.bytes) == (b.token, b.bytes)
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t.bytes for t in a.top_logprobs] == [t.bytes for t in b.top_logprobs]
            for c in content:
                assert len(c.top_logprobs) == 3 and c.logprob <= 0.0
                assert c.top_logprobs[0].logprob == pytest.approx(c.logprob)

            legacy = await client.completions.create(prompt="Hello", logprobs=2, **kwargs)
            whole_legacy = legacy.choices[0].logprobs
            assert whole_legacy is not None and whole_legacy.token_logprobs is not None
            values: list[float] = []
            async for chunk in await client.completions.create(
                prompt="Hello", logprobs=2, stream=True, **kwargs
            ):
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    values.extend(chunk.choices[0].logprobs.token_logprobs or [])
            assert values == pytest.approx(whole_legacy.token_logprobs, abs=1e-4)
            assert all(math.isfinite(v) and v <= 0.0 for v in values)
        finally:
            await client.close()
