"""Images through the llama engine, on the tiny text model and its tiny projector.

The engine's own path — libmtmd tokenizes, the engine encodes each image and
decodes its embeddings into the sequence's positions beside other sequences
(:mod:`wsserver.backends.llama_vision`) — against libmtmd's helper path on a
plain context (``tests/mtmd_reference.py``): the same greedy text, token for
token; the image changes the output, the same image gives the same output,
two images are both read (their tokens counted). Then OpenAI's chat API with
``image_url`` parts, and what it refuses, naming the image.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp.mtmd_cpp")

from conftest import TINY_MODEL, running_server, timeout
from mtmd_reference import helper_greedy
from test_anthropic_http import post
from test_llama_backend import RecordingSink, Running, llama_config, loaded, request, run
from tiny_images import gradient_png, png_header_only, solid_png
from tiny_mmproj import IMAGE_TOKENS, write_tiny_mmproj

from wsserver.backends.base import CancelEvent
from wsserver.backends.llama import LlamaBackend
from wsserver.backends.llama_chat import plain_chat_prompt
from wsserver.core.chat_input import Message
from wsserver.core.images import IMAGE_MARKER, MAX_IMAGES

RED = solid_png((255, 0, 0))
BLUE = solid_png((0, 0, 255))
GRADIENT = gradient_png()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny.mmproj.gguf")


@pytest.fixture(scope="module")
def vision(tiny_gguf: Path, mmproj: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, mmproj=str(mmproj), n_ctx=512, parallel=2) as backend:
        yield backend


def looking_at(*images: bytes, words: str = "Look at") -> tuple[Message, ...]:
    markers = " and ".join(IMAGE_MARKER for _ in images)
    return (Message("user", f"{words} {markers} please", images=images),)


def answer(backend: LlamaBackend, messages: tuple[Message, ...], n: int = 12) -> tuple[Any, str]:
    """The engine's greedy answer: its outcome and text."""
    prepared = backend.prepare(request(None, messages=messages, max_tokens=n))
    outcome, sink = run(backend, prepared)
    return outcome, "".join(sink.pieces)


def helper_answer(
    tiny_gguf: Path, mmproj: Path, messages: tuple[Message, ...], n: int = 12
) -> tuple[int, str]:
    """libmtmd's helper path on the same prompt (the tiny model has no chat
    template: the plain-text fallback's rendering, BOS added by libmtmd)."""
    images = [image for m in messages for image in m.images]
    run = helper_greedy(tiny_gguf, mmproj, plain_chat_prompt(messages), images, n=n)
    from llama_cpp import Llama  # the pieces, as the engine's text assembler reads them

    llm = Llama(str(tiny_gguf), n_ctx=64, verbose=False, vocab_only=True)
    try:
        data = b"".join(llm.detokenize([t], special=False) for t in run.tokens)
    finally:
        llm.close()
    return run.prompt_tokens, data.decode("utf-8", errors="ignore")


# ---------------------------------------------------------------- the engine


def test_the_engine_reads_an_image_as_libmtmds_helper_does(
    vision: LlamaBackend, tiny_gguf: Path, mmproj: Path
) -> None:
    assert vision.vocab is not None
    for images in ((RED,), (GRADIENT,), (RED, GRADIENT)):
        messages = looking_at(*images)
        outcome, text = answer(vision, messages)
        prompt_tokens, expected = helper_answer(tiny_gguf, mmproj, messages)
        assert outcome.reason == "length"
        assert outcome.prompt_tokens == prompt_tokens  # image tokens counted
        assert text == expected
        # Token for token: each generated token's bytes (its log-probability
        # entry), against the helper's tokens' pieces.
        asked = request(None, messages=messages, max_tokens=12, logprobs=0)
        _, sink = run(vision, vision.prepare(asked))
        run_ = helper_greedy(tiny_gguf, mmproj, plain_chat_prompt(messages), images, n=12)
        assert len(sink.logprobs) == len(run_.tokens) == 12
        assert [entry.bytes for entry in sink.logprobs] == [
            vision.vocab.piece(token) for token in run_.tokens
        ]


def test_an_image_changes_the_answer_and_the_same_image_gives_the_same(
    vision: LlamaBackend,
) -> None:
    _, red = answer(vision, looking_at(RED))
    _, red_again = answer(vision, looking_at(RED))
    _, gradient = answer(vision, looking_at(GRADIENT))
    _, text_only = answer(vision, (Message("user", "Look at please"),))
    assert red == red_again
    assert len({red, gradient, text_only}) == 3


