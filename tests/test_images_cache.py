"""The prompt cache keyed by an image's content, on the tiny text model and its tiny projector.

An image's positions hold a number derived from its decoded pixels
(``wsserver/backends/llama_vision.py``), so the prompt cache
(``llama_sequences.py``: in a slot, or restored from host memory) reuses
an image's cells like text's. A second turn about the same image is neither
encoded nor decoded again and answers as a fresh server does; a different
image at the same place, or the same image after a different conversation,
is encoded; a prefix that ends inside an image (a cancel halfway through its
decode) is cut back to the image's start; a cancel on a turn that reuses an
image leaves it whole. Every count is the engine's (``images_encoded``,
``images_reused``) and every answer is compared with a fresh backend's.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp.mtmd_cpp")

import openai
from conftest import running_server, timeout
from test_images_llama import data_url, four_a_step, image_part
from test_llama_backend import (
    RecordingSink,
    Running,
    llama_config,
    loaded,
    request,
    run,
)
from test_llama_choices import choices, run_together
from tiny_images import gradient_png, solid_png
from tiny_mmproj import IMAGE_TOKENS, write_tiny_mmproj

from wsserver.backends.base import CancelEvent
from wsserver.backends.llama import LlamaBackend
from wsserver.backends.llama_sequences import whole_images
from wsserver.backends.llama_vision import ImageChunk, ImageSpan, image_key
from wsserver.core.chat_input import Message
from wsserver.core.images import IMAGE_MARKER

RED = solid_png((255, 0, 0))
GRADIENT = gradient_png()
#: Two images compared by their answers: random weights can make two
#: images' first greedy tokens alike, so answers are this long.
N = 16


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny.mmproj.gguf")


def first_turn(image: bytes, words: str = "Look at") -> tuple[Message, ...]:
    return (Message("user", f"{words} {IMAGE_MARKER} please", images=(image,)),)


def second_turn(image: bytes, first_answer: str, words: str = "Look at") -> tuple[Message, ...]:
    return (
        *first_turn(image, words),
        Message("assistant", first_answer),
        Message("user", "And what colour is it?"),
    )


def answer(backend: LlamaBackend, messages: tuple[Message, ...], rid: str) -> tuple[Any, str]:
    """The engine's greedy answer (``N`` tokens): its outcome and text."""
    prepared = backend.prepare(request(None, id=rid, messages=messages, max_tokens=N))
    outcome, sink = run(backend, prepared)
    assert outcome is not None and outcome.reason == "length", outcome
    return outcome, sink.text


def image_span(backend: LlamaBackend, messages: tuple[Message, ...]) -> tuple[int, int]:
    """The prompt's (one) image: its first position and the one after it."""
    tokens = backend.tokenize_prompt(request(None, messages=messages))
    assert tokens is not None
    positions = [i for i, token in enumerate(tokens) if token < 0]
    assert len(positions) == IMAGE_TOKENS and len(set(tokens[i] for i in positions)) == 1
    return positions[0], positions[-1] + 1


def fresh(tiny_gguf: Path, mmproj: Path, messages: tuple[Message, ...]) -> tuple[int, str]:
    """What a freshly loaded backend (nothing cached) answers: its prompt's
    length and its text."""
    with loaded(tiny_gguf, mmproj=str(mmproj), n_ctx=512, parallel=1) as backend:
        outcome, text = answer(backend, messages, "fresh")
        assert counts(backend) == (1, 0) and outcome.cached_tokens == 0
        return outcome.prompt_tokens, text


def counts(backend: LlamaBackend) -> tuple[int, int]:
    stats = backend.stats()
    return stats["images_encoded"], stats["images_reused"]


# ---------------------------------------------------------------- the key, sans-I/O


def test_the_key_is_negative_62_bits_and_the_rule_cuts_a_prefix_back_to_an_images_start() -> None:
    assert image_key(b"0" * 64) == -1
    assert image_key(b"f" * 64) == -(2**62)
    assert image_key(b"0123456789abcdef" + b"0" * 48) != image_key(b"0123456789abcdeb" + b"0" * 48)
    spans = (ImageSpan(5, 16, ImageChunk(None)), ImageSpan(21, 16, ImageChunk(None)))
    # Before, at and after an image: kept; inside one: cut back to its start
    # (two images back to back: the boundary between them is a start).
    assert [whole_images(k, spans) for k in (3, 5, 6, 20, 21, 22, 36, 37, 40)] == [
        3, 5, 5, 5, 21, 21, 21, 37, 40
    ]  # fmt: skip


def test_the_same_pixels_in_another_encoding_get_the_same_key(
    tiny_gguf: Path, mmproj: Path
) -> None:
    # The key is the decoded bitmap's, not the file's: RED as a PNG and as a
    # BMP (another encoding, other bytes) stand as the same positions.
    bmp = _bmp(32, 32, (255, 0, 0))
    with loaded(tiny_gguf, mmproj=str(mmproj), n_ctx=512, parallel=1) as backend:
        red = backend.tokenize_prompt(request(None, messages=first_turn(RED)))
        as_bmp = backend.tokenize_prompt(request(None, messages=first_turn(bmp)))
        other = backend.tokenize_prompt(request(None, messages=first_turn(GRADIENT)))
    assert red is not None and as_bmp is not None and other is not None
    assert red == as_bmp and red != other
    assert min(red) < 0 and len(red) == len(other)


