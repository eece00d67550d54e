"""Audio through the llama engine, on the tiny text model and tiny whisper projectors.

The engine's own path — libmtmd decodes the sound (miniaudio), splits it into
30 s windows of mel frames, the engine encodes each window and decodes its
embeddings into the sequence beside other sequences — against libmtmd's
helper path on a plain context (``tests/mtmd_reference.py``): the same
greedy text, token for token, and the same prompt tokens. Then OpenAI's chat
API with ``input_audio`` parts (the official SDK), and what is refused,
naming the part: sounds that do not decode, sounds to a model without an
audio encoder.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp.mtmd_cpp")

import openai
from conftest import TINY_MODEL, running_server, timeout
from mtmd_reference import helper_greedy
from test_anthropic_http import post
from test_images_llama import answer, helper_answer, looking_at
from test_llama_backend import llama_config, loaded, request, run
from tiny_audio import AUDIO_TOKENS, sine_wav, write_tiny_audio_mmproj
from tiny_images import solid_png
from tiny_mmproj import write_tiny_mmproj

from wsserver.backends.base import CancelEvent
from wsserver.backends.llama import LlamaBackend
from wsserver.backends.llama_chat import plain_chat_prompt
from wsserver.core.chat_input import Message
from wsserver.core.images import IMAGE_MARKER

LOW = sine_wav(220.0)
HIGH = sine_wav(1760.0)
#: A silent MP3 built by hand (no encoder here): MPEG-1 layer III frames,
#: 128 kbit/s at 44.1 kHz, all side information zero — minimp3 decodes each
#: to 1,152 samples of silence.
MP3_FRAME = bytes([0xFF, 0xFB, 0x90, 0x00]) + b"\x00" * 413
#: MPEG-2.5 layer III at 8 kbit/s, 8 kHz: 72 bytes for 72 ms.
SMALL_MP3_FRAME = bytes([0xFF, 0xE3, 0x18, 0x00]) + b"\x00" * 68
WINDOW = AUDIO_TOKENS["ultravox"]


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_audio_mmproj(tmp_path_factory.mktemp("audio") / "ultravox.mmproj.gguf")


@pytest.fixture(scope="module")
def hearing(tiny_gguf: Path, mmproj: Path) -> Iterator[LlamaBackend]:
    with loaded(tiny_gguf, mmproj=str(mmproj), n_ctx=1024, parallel=2) as backend:
        yield backend


def hearing_(*sounds: bytes, words: str = "Listen to") -> tuple[Message, ...]:
    """One user message asking about ``sounds`` (at their markers)."""
    return looking_at(*sounds, words=words)


# ---------------------------------------------------------------- the engine


def test_the_projector_loads_and_says_audio(hearing: LlamaBackend) -> None:
    assert hearing.vision is not None
    assert hearing.vision.projector.audio and not hearing.vision.projector.vision
    assert hearing.input_modalities() == ("text", "audio")


def test_the_engine_reads_a_sound_as_libmtmds_helper_does(
    hearing: LlamaBackend, tiny_gguf: Path, mmproj: Path
) -> None:
    assert hearing.vocab is not None
    for sounds in ((LOW,), (LOW, HIGH)):
        messages = hearing_(*sounds)
        outcome, text = answer(hearing, messages)
        prompt_tokens, expected = helper_answer(tiny_gguf, mmproj, messages)
        assert outcome.reason == "length"
        # Each sound is one 30 s window of the projector's embeddings.
        assert outcome.prompt_tokens == prompt_tokens > WINDOW * len(sounds)
        assert text == expected
        asked = request(None, messages=messages, max_tokens=12, logprobs=0)
        _, sink = run(hearing, hearing.prepare(asked))
        reference = helper_greedy(
            tiny_gguf, mmproj, plain_chat_prompt(messages), sounds, n=12, n_ctx=1024
        )
        assert [entry.bytes for entry in sink.logprobs] == [
            hearing.vocab.piece(token) for token in reference.tokens
        ]


def test_a_sound_changes_the_answer_and_the_same_sound_gives_the_same(
    hearing: LlamaBackend,
) -> None:
    _, low = answer(hearing, hearing_(LOW))
    _, low_again = answer(hearing, hearing_(LOW))
    _, high = answer(hearing, hearing_(HIGH))
    _, text_only = answer(hearing, (Message("user", "Listen to please"),))
    assert low == low_again
    assert len({low, high, text_only}) == 3


def test_the_same_samples_are_the_same_key_and_a_reused_prefix_skips_the_encode(
    hearing: LlamaBackend,
) -> None:
    # The same tone as a stereo WAV: other bytes, the same mono samples once
    # miniaudio has mixed it down — the key is a hash of the decoded samples.
    stereo = sine_wav(220.0, channels=2)
    assert stereo != LOW
    words = "Hear the same"
    one, first = answer(hearing, hearing_(LOW, words=words))
    before = hearing.stats()
    two, second = answer(hearing, hearing_(stereo, words=words))
    after = hearing.stats()
    assert first == second and one.prompt_tokens == two.prompt_tokens
    assert after["images_encoded"] == before["images_encoded"]  # reused, not encoded
    assert after["images_reused"] - before["images_reused"] == 1


def test_a_cancel_during_a_windows_encode_lands_before_its_embeddings_are_decoded(
    hearing: LlamaBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = hearing.engine
    assert engine is not None and engine.images is not None
    images = engine.images
    cancel = CancelEvent()
    encode = images.encode
    kinds: list[str] = []

    def cancelled_meanwhile(span: Any) -> Any:
        kinds.append(span.kind)
        cancel.set()
        return encode(span)

    monkeypatch.setattr(images, "encode", cancelled_meanwhile)
    decoded = engine.stats["prompt_tokens_decoded"]
    messages = hearing_(sine_wav(330.0), words="Cancel the encode of")
    outcome, _ = run(
        hearing, hearing.prepare(request(None, messages=messages, max_tokens=4)), cancel=cancel
    )
    assert outcome is None and kinds == ["sound"]
    assert engine.stats["prompt_tokens_decoded"] - decoded < WINDOW  # the text before it only
    monkeypatch.undo()
    assert answer(hearing, messages)[0].reason == "length"  # serving on


def test_a_sound_that_does_not_decode_is_refused_naming_it(hearing: LlamaBackend) -> None:
    broken = b"ID3" + b"\x00" * 64  # an MP3's magic, no frame
    prepared = hearing.prepare(request(None, messages=hearing_(LOW, broken), max_tokens=4))
    outcome, _ = run(hearing, prepared)
    assert outcome.reason == "error" and outcome.error_code == "bad_request"
    assert "audio 1: its sound could not be decoded" in (outcome.error_message or "")
    assert answer(hearing, hearing_(LOW))[0].reason == "length"  # serving on


def test_an_mp3_is_decoded_as_its_frames_say(
    hearing: LlamaBackend, tiny_gguf: Path, mmproj: Path
) -> None:
    # 1,300 frames: 33.96 s, two 30 s windows (libmtmd pads 30 s of silence).
    silence = MP3_FRAME * 1300
    messages = hearing_(silence)
    outcome, text = answer(hearing, messages)
    prompt_tokens, expected = helper_answer(tiny_gguf, mmproj, messages)
    assert outcome.reason == "length" and text == expected
    assert outcome.prompt_tokens == prompt_tokens > 2 * WINDOW


def test_qwen2a_loads_and_matches_the_helper(tiny_gguf: Path, tmp_path: Path) -> None:
    qwen = write_tiny_audio_mmproj(tmp_path / "qwen2a.gguf", projector_type="qwen2a")
    messages = hearing_(HIGH)
    with loaded(tiny_gguf, mmproj=str(qwen), n_ctx=2048) as backend:
        outcome, text = answer(backend, messages, n=6)
    run_ = helper_greedy(tiny_gguf, qwen, plain_chat_prompt(messages), [HIGH], n=6, n_ctx=2048)
    assert outcome.prompt_tokens == run_.prompt_tokens > AUDIO_TOKENS["qwen2a"]
    from llama_cpp import Llama

    llm = Llama(str(tiny_gguf), n_ctx=64, verbose=False, vocab_only=True)
    try:
        pieces = b"".join(llm.detokenize([t], special=False) for t in run_.tokens)
    finally:
        llm.close()
    assert text == pieces.decode("utf-8", errors="ignore")


# ---------------------------------------------------------------- OpenAI's chat API


def audio_part(sound: bytes, kind: str = "wav") -> dict[str, Any]:
    data = base64.b64encode(sound).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": kind}}


def chat_body(*parts: dict[str, Any], model: str = "listener") -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hear"}, *parts]}],
    }


@pytest.fixture(scope="module")
def listener_config(tiny_gguf: Path, mmproj: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    seer = write_tiny_mmproj(tmp_path_factory.mktemp("seer") / "seer.mmproj.gguf")
    models = [
        {"name": "listener", "model": str(tiny_gguf), "mmproj": str(mmproj)},
        {"name": "seer", "model": str(tiny_gguf), "mmproj": str(seer)},
    ]
    return llama_config(
        tiny_gguf,
        backend__llama__parallel=1,
        backend__llama__n_ctx=1024,
        backend__llama__models=models,
    )


async def test_the_openai_sdk_sends_an_input_audio_part_and_its_tokens_are_counted(
    listener_config: Any, tiny_gguf: Path, mmproj: Path
) -> None:
    async with running_server(listener_config) as server:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1",
            api_key="none",
            max_retries=0,
            timeout=timeout(30),
        )
        try:
            data = base64.b64encode(LOW).decode()
            completion = await client.chat.completions.create(
                model="listener",
                max_tokens=12,
                temperature=0,
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Hear"},
                            {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                        ],
                    }
                ],
            )
            models = {m.id: m for m in (await client.models.list()).data}
        finally:
            await client.close()
    messages = (Message("user", f"Hear{IMAGE_MARKER}", images=(LOW,)),)
    prompt_tokens, expected = helper_answer(tiny_gguf, mmproj, messages)
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == prompt_tokens > WINDOW
    assert completion.choices[0].message.content == expected
    listed = models["listener"].model_dump()
    assert listed.get("input_modalities") == ["text", "audio"], listed


def wav_header_claiming(seconds: int, rate: int = 16000) -> bytes:
    """A WAV whose header claims ``seconds`` of 16-bit mono and holds them all."""
    size = seconds * rate * 2
    import struct

    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + size)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", size)
        + b"\x00" * size
    )


REFUSALS = {
    "bad base64": (
        {"type": "input_audio", "input_audio": {"data": "!!", "format": "wav"}},
        "not valid base64",
    ),
    "empty": (audio_part(b""), "the audio is empty"),
    "not audio": (audio_part(solid_png((1, 2, 3))), "not a WAV, MP3 or FLAC"),
    "wrong format": (audio_part(LOW, "mp3"), "input_audio.format is mp3, its bytes are wav"),
    "ogg": (audio_part(LOW, "ogg"), "format must be one of wav, mp3, flac"),
    "cut short": (audio_part(LOW[:-100]), "claims 32000 bytes and holds 31900"),
    "too long": (audio_part(wav_header_claiming(301, rate=2)), "claims 301.0 s"),
    "mp3 too long": (audio_part(SMALL_MP3_FRAME * 4200, "mp3"), "mp3 header claims over 299.0 s"),
    "no frame": (
        audio_part(b"ID3\x03\x00\x00\x00\x00\x00\x00" + b"\x00" * 32, "mp3"),
        "without a frame",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
async def test_bad_audio_is_refused_with_400_naming_the_part(
    listener_config: Any, case: str
) -> None:
    part, said = REFUSALS[case]
    async with running_server(listener_config) as server:
        # The bad sound is the second: its index is 1.
        status, answer_ = await post(
            server, "/v1/chat/completions", chat_body(audio_part(LOW), part)
        )
        assert status == 400, answer_
        message = answer_["error"]["message"]
        assert "audio 1" in message and said in message, message


async def test_audio_to_a_text_or_vision_model_is_refused_naming_the_part(
    listener_config: Any,
) -> None:
    red = base64.b64encode(solid_png((255, 0, 0))).decode()
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + red}}
    async with running_server(listener_config) as server:
        for model in (TINY_MODEL, "seer"):
            body = chat_body(audio_part(LOW), model=model)
            status, answer_ = await post(server, "/v1/chat/completions", body)
            assert status == 400, answer_
            message = answer_["error"]["message"]
            assert "audio 0" in message and "takes no audio" in message, message
        # An image to the audio-only model, once it is loaded.
        status, _ = await post(server, "/v1/chat/completions", chat_body(audio_part(LOW)))
        assert status == 200
        status, answer_ = await post(server, "/v1/chat/completions", chat_body(image))
        assert status == 400 and "image 0" in answer_["error"]["message"], answer_
        assert "takes no images" in answer_["error"]["message"]


async def test_the_responses_and_anthropic_wires_refuse_audio_saying_so(
    listener_config: Any,
) -> None:
    data = base64.b64encode(LOW).decode()
    responses = {
        "model": "listener",
        "max_output_tokens": 8,
        "input": [{"role": "user", "content": [audio_part(LOW)]}],
    }
    anthropic = {
        "model": "listener",
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "audio", "source": {"type": "base64", "data": data}}],
            }
        ],
    }
    async with running_server(listener_config) as server:
        status, answer_ = await post(server, "/v1/responses", responses)
        assert status == 400 and "'input_audio' are not supported" in str(answer_), answer_
        status, answer_ = await post(server, "/v1/messages", anthropic)
        assert status == 400 and "blocks of type 'audio' are not supported" in str(answer_)
