"""The batched llama engine: many sequences in one context (tiny model, real llama.cpp).

The engine is driven directly (tests/test_llama_backend.py's RecordingSink
stands in for the channel: it can refuse offers like a full one), then the
server end to end. What batching does to numerics — and so what "the same
text" can mean — is in docs/llama.md; these tests check what holds.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from conftest import slow_wire, timeout, wire  # noqa: E402
from test_llama_backend import (  # noqa: E402
    LONG_CTX,
    LONG_PROMPT,
    PROMPTS,
    SLOW_READER,
    RecordingSink,
    Running,
    assert_cut_short,
    llama_server,
    loaded,
    prompt_tokens,
    reader_buffer,
    request,
    run,
)

from wsserver.aio.peer import PeerAwareConnection  # noqa: E402
from wsserver.backends.base import CancelEvent  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402

pytestmark = pytest.mark.llama


@pytest.fixture(scope="module")
def batched(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, parallel=4, n_ctx=LONG_CTX) as b:
        yield b


@pytest.fixture(scope="module")
def alone(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    """The same model with one sequence: every request decoded by itself."""
    with loaded(tiny_gguf, parallel=1, n_ctx=LONG_CTX) as b:
        yield b


def texts_alone(backend: LlamaBackend, reqs: list[Any]) -> list[str]:
    return [run(backend, r)[1].text for r in reqs]


def together(backend: LlamaBackend, reqs: list[Any], **kw: Any) -> list[Running]:
    running = [Running(backend, r, **kw) for r in reqs]
    for r in running:
        r.wait()
    return running


# ---------------------------------------------------------------- streams in one batch


def test_concurrent_streams_complete_with_usage_and_the_text_they_get_alone(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    reqs = [request(p, id=f"c{i}", max_tokens=24 + 8 * i) for i, p in enumerate(PROMPTS[:4])]
    expected = texts_alone(alone, reqs)
    steps = batched.stats()["steps"]
    running = together(batched, reqs)
    for r, req, text in zip(running, reqs, expected, strict=True):
        outcome = r.sink.outcome
        assert outcome.reason == "length"
        assert outcome.prompt_tokens == prompt_tokens(batched, req) == r.sink.prompt_tokens
        assert outcome.completion_tokens == req.max_tokens == r.sink.tokens
        assert r.sink.text == text, req.id
    # They were decoded together: fewer steps than tokens, four sequences at once.
    assert batched.stats()["steps"] - steps < sum(r.max_tokens for r in reqs)
    assert batched.stats()["max_batch_sequences"] == 4


def test_seeded_sampling_in_a_batch_is_reproducible(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 30, "max_tokens": 40}
    reqs = [request("Hello", id=f"s{seed}", seed=seed, **params) for seed in (11, 12, 13)]
    expected = texts_alone(alone, reqs)
    assert len(set(expected)) == 3  # the seeds matter
    first = [r.sink.text for r in together(batched, reqs)]
    again = [r.sink.text for r in together(batched, list(reversed(reqs)))]
    assert first == expected
    assert list(reversed(again)) == expected


def test_a_prompt_ingested_in_chunks_while_others_decode_gives_the_same_text(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    """A long prompt admitted while another sequence decodes is prefilled in
    chunks beside it, each within the step's time budget; neither text changes."""
    short = request("Once upon a time", id="short", max_tokens=300)
    long = request("world hello " * 300, id="long", max_tokens=16)
    expected = texts_alone(alone, [short, long])
    started = threading.Event()
    sink = RecordingSink(lambda s: started.set() if s.tokens == 3 else None)
    first = Running(batched, short, sink=sink)
    assert started.wait(timeout(10))
    engine = batched.engine
    assert engine is not None
    engine.batcher.step_log.clear()
    at_submit = sink.tokens
    seen: list[int] = []

    class Watching(RecordingSink):
        def prompt_processed(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
            seen.append(sink.tokens)  # how far the short stream got meanwhile
            super().prompt_processed(prompt_tokens, cached_tokens)

    second = Running(batched, long, sink=Watching())
    assert second.wait()[1].text == expected[1]
    assert first.wait()[1].text == expected[0]
    steps = list(engine.batcher.step_log)  # both done: the engine thread appends no more
    stats = batched.request_stats("long")
    n_prompt = prompt_tokens(batched, long)
    assert stats is not None and n_prompt is not None
    assert stats.reused + stats.decoded == n_prompt
    assert sum(p for _, p, *_ in steps) == stats.decoded  # the log covers the ingestion
    mixed = [(d, p, share) for d, p, share, *_ in steps if p and d]
    # Every step of the ingestion while the short stream decoded carried its
    # token beside a chunk no larger than the budget's share at that step.
    assert mixed and all(p <= share for _, p, share in mixed)
    assert seen and seen[0] >= at_submit + len(mixed) - 1


def test_a_fixed_prefill_chunk_when_the_budget_is_off(tiny_gguf: Path) -> None:
    """``prefill_budget = 0``: every step beside a decoding stream takes
    ``prefill_chunk`` prompt tokens (the last one what is left)."""
    with loaded(
        tiny_gguf,
        parallel=2,
        n_ctx=LONG_CTX,
        prefill_budget=0.0,
        prefill_gap_ms=0.0,
        prefill_chunk=24,
    ) as b:
        engine = b.engine
        assert engine is not None
        started = threading.Event()
        sink = RecordingSink(lambda s: started.set() if s.tokens == 2 else None)
        first = Running(b, request("Once upon a time", id="short", max_tokens=200), sink=sink)
        assert started.wait(timeout(10))
        engine.batcher.step_log.clear()
        long = request("world hello " * 100, id="long", max_tokens=4)
        Running(b, long).wait()
        first.wait()
        stats = b.request_stats("long")
        assert stats is not None
        chunks = [p for d, p, *_ in engine.batcher.step_log if p and d]
        assert sum(chunks) == stats.decoded > 24
        assert chunks[:-1] == [24] * (len(chunks) - 1) and 0 < chunks[-1] <= 24


def test_a_steps_tokens_go_to_llama_cpp_in_sequence_order(tiny_gguf: Path) -> None:
    """With one KV stream per sequence, llama.cpp keeps tokens in one
    micro-batch only while each next sequence id is the last + 1, in batch
    order. A sequence reused by a later request (admitted after the others)
    must not put its token out of order: that split every step in two passes
    over the weights (8 streams: 84 ms a step against 63 in order)."""
    with loaded(tiny_gguf, parallel=4, n_ctx=LONG_CTX) as batched:
        engine = batched.engine
        assert engine is not None
        orders: list[list[int]] = []

        def record(_: RecordingSink) -> None:  # on the engine thread, right after the decode
            native = engine.batcher.batch.native
            orders.append([native.seq_id[i][0] for i in range(engine.batcher.batch.n)])

        # A fresh engine: each request goes to the lowest free sequence.
        words = ["Zebra", "Quartz", "Velvet", "Nimbus", "Reused"]
        prompts = [f"{w} crossing the wide river under a pale morning sky again" for w in words]
        cancels = [CancelEvent() for _ in range(4)]
        running = [
            Running(batched, request(p, id=f"o{i}", max_tokens=2 if i == 1 else 4000), cancel=c)
            for i, (p, c) in enumerate(zip(prompts, cancels, strict=False))
        ]
        running[1].wait()  # its sequence is free again, between the others'
        again = Running(
            batched, request(prompts[4], id="o4", max_tokens=20), sink=RecordingSink(record)
        )
        again.wait()
        for cancel in cancels:
            cancel.set()
        for r in running:
            r.wait()
        stats = [batched.request_stats(f"o{i}") for i in range(5)]
        seqs = [st.sequence if st is not None else -1 for st in stats]
        assert seqs[4] == seqs[1] < max(seqs[2], seqs[3]), seqs  # reused, between the others'
        shared = [o for o in orders if len(set(o)) > 1]  # steps of more than one sequence
        assert shared, orders
        assert all(o == sorted(o) for o in shared), shared


# ---------------------------------------------------------------- slow readers


def test_a_slow_reader_pauses_only_its_own_sequence(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    reqs = [request(p, id=f"p{i}", max_tokens=60) for i, p in enumerate(PROMPTS[:3])]
    expected = texts_alone(alone, reqs)
    slow_sink = RecordingSink(capacity=4)
    slow = Running(batched, reqs[1], sink=slow_sink)
    others = [Running(batched, reqs[0]), Running(batched, reqs[2])]
    # The others finish, unchanged, while the slow one holds at its bound.
    assert [o.wait()[1].text for o in others] == [expected[0], expected[2]]
    assert slow_sink.paused.is_set() and slow_sink.outcome is None
    assert len(slow_sink.pieces) == 4
    # The reader catches up a little at a time; it gets everything, in order.
    while not slow.completed.is_set():
        slow_sink.paused.clear()
        slow_sink.grow(len(slow_sink.pieces) + 7)
        assert slow_sink.paused.wait(timeout(10)) or slow.completed.is_set()
    outcome, sink = slow.wait()
    assert sink.text == expected[1]
    assert (outcome.reason, outcome.completion_tokens) == ("length", 60)


# ---------------------------------------------------------------- cancel inside a batch


def test_cancel_mid_decode_in_a_batch_leaves_the_others_unchanged(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    reqs = [request(p, id=f"d{i}", max_tokens=80) for i, p in enumerate(PROMPTS[:3])]
    expected = texts_alone(alone, reqs)
    cancel = CancelEvent()
    victim_sink = RecordingSink(lambda s: cancel.set() if s.tokens == 7 else None)
    running = [
        Running(batched, reqs[0]),
        Running(batched, reqs[1], sink=victim_sink, cancel=cancel),
        Running(batched, reqs[2]),
    ]
    results = [r.wait()[1] for r in running]
    assert victim_sink.outcome is None and victim_sink.tokens == 7
    assert results[0].text == expected[0] and results[2].text == expected[2]
    # The next request on the freed sequence starts clean.
    assert run(batched, reqs[1])[1].text == expected[1]


def test_cancel_mid_prefill_in_a_batch_aborts_and_the_others_rerun_their_part(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    decoding = request("Once upon a time", id="keep", max_tokens=200)
    victim = request(LONG_PROMPT, id="victim", max_tokens=8)
    expected = texts_alone(alone, [decoding])[0]
    assert batched.engine is not None
    started = threading.Event()
    first = Running(
        batched, decoding, sink=RecordingSink(lambda s: started.set() if s.tokens == 5 else None)
    )
    assert started.wait(timeout(10))
    cancel = CancelEvent()
    # Cancelled on the engine thread with its first chunk armed in the batch,
    # next to the other sequence's decode token: the decode is aborted.
    batched.on_prefill = lambda request_id, n: cancel.set() if request_id == "victim" else None
    aborts = batched.stats()["aborts"]
    try:
        outcome, sink = run(batched, victim, cancel=cancel)
    finally:
        batched.on_prefill = None
    assert outcome is None and sink.pieces == []
    assert batched.stats()["aborts"] == aborts + 1
    stats = batched.request_stats("victim")
    assert stats is not None and stats.aborted and stats.decoded == 0
    memory = llama_cpp.llama_get_memory(batched.engine.ctx)
    assert llama_cpp.llama_memory_seq_pos_max(memory, stats.sequence) == stats.reused - 1
    # The other stream lost nothing: the step was re-run for it.
    assert first.wait()[1].text == expected


def test_after_aborts_a_request_gives_the_text_of_a_fresh_server(
    tiny_gguf: Path, alone: LlamaBackend
) -> None:
    prompt = "world hello " * 1500
    fresh = [run(alone, request(p, max_tokens=24))[1].text for p in (prompt, "Hello world")]
    with loaded(tiny_gguf, parallel=2, n_ctx=LONG_CTX, n_batch=128) as b:
        # Aborted in its first chunk: nothing of it is committed.
        cancel = CancelEvent()
        b.on_prefill = lambda request_id, n_prompt: cancel.set()
        run(b, request(prompt, id="a1", max_tokens=24), cancel=cancel)
        assert b.stats()["aborts"] == 1
        # Cancelled from outside part-way: what was committed stays cached.
        started = threading.Event()
        b.on_prefill = lambda request_id, n_prompt: started.set()
        second = Running(b, request(prompt, id="a2", max_tokens=24))
        assert started.wait(timeout(10))
        second.cancel.set()
        second.wait()
        b.on_prefill = None
        partial = b.request_stats("a2")
        n_prompt = prompt_tokens(b, request(prompt))
        assert partial is not None and n_prompt is not None and partial.decoded < n_prompt
        # The same prompt again picks up exactly the committed part.
        assert run(b, request(prompt, id="a3", max_tokens=24))[1].text == fresh[0]
        again = b.request_stats("a3")
        assert again is not None
        assert again.reused == min(partial.reused + partial.decoded, n_prompt - 1)
        assert run(b, request("Hello world", max_tokens=24))[1].text == fresh[1]


# ---------------------------------------------------------------- prompt cache


def test_the_next_chat_turn_reuses_the_cached_prefix_and_decodes_only_the_rest(
    batched: LlamaBackend, alone: LlamaBackend
) -> None:
    history = "User: " + "tell me about the world " * 40 + "\nAssistant:"
    first = request(history, id="turn1", max_tokens=20)
    _, sink = run(batched, first)
    turn2 = request(history + sink.text + "\nUser: and then?\nAssistant:", id="turn2")
    n1 = prompt_tokens(batched, first)
    n2 = prompt_tokens(batched, turn2)
    assert n1 is not None and n2 is not None
    outcome, sink2 = run(batched, turn2)
    stats = batched.request_stats("turn2")
    assert stats is not None
    # Routed to the sequence that holds turn 1; only the new tokens decoded.
    assert stats.sequence == batched.request_stats("turn1").sequence  # type: ignore[union-attr]
    assert stats.reused >= n1 - 1
    assert stats.decoded == n2 - stats.reused
    assert outcome.prompt_tokens == n2
    assert sink2.text == run(alone, request(turn2.prompt, id="fresh2"))[1].text


def test_a_different_prompt_never_sees_another_requests_cells(batched: LlamaBackend) -> None:
    run(batched, request("hello world " * 50, id="x1", max_tokens=4))
    outcome, _ = run(batched, request("qqq zzz never seen", id="x2", max_tokens=4))
    stats = batched.request_stats("x2")
    assert stats is not None and outcome.reason == "length"
    # BOS in common at most: below the similarity threshold, nothing reused.
    assert stats.reused <= 1


# ---------------------------------------------------------------- context per sequence


def test_context_full_per_sequence_ends_with_length_or_too_large(tiny_gguf: Path) -> None:
    with loaded(tiny_gguf, parallel=2, n_ctx=64) as small:
        prompt = "hello world " * 20
        n_prompt = prompt_tokens(small, request(prompt))
        assert n_prompt is not None and n_prompt < 64
        both = together(
            small,
            [request(prompt, id="f1", max_tokens=1000), request(prompt, id="f2", max_tokens=1000)],
        )
        for r in both:
            assert (r.sink.outcome.reason, r.sink.outcome.completion_tokens) == (
                "length",
                64 - n_prompt,
            )
        outcome, _ = run(small, request("hello world " * 40))
        assert (outcome.reason, outcome.error_code) == ("error", "too_large")


# ---------------------------------------------------------------- the server


async def test_server_streams_in_one_batch_and_a_slow_reader_holds_no_one_back(
    tiny_gguf: Path, alone: LlamaBackend
) -> None:
    """A client that stops reading fills its socket and its channel; its
    sequence sits out of the batch while two others stream to their end;
    reading again, it gets its whole text. Its tokens carry their 20 most
    likely alternatives (~1 KB each on the wire): a 1 KiB socket is full
    within tens of tokens, so a few hundred prove it in bounded work (4,000
    plain tokens timed out under two CPU-bound processes; issue 34)."""
    reqs = {f"w{i}": p for i, p in enumerate(PROMPTS[:3])}
    others = 200
    expected = {
        rid: run(alone, request(p, id=rid, max_tokens=others))[1].text for rid, p in reqs.items()
    }
    async with llama_server(
        tiny_gguf,
        backend__llama__n_ctx=LONG_CTX,
        backend__llama__parallel=4,
        stream__queue_tokens=1,
        server__sndbuf=1024,
        server__write_limit=1024,
        # The slow reader reads nothing until the others are done: on a busy
        # machine that can outlast the default 10 s after which a connection
        # that makes no progress is aborted, which is not what this is about.
        server__send_timeout_s=600.0,
    ) as server:
        async with (
            slow_wire(server, rcvbuf=1024, max_queue=1) as slow,
            wire(server) as a,
            wire(server) as b,
        ):
            await slow.send({"type": "generate", "id": "slow", **SLOW_READER})
            await slow.until(lambda f: f["type"] == "started")
            (connection,) = [c for c in server.connections.values() if "slow" in c.generations]
            channel = connection.generations["slow"].channel
            # The slow reader's socket fills within kilobytes, then its
            # channel: from then on its sequence sits out. (Starting the
            # others before that raced: they could finish while the slow
            # stream's socket still took frames, its channel not yet full.)
            assert isinstance(connection.ws, PeerAwareConnection)
            async with asyncio.timeout(timeout(30)):
                await connection.ws.writing_paused.wait()
            assert await asyncio_wait(channel.blocked)
            for client, rid in ((a, "w0"), (b, "w1")):
                await client.send(
                    {
                        "type": "generate",
                        "id": rid,
                        "prompt": reqs[rid],
                        "max_tokens": others,
                        "temperature": 0,
                    }
                )
            text_a, frames_a = await a.done("w0", units=30)
            text_b, frames_b = await b.done("w1", units=30)
            assert (text_a, text_b) == (expected["w0"], expected["w1"])
            for frames, rid in ((frames_a, "w0"), (frames_b, "w1")):
                assert frames[-1]["usage"]["completion_tokens"] == others
                assert frames[-1]["usage"]["prompt_tokens"] == len(
                    server.backend.tokenize_prompt(request(reqs[rid])) or []  # type: ignore[attr-defined]
                )
            # The slow reader is held at its channel's bound, short of its end.
            assert connection.ws.writing_paused.is_set()
            assert await asyncio_wait(channel.blocked)
            assert channel.tokens < SLOW_READER["max_tokens"]
            # It reads again, at full speed (through its 1 KiB window TCP
            # would take minutes for these ~300 KB).
            reader_buffer(slow, 1 << 20)
            slow_text, slow_frames = await slow.done("slow", units=60)
            assert slow_frames[-1]["reason"] == "length"
            assert slow_frames[-1]["usage"]["completion_tokens"] == SLOW_READER["max_tokens"]
    assert slow_text == run(alone, request("Hello", max_tokens=SLOW_READER["max_tokens"]))[1].text


async def test_server_cancel_mid_prefill_in_a_batch(tiny_gguf: Path) -> None:
    async with (
        llama_server(
            tiny_gguf, backend__llama__n_ctx=LONG_CTX, backend__llama__parallel=2
        ) as server,
        wire(server) as a,
        wire(server) as b,
    ):
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        await b.send(
            {
                "type": "generate",
                "id": "keep",
                "prompt": "Hello",
                "max_tokens": 600,
                "temperature": 0,
            }
        )
        await b.until(lambda f: f["type"] == "delta")
        prefill = threading.Event()
        backend.on_prefill = lambda request_id, n: prefill.set()
        await a.send({"type": "generate", "id": "long", "prompt": LONG_PROMPT, "max_tokens": 8})
        assert await asyncio_wait(prefill)
        await a.send({"type": "cancel", "id": "long"})
        done = (await a.until(lambda f: f["type"] == "done"))[-1]
        assert done["reason"] == "cancelled"
        text, frames = await b.done("keep", units=30)
        assert_cut_short(backend, "long", LONG_PROMPT)
        assert frames[-1]["usage"]["completion_tokens"] == 600
        backend.on_prefill = None
    with loaded(tiny_gguf) as fresh:
        assert text == run(fresh, request("Hello", max_tokens=600))[1].text


async def asyncio_wait(event: threading.Event) -> bool:
    return await asyncio.to_thread(event.wait, timeout(10))