def test_two_images_are_both_read(vision: LlamaBackend) -> None:
    one, _ = answer(vision, looking_at(RED, words="Read both"))
    before = vision.stats()
    two, _ = answer(vision, looking_at(RED, BLUE, words="Read both"))
    after = vision.stats()
    # The second image's tokens, and the text " and" between the two.
    assert two.prompt_tokens - one.prompt_tokens >= IMAGE_TOKENS
    # The first image is the first request's (the prompt cache holds it);
    # the second is encoded.
    assert after["images_encoded"] - before["images_encoded"] == 1
    assert after["images_reused"] - before["images_reused"] == 1


def test_pixels_that_do_not_decode_are_refused_naming_the_image(vision: LlamaBackend) -> None:
    corrupt = RED[:40] + b"\x00" * 20 + RED[60:]  # the header intact, the pixels not
    prepared = vision.prepare(request(None, messages=looking_at(RED, corrupt), max_tokens=4))
    outcome, _ = run(vision, prepared)
    assert outcome.reason == "error" and outcome.error_code == "bad_request"
    assert "image 1" in (outcome.error_message or "")


def test_a_cancel_during_an_images_encode_lands_before_its_embeddings_are_decoded(
    vision: LlamaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The encode is one native call no cancel reaches: the finest cancel
    # point is its end, before any embedding is decoded.
    engine = vision.engine
    assert engine is not None and engine.images is not None
    images = engine.images
    cancel = CancelEvent()
    encode = images.encode

    def cancelled_meanwhile(span: Any) -> Any:
        cancel.set()
        return encode(span)

    monkeypatch.setattr(images, "encode", cancelled_meanwhile)
    encoded, decoded = engine.stats["images_encoded"], engine.stats["prompt_tokens_decoded"]
    # (Words no other test uses before the image: the prompt cache holds none of it.)
    messages = looking_at(GRADIENT, words="Cancel the encode of")
    prepared = vision.prepare(request(None, messages=messages, max_tokens=4))
    outcome, _ = run(vision, prepared, cancel=cancel)
    assert outcome is None  # cancelled: no end from the engine
    assert engine.stats["images_encoded"] == encoded + 1
    # Only the text before the image was decoded (the prompt's first part).
    assert engine.stats["prompt_tokens_decoded"] - decoded < IMAGE_TOKENS
    monkeypatch.undo()
    assert answer(vision, looking_at(GRADIENT))[0].reason == "length"  # serving on


def test_a_cancel_during_an_images_decode_aborts_it_and_the_engine_serves_on(
    vision: LlamaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = vision.engine
    assert engine is not None and engine.images is not None
    images = engine.images
    cancel = CancelEvent()
    decode = images.decode
    statuses: list[int] = []

    def cancelled_meanwhile(*args: Any) -> int:
        cancel.set()  # the job is in flight: its cancel raises the abort flag
        statuses.append(decode(*args))
        return statuses[-1]

    monkeypatch.setattr(images, "decode", cancelled_meanwhile)
    aborts = engine.stats["aborts"]
    messages = looking_at(BLUE, words="Cancel the decode of")
    prepared = vision.prepare(request(None, messages=messages, max_tokens=4))
    outcome, _ = run(vision, prepared, cancel=cancel)
    assert outcome is None
    assert statuses == [2] and engine.stats["aborts"] == aborts + 1
    monkeypatch.undo()
    _, blue = answer(vision, messages)
    _, blue_again = answer(vision, messages)
    assert blue == blue_again  # no half-written cells reused


def four_a_step(tiny_gguf: Path, mmproj: Path) -> Any:
    """The tiny vision pair on two sequences, a fixed share of 4 prompt
    positions a step beside a decoding one (the budget off): an image's 16
    embeddings go in 4 parts."""
    return loaded(
        tiny_gguf,
        mmproj=str(mmproj),
        n_ctx=512,
        parallel=2,
        prefill_budget=0,
        prefill_gap_ms=0,
        prefill_chunk=4,
    )


def test_an_images_embeddings_go_in_a_prompt_share_at_a_time_beside_a_decoding_stream(
    tiny_gguf: Path, mmproj: Path
) -> None:
    # A fixed share of 4 prompt tokens a step while another sequence decodes
    # (prefill_budget 0): the image's 16 embeddings go in 4 steps of 4, and
    # the stream beside it gets a token every step meanwhile.
    with four_a_step(tiny_gguf, mmproj) as backend:
        engine = backend.engine
        assert engine is not None and engine.images is not None
        images = engine.images
        decode = images.decode
        parts: list[tuple[int, int]] = []  # (embeddings, the stream's tokens so far)
        stream_started = threading.Event()
        stream = RecordingSink(on_offer=lambda sink: stream_started.set())

        def recorded(embeddings: Any, offset: int, count: int, seq: int, pos: int) -> int:
            parts.append((count, stream.tokens))
            return decode(embeddings, offset, count, seq, pos)

        images.decode = recorded  # type: ignore[method-assign]
        long = Running(backend, request("Once upon a time", id="long", max_tokens=400), stream)
        assert stream_started.wait(timeout(10))
        prepared = backend.prepare(request(None, id="img", messages=looking_at(RED)))
        outcome, _ = run(backend, prepared)
        long.cancel.set()
        long.wait()
    assert outcome.reason == "length"
    assert [count for count, _ in parts] == [4, 4, 4, 4]
    seen = [tokens for _, tokens in parts]
    assert seen == sorted(seen) and len(set(seen)) == 4  # the stream moved between parts


# ---------------------------------------------------------------- OpenAI's chat API


def data_url(image: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(image).decode()


def chat_body(*parts: dict[str, Any], model: str = "seer") -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Look at"}, *parts]}],
    }


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def seer_config(tiny_gguf: Path, mmproj: Path) -> Any:
    return llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=512,
        backend__llama__models=[{"name": "seer", "model": str(tiny_gguf), "mmproj": str(mmproj)}],
    )


async def test_an_image_url_part_is_read_and_its_tokens_counted(
    seer_config: Any, tiny_gguf: Path, mmproj: Path
) -> None:
    async with running_server(seer_config) as server:
        status, body = await post(
            server, "/v1/chat/completions", chat_body(image_part(data_url(RED)))
        )
    assert status == 200, body
    messages = (Message("user", f"Look at{IMAGE_MARKER}", images=(RED,)),)
    prompt_tokens, expected = helper_answer(tiny_gguf, mmproj, messages)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["choices"][0]["message"]["content"] == expected


BOMB = png_header_only(50_000, 50_000)
REFUSALS = {
    "http": (image_part("https://example.com/cat.png"), "not fetched"),
    "not a data url": (image_part("file:///etc/passwd"), "expected a data URL"),
    "bad base64": (image_part("data:image/png;base64,!!!"), "not valid base64"),
    "empty": (image_part("data:image/png;base64,"), "the image is empty"),
    "not an image": (image_part(data_url(b"GIF8 but no")), "not a PNG, JPEG, GIF or BMP"),
    "webp": (image_part(data_url(b"RIFF\x00\x00\x00\x00WEBPVP8 ", "webp")), "not a PNG"),
    "zero size": (image_part(data_url(png_header_only(0, 32))), "0x32 pixels"),
    "bomb": (image_part(data_url(BOMB)), "claims 50000x50000 pixels"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
async def test_bad_images_are_refused_with_400_naming_the_image(
    seer_config: Any, case: str
) -> None:
    part, said = REFUSALS[case]
    async with running_server(seer_config) as server:
        # The bad image is the second: its index is 1.
        body = chat_body(image_part(data_url(RED)), part)
        status, answer = await post(server, "/v1/chat/completions", body)
        assert status == 400, answer
        message = answer["error"]["message"]
        assert "image 1" in message and said in message, message
        # The server serves on.
        status, fine = await post(server, "/v1/chat/completions", chat_body())
        assert status == 200, fine


async def test_too_many_images_a_text_only_model_and_a_typed_marker_are_refused(
    seer_config: Any,
) -> None:
    async with running_server(seer_config) as server:
        many = [image_part(data_url(RED))] * (MAX_IMAGES + 1)
        status, answer = await post(server, "/v1/chat/completions", chat_body(*many))
        assert status == 400 and f"image {MAX_IMAGES}: at most" in answer["error"]["message"]
        to_text = chat_body(image_part(data_url(RED)), model=TINY_MODEL)
        status, answer = await post(server, "/v1/chat/completions", to_text)
        assert status == 400 and "image 0" in answer["error"]["message"]
        assert "takes no images" in answer["error"]["message"]
        typed = chat_body(image_part(data_url(RED)), {"type": "text", "text": IMAGE_MARKER})
        status, answer = await post(server, "/v1/chat/completions", typed)
        assert status == 400 and IMAGE_MARKER in answer["error"]["message"]
        corrupt = RED[:40] + b"\x00" * 20 + RED[60:]
        bad_pixels = chat_body(image_part(data_url(corrupt)))
        status, answer = await post(server, "/v1/chat/completions", bad_pixels)
        assert status == 400 and "image 0" in answer["error"]["message"], answer


# ---------------------------------------------------------------- the other wires


def b64(image: bytes) -> str:
    return base64.b64encode(image).decode()


def anthropic_body(image: bytes | None) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [{"type": "text", "text": "Look at"}]
    if image is not None:
        source = {"type": "base64", "media_type": "image/png", "data": b64(image)}
        blocks.append({"type": "image", "source": source})
    return {"model": "seer", "max_tokens": 8, "messages": [{"role": "user", "content": blocks}]}


def ollama_chat_body(image: bytes | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "user", "content": "Look at"}
    if image is not None:
        message["images"] = [b64(image)]
    return {"model": "seer", "stream": False, "messages": [message], "options": {"num_predict": 8}}


def ollama_generate_body(image: bytes | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "seer",
        "stream": False,
        "prompt": "Look at",
        "options": {"num_predict": 8},
    }
    if image is not None:
        body["images"] = [b64(image)]
    return body


def responses_body(image: bytes | None) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "input_text", "text": "Look at"}]
    if image is not None:
        parts.append({"type": "input_image", "image_url": data_url(image)})
    return {
        "model": "seer",
        "max_output_tokens": 8,
        "input": [{"role": "user", "content": parts}],
    }


def openai_body(image: bytes | None) -> dict[str, Any]:
    return chat_body(*([image_part(data_url(image))] if image is not None else []))


WIRES = {
    "openai chat": ("/v1/chat/completions", openai_body, "usage.prompt_tokens"),
    # Anthropic's input_tokens leave out what the prompt cache held.
    "anthropic": ("/v1/messages", anthropic_body, "usage.input_tokens+cache_read_input_tokens"),
    "ollama chat": ("/api/chat", ollama_chat_body, "prompt_eval_count"),
    "ollama generate": ("/api/generate", ollama_generate_body, "prompt_eval_count"),
    "responses": ("/v1/responses", responses_body, "usage.input_tokens"),
}


def dig(body: Any, path: str) -> int:
    """The count at ``path`` (``a.b``; ``a.b+c``: ``a.b`` plus ``a.c``)."""
    head, _, more = path.partition("+")
    *parents, last = head.split(".")
    for key in parents:
        body = body[key]
    return int(body[last]) + (int(body.get(more) or 0) if more else 0)


def error_text(body: Any) -> str:
    error = body["error"]
    return error if isinstance(error, str) else str(error["message"])


@pytest.mark.parametrize("wire", sorted(WIRES))
async def test_every_wire_takes_an_image_and_refuses_a_bad_one_by_index(
    seer_config: Any, wire: str
) -> None:
    path, body_of, usage = WIRES[wire]
    async with running_server(seer_config) as server:
        status, text_only = await post(server, path, body_of(None))
        assert status == 200, text_only
        status, red = await post(server, path, body_of(RED))
        assert status == 200, red
        assert dig(red, usage) - dig(text_only, usage) >= IMAGE_TOKENS
        status, refused = await post(server, path, body_of(BOMB))
        assert status == 400, refused
        assert "image 0" in error_text(refused) and "50000x50000" in error_text(refused)


async def test_a_responses_conversation_keeps_its_image_for_the_next_turn(
    seer_config: Any,
) -> None:
    async with running_server(seer_config) as server:
        status, first = await post(server, "/v1/responses", responses_body(RED))
        assert status == 200, first
        follow_up = {
            "model": "seer",
            "max_output_tokens": 8,
            "previous_response_id": first["id"],
            "input": "And now?",
        }
        status, second = await post(server, "/v1/responses", follow_up)
        assert status == 200, second
        # The earlier turn's image is read again (its tokens counted), and so
        # is everything else of that turn.
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 2
        many = {
            **follow_up,
            "previous_response_id": second["id"],
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": data_url(RED)}] * MAX_IMAGES,
                }
            ],
        }
        status, refused = await post(server, "/v1/responses", many)
        assert status == 400, refused  # the conversation's images together: one too many
        assert f"image {MAX_IMAGES}" in refused["error"]["message"]
