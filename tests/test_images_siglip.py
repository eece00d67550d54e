"""Gemma 3's and SmolVLM's projectors through the llama engine, on tiny pairs.

The engine's greedy tokens against libmtmd's helper path on a plain context
(``tests/mtmd_reference.py``: ``mtmd_helper_eval_chunks``, which turns
causal attention off around a Gemma 3 image and decodes it whole), token
for token. For ``gemma3`` that comparison is what catches a wrong decode:
the engine made causal, or splitting an image, gives other tokens (shown
below, so the comparison is known to be able to fail: token for token and
each token's log-probability within 1e-3). ``idefics3`` cuts an
image into an overview and slices, each its own chunk, decoded causally.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp.mtmd_cpp")

import llama_cpp
from conftest import timeout
from mtmd_reference import helper_greedy
from test_images_llama import answer, four_a_step, helper_answer, looking_at
from test_llama_backend import RecordingSink, Running, loaded, request, run
from tiny_gguf import write_tiny_gguf
from tiny_images import gradient_png, solid_png
from tiny_siglip import GEMMA3_TOKENS, IDEFICS3_TILE_TOKENS, IDEFICS3_TOKENS, write_tiny_siglip

from wsserver.backends.base import CancelEvent
from wsserver.backends.llama import LlamaBackend
from wsserver.backends.llama_chat import plain_chat_prompt
from wsserver.core.chat_input import Message
from wsserver.errors import ModelLoadError

RED = solid_png((255, 0, 0))
GRADIENT = gradient_png()


@pytest.fixture(scope="module", params=["gemma3", "idefics3"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """A text model and its tiny projector of the parameter's type."""
    kind: str = request.param
    folder = tmp_path_factory.mktemp(kind)
    tokens = IDEFICS3_TOKENS if kind == "idefics3" else ()
    text = write_tiny_gguf(folder / "text.gguf", extra_tokens=tokens)
    return text, write_tiny_siglip(folder / "mmproj.gguf", kind)


@pytest.fixture(scope="module")
def vision(pair: tuple[Path, Path]) -> Iterator[LlamaBackend]:
    with loaded(pair[0], mmproj=str(pair[1]), n_ctx=512, parallel=2) as backend:
        yield backend


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("gemma")
    return write_tiny_gguf(folder / "text.gguf"), write_tiny_siglip(folder / "g.gguf", "gemma3")


#: How far the engine's log-probabilities may be from the helper's. Measured
#: here: 1.3e-7 apart for a Gemma 3 image; 1.3e-4 for two Idefics3 images,
#: the first from a cached prefix (the same sums in other pieces). A Gemma 3
#: image decoded in two halves moved them by 0.09 (the red image; 2.8e-4
#: for the gradient, whose tokens did not change either).
CLOSE = 1e-3


def read(backend: LlamaBackend, messages: tuple[Message, ...]) -> tuple[list[bytes], list[float]]:
    """The engine's 12 greedy tokens' bytes and log-probabilities."""
    asked = request(None, messages=messages, max_tokens=12, logprobs=0)
    outcome, sink = run(backend, backend.prepare(asked))
    assert outcome.reason == "length"
    return [e.bytes for e in sink.logprobs], [e.logprob for e in sink.logprobs]


def helper_read(
    backend: LlamaBackend, pair: tuple[Path, Path], messages: tuple[Message, ...]
) -> tuple[list[bytes], list[float]]:
    """libmtmd's helper path's 12 greedy tokens' bytes and log-probabilities."""
    assert backend.vocab is not None
    images = [image for m in messages for image in m.images]
    run_ = helper_greedy(pair[0], pair[1], plain_chat_prompt(messages), images, n=12)
    return [backend.vocab.piece(token) for token in run_.tokens], run_.logprobs


def same(ours: tuple[list[bytes], list[float]], theirs: tuple[list[bytes], list[float]]) -> bool:
    """Token for token, and each token's log-probability within :data:`CLOSE`."""
    return ours[0] == theirs[0] and all(
        abs(a - b) <= CLOSE for a, b in zip(ours[1], theirs[1], strict=True)
    )


def test_the_engine_reads_an_image_as_libmtmds_helper_does(
    vision: LlamaBackend, pair: tuple[Path, Path]
) -> None:
    for images in ((RED,), (GRADIENT,), (RED, GRADIENT)):
        messages = looking_at(*images)
        outcome, text = answer(vision, messages)
        prompt_tokens, expected = helper_answer(pair[0], pair[1], messages)
        assert outcome.prompt_tokens == prompt_tokens  # image tokens counted
        assert text == expected
        assert same(read(vision, messages), helper_read(vision, pair, messages))


def test_an_image_changes_the_answer_and_the_same_image_gives_the_same(
    vision: LlamaBackend,
) -> None:
    _, red = answer(vision, looking_at(RED, words="Then see"))
    _, red_again = answer(vision, looking_at(RED, words="Then see"))
    _, gradient = answer(vision, looking_at(GRADIENT, words="Then see"))
    _, text_only = answer(vision, (Message("user", "Then see please"),))
    assert red == red_again
    assert len({red, gradient, text_only}) == 3