def _bmp(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """An uncompressed 24-bit BMP of one colour (rows padded to 4 bytes)."""
    row = bytes((rgb[2], rgb[1], rgb[0])) * width
    row += b"\x00" * (-len(row) % 4)
    pixels = row * height
    header = b"BM" + (54 + len(pixels)).to_bytes(4, "little") + b"\x00" * 4
    header += (54).to_bytes(4, "little") + (40).to_bytes(4, "little")
    header += width.to_bytes(4, "little") + height.to_bytes(4, "little")
    header += (1).to_bytes(2, "little") + (24).to_bytes(2, "little") + b"\x00" * 24
    return header + pixels


# ---------------------------------------------------------------- in a slot


def test_a_second_turn_reuses_the_image_and_answers_as_a_fresh_server(
    tiny_gguf: Path, mmproj: Path
) -> None:
    with loaded(tiny_gguf, mmproj=str(mmproj), n_ctx=512, parallel=2) as backend:
        _, first = answer(backend, first_turn(RED), "t1")
        assert counts(backend) == (1, 0)
        turn = second_turn(RED, first)
        start, end = image_span(backend, turn)
        outcome, text = answer(backend, turn, "t2")
        # Not encoded again, nor decoded: the sequence starts after the image.
        assert counts(backend) == (1, 1)
        stats = backend.request_stats("t2")
        assert stats is not None and stats.images_reused == 1
        assert stats.reused >= end and stats.decoded == stats.prompt_tokens - stats.reused
        # usage: every position of the prompt, the image's among them; the
        # cached ones include the image's.
        assert outcome.prompt_tokens == stats.prompt_tokens
        assert outcome.cached_tokens == stats.reused

        # A different image at the same place is encoded, and answers otherwise.
        other = second_turn(GRADIENT, first)
        outcome_other, text_other = answer(backend, other, "t3")
        assert counts(backend) == (2, 1)
        stats_other = backend.request_stats("t3")
        assert stats_other is not None and stats_other.images_reused == 0
        assert stats_other.reused <= start  # the text before it only
        assert outcome_other.prompt_tokens == outcome.prompt_tokens
        assert text_other != text

        # The same image after a different conversation is encoded (a prefix
        # holds an image's cells only after the same tokens).
        elsewhere = first_turn(RED, words="Now see")
        _, text_elsewhere = answer(backend, elsewhere, "t4")
        assert counts(backend) == (3, 1)

    # No stale cells: each answer is what a fresh backend gives.
    assert fresh(tiny_gguf, mmproj, turn) == (outcome.prompt_tokens, text)
    assert fresh(tiny_gguf, mmproj, other)[1] == text_other
    assert fresh(tiny_gguf, mmproj, elsewhere)[1] == text_elsewhere


# ---------------------------------------------------------------- from host memory


def test_an_image_conversation_comes_back_from_host_memory_without_an_encode(
    tiny_gguf: Path, mmproj: Path
) -> None:
    # One sequence, two conversations: the image's leaves for host memory
    # when the other takes the sequence, and is restored for its next turn.
    with loaded(
        tiny_gguf, mmproj=str(mmproj), n_ctx=512, parallel=1, prompt_cache_bytes=1 << 26
    ) as backend:
        engine = backend.engine
        assert engine is not None and engine.cache.host is not None
        _, first = answer(backend, first_turn(RED), "a1")
        talk = (Message("user", "Tell me about the sea, the sky and the hills today."),)
        answer(backend, talk, "b1")
        assert any(min(entry.tokens) < 0 for entry in engine.cache.host.entries())
        turn = second_turn(RED, first)
        _, end = image_span(backend, turn)
        outcome, text = answer(backend, turn, "a2")
        stats = backend.request_stats("a2")
        assert stats is not None
        assert stats.restored == stats.reused >= end and stats.images_reused == 1
        assert counts(backend) == (1, 1)
        assert outcome.cached_tokens == stats.reused
    assert fresh(tiny_gguf, mmproj, turn) == (outcome.prompt_tokens, text)


# ---------------------------------------------------------------- cancels


def test_a_prefix_ending_inside_an_image_is_cut_back_to_its_start(
    tiny_gguf: Path, mmproj: Path
) -> None:
    # A share of 4 prompt positions a step beside a decoding stream: the
    # image goes in 4 parts; a cancel during the third leaves the sequence
    # holding 8 of its 16 positions. The same prompt again reuses the text
    # before the image, not half of it: the image is encoded again.
    with four_a_step(tiny_gguf, mmproj) as backend:
        engine = backend.engine
        assert engine is not None and engine.images is not None
        images = engine.images
        decode = images.decode
        cancel = CancelEvent()
        calls: list[int] = []

        def cancelled_in_the_third_part(*args: Any) -> int:
            calls.append(args[2])
            if len(calls) == 3:
                cancel.set()  # in flight: its cancel raises the abort flag
            return decode(*args)

        stream_started = threading.Event()
        stream = RecordingSink(on_offer=lambda sink: stream_started.set())
        images.decode = cancelled_in_the_third_part  # type: ignore[method-assign]
        long = Running(backend, request("Once upon a time", id="long", max_tokens=400), stream)
        assert stream_started.wait(timeout(10))
        messages = first_turn(RED)
        start, _ = image_span(backend, messages)
        prepared = backend.prepare(request(None, id="cut", messages=messages, max_tokens=N))
        outcome, _ = run(backend, prepared, cancel=cancel)
        long.cancel.set()
        long.wait()
        images.decode = decode  # type: ignore[method-assign]
        assert outcome is None and calls == [4, 4, 4]
        held = [s.tokens for s in engine.cache.sequences if s.tokens and min(s.tokens) < 0]
        assert len(held) == 1 and sum(t < 0 for t in held[0]) == 8  # half the image
        assert counts(backend) == (1, 0)

        again, text = answer(backend, messages, "again")
        stats = backend.request_stats("again")
        assert stats is not None and stats.reused == start and stats.images_reused == 0
        assert counts(backend) == (2, 0)
    assert fresh(tiny_gguf, mmproj, messages) == (again.prompt_tokens, text)


def test_a_cancel_on_a_turn_that_reuses_an_image_leaves_it_whole(
    tiny_gguf: Path, mmproj: Path
) -> None:
    with loaded(tiny_gguf, mmproj=str(mmproj), n_ctx=512, parallel=1) as backend:
        _, first = answer(backend, first_turn(RED), "c1")
        turn = second_turn(RED, first)
        cancel = CancelEvent()
        prefilled: list[str] = []

        def on_prefill(request_id: str, n: int) -> None:
            prefilled.append(request_id)
            cancel.set()  # before its first prompt tokens (after the image) go in

        backend.on_prefill = on_prefill
        prepared = backend.prepare(request(None, id="c2", messages=turn, max_tokens=N))
        outcome, _ = run(backend, prepared, cancel=cancel)
        backend.on_prefill = None
        assert outcome is None and prefilled == ["c2"]
        stats = backend.request_stats("c2")
        assert stats is not None and stats.images_reused == 1
        # Served on: the turn again reuses the image, and answers as fresh.
        again, text = answer(backend, turn, "c3")
        assert counts(backend) == (1, 2)
    assert fresh(tiny_gguf, mmproj, turn) == (again.prompt_tokens, text)


# ---------------------------------------------------------------- several choices


def test_choices_prepared_apart_share_one_encode_of_their_image(
    tiny_gguf: Path, mmproj: Path
) -> None:
    # Each choice's prompt is tokenized on its own (as the server prepares
    # each request): the same pixels give the same positions, so the
    # choices copy the first one's cells, image included (llama_choices).
    with loaded(tiny_gguf, mmproj=str(mmproj), n_ctx=512, parallel=2) as backend:
        base = request(None, id="pick", messages=first_turn(RED), max_tokens=N)
        running = run_together(
            backend, [backend.prepare(each) for each in choices(base, 2, "t/pick")]
        )
        assert backend.stats()["choices_forked"] == 1
        # One encode; the second choice's copy held the image (reused).
        assert counts(backend) == (1, 1)
        texts = {r.sink.text for r in running}
        assert all(r.sink.outcome.reason == "length" for r in running)
    assert len(texts) == 1
    assert fresh(tiny_gguf, mmproj, first_turn(RED))[1] in texts


# ---------------------------------------------------------------- OpenAI's chat API


def chat_messages(image: bytes, first: str | None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look at"}, image_part(data_url(image))],
        }
    ]
    if first is not None:
        messages.append({"role": "assistant", "content": first})
        messages.append({"role": "user", "content": "And what colour is it?"})
    return messages