def test_an_idefics3_image_is_an_overview_and_its_slices(tmp_path: Path) -> None:
    text = write_tiny_gguf(tmp_path / "smol.gguf", extra_tokens=IDEFICS3_TOKENS)
    smol = write_tiny_siglip(tmp_path / "smol.mmproj.gguf", "idefics3")
    with loaded(text, mmproj=str(smol), n_ctx=512, parallel=1) as backend:
        assert backend.vision is not None and not backend.vision.whole
        one, _ = answer(backend, looking_at(GRADIENT, words="Tile"))
        none, _ = answer(backend, (Message("user", "Tile please"),))
        # Cut at 64 pixels on its longest edge: an overview and 2 x 2
        # slices of 32, each its own chunk (encoded apart), with marker
        # text between.
        assert backend.stats()["images_encoded"] == 5
    assert one.prompt_tokens - none.prompt_tokens > 5 * IDEFICS3_TILE_TOKENS


# ---------------------------------------------------------------- gemma3: whole, non-causal


def test_a_gemma3_image_goes_whole_with_causal_attention_off_even_at_four_a_step(
    gemma: tuple[Path, Path],
) -> None:
    # A fixed share of 4 prompt positions a step beside a decoding stream:
    # an LLaVA image would go in 4 parts of 4 (test_images_llama); a Gemma 3
    # image goes in one decode of all its 16, attention non-causal during it
    # and causal again after — and reads as libmtmd's helper reads it.
    with four_a_step(*gemma) as backend:
        engine = backend.engine
        assert engine is not None and engine.images is not None and engine.images.whole
        images, ctx = engine.images, engine.ctx
        decode = images._decode
        parts: list[tuple[int, bool]] = []

        def recorded(*args: Any) -> int:
            parts.append((args[2], bool(llama_cpp.llama_get_causal_attn(ctx))))
            return decode(*args)

        images._decode = recorded  # type: ignore[method-assign]
        stream_started = threading.Event()
        stream = RecordingSink(on_offer=lambda sink: stream_started.set())
        long = Running(backend, request("Once upon a time", id="long", max_tokens=400), stream)
        assert stream_started.wait(timeout(10))
        messages = looking_at(GRADIENT)
        got = read(backend, messages)
        long.cancel.set()
        long.wait()
        assert same(got, helper_read(backend, gemma, messages))
        assert parts == [(GEMMA3_TOKENS, False)]
        assert llama_cpp.llama_get_causal_attn(ctx)


@pytest.mark.parametrize("wrong", ["causal", "split"])
def test_the_helper_comparison_catches_a_causal_or_a_split_gemma3_decode(
    gemma: tuple[Path, Path], wrong: str
) -> None:
    # The yardstick can fail: the same engine, made to decode a Gemma 3 image
    # causally (as an LLaVA one) or in two halves (each half blind to the
    # other), gives tokens other than the helper's.
    with loaded(gemma[0], mmproj=str(gemma[1]), n_ctx=512, parallel=1) as backend:
        assert backend.engine is not None and backend.engine.images is not None
        images = backend.engine.images
        if wrong == "causal":
            images.whole = False
        else:
            images.piece = lambda span, share: span.n_tokens // 2  # type: ignore[method-assign]
        messages = looking_at(RED)
        assert not same(read(backend, messages), helper_read(backend, gemma, messages))


def test_a_cancel_during_a_gemma3_images_decode_aborts_it_and_restores_causal_attention(
    gemma: tuple[Path, Path],
) -> None:
    with loaded(gemma[0], mmproj=str(gemma[1]), n_ctx=512, parallel=1) as backend:
        engine = backend.engine
        assert engine is not None and engine.images is not None
        images, ctx = engine.images, engine.ctx
        cancel = CancelEvent()
        decode = images._decode
        statuses: list[int] = []

        def cancelled_meanwhile(*args: Any) -> int:
            cancel.set()  # the job is in flight: its cancel raises the abort flag
            statuses.append(decode(*args))
            return statuses[-1]

        images._decode = cancelled_meanwhile  # type: ignore[method-assign]
        messages = looking_at(RED, words="Cancel the decode of")
        prepared = backend.prepare(request(None, messages=messages, max_tokens=4))
        outcome, _ = run(backend, prepared, cancel=cancel)
        assert outcome is None and statuses == [2]
        assert llama_cpp.llama_get_causal_attn(ctx)  # back on, though the decode aborted
        images._decode = decode  # type: ignore[method-assign]
        assert same(read(backend, messages), helper_read(backend, gemma, messages))


def test_a_context_whose_micro_batch_cannot_hold_a_gemma3_image_is_refused_at_load(
    gemma: tuple[Path, Path],
) -> None:
    backend = LlamaBackend(model=str(gemma[0]), mmproj=str(gemma[1]), n_ctx=512, n_ubatch=8)
    with pytest.raises(ModelLoadError) as refused:
        backend.load()
    message = str(refused.value)
    assert f"an image is {GEMMA3_TOKENS} tokens" in message and "n_ubatch is 8" in message
    assert str(gemma[1]) in message
    with loaded(gemma[0], mmproj=str(gemma[1]), n_ctx=512, n_ubatch=GEMMA3_TOKENS) as fits:
        assert fits.vision is not None and fits.vision.whole


def test_a_text_model_without_idefics3s_markers_is_refused_at_load(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    # libmtmd looks <fake_token_around_image> up in the vocabulary and puts
    # -1 where it is missing: a prompt the text model cannot decode.
    smol = write_tiny_siglip(tmp_path / "smol.gguf", "idefics3")
    backend = LlamaBackend(model=str(tiny_gguf), mmproj=str(smol), n_ctx=512)
    with pytest.raises(ModelLoadError, match="vocabulary lacks"):
        backend.load()