async def test_openais_client_sees_the_images_positions_as_cached_tokens(
    tiny_gguf: Path, mmproj: Path
) -> None:
    config = llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[{"name": "seer", "model": str(tiny_gguf), "mmproj": str(mmproj)}],
    )

    async def turns(server: Any, first: str | None) -> Any:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=timeout(60),
        )
        try:
            return await client.chat.completions.create(
                model="seer", messages=chat_messages(RED, first), max_tokens=N, temperature=0
            )
        finally:
            await client.close()

    async with running_server(config) as server:
        one = await turns(server, None)
        first = one.choices[0].message.content
        assert first and one.usage is not None
        backend = server.models.models["seer"].backend
        assert isinstance(backend, LlamaBackend)
        assert counts(backend) == (1, 0)
        two = await turns(server, first)
        assert counts(backend) == (1, 1)
    async with running_server(config) as cold:
        cold_two = await turns(cold, first)
    assert two.usage is not None and cold_two.usage is not None
    assert two.usage.prompt_tokens == cold_two.usage.prompt_tokens
    assert two.usage.prompt_tokens > one.usage.prompt_tokens
    details = two.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # The first turn's prompt, its image among it, came from the cache.
    assert details.cached_tokens >= one.usage.prompt_tokens - 1
    assert two.choices[0].message.content == cold_two.choices[0].message.content
