"""A sound's length read from its header, and a request's sounds bounded (sans-I/O).

miniaudio (inside libmtmd) sizes its buffer from what a header claims, at
16 kHz float samples: a FLAC of bytes claiming hours, or a WAV at 1 Hz, would
take the machine's memory. :mod:`wsserver.core.audio_check` reads the claim
first; :class:`~wsserver.core.image_check.ImageBudget` bounds it.
"""

from __future__ import annotations

import base64
import struct

import pytest
from tiny_audio import sine_wav
from tiny_images import solid_png

from wsserver.core.audio_check import MAX_AUDIO_SECONDS, audio_length, is_audio
from wsserver.core.frame_images import FrameImages
from wsserver.core.image_check import MAX_AUDIO, MAX_DECODED_BYTES, ImageBudget
from wsserver.errors import ProtocolError


def fail(message: str) -> ProtocolError:
    return ProtocolError("bad_request", message)


def wav(
    frames: int,
    *,
    rate: int = 16000,
    tag: int = 1,
    held: int | None = None,
    bits: int = 16,
    align: int = 2,
) -> bytes:
    size = frames * 2
    body = b"\x00" * (size if held is None else held)
    fmt = struct.pack("<HHIIHH", tag, 1, rate, rate * 2, align, bits)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + len(body))
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", size)
        + body
    )


def flac(rate: int, total: int, block: int = 4096) -> bytes:
    packed = rate << 44 | 0 << 41 | 15 << 36 | total
    info = struct.pack(">HH", block, block) + b"\x00" * 6 + packed.to_bytes(8, "big") + b"\x00" * 16
    return b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info


def mp3(frames: int, *, junk: bytes = b"") -> bytes:
    # MPEG-1 layer III, 128 kbit/s, 44.1 kHz, no padding: 417-byte frames of 1152 samples.
    header = bytes([0xFF, 0xFB, 0x90, 0x00])
    return junk + (header + b"\x00" * 413) * frames


def test_the_formats_and_their_lengths() -> None:
    assert audio_length(sine_wav(seconds=1.5), 300) == ("wav", 1.5)
    assert audio_length(flac(48000, 96000), 300) == ("flac", 2.0)
    kind, seconds = audio_length(mp3(100), 300)  # type: ignore[misc]
    assert kind == "mp3" and seconds == pytest.approx(100 * 1152 / 44100)
    id3 = b"ID3\x04\x00\x00\x00\x00\x01\x00" + b"\x00" * 128  # a 128-byte tag
    assert audio_length(id3 + mp3(10), 300)[1] == pytest.approx(10 * 1152 / 44100)  # type: ignore[index]
    assert all(is_audio(x) for x in (sine_wav(), flac(8000, 8000), mp3(1), id3))
    assert not is_audio(solid_png((1, 2, 3)))


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (wav(100, tag=2), "a WAV of format 2"),
        (wav(100, held=50), "claims 200 bytes and holds 50"),
        (wav(0, rate=0), "at 0 Hz"),
        (wav(10, bits=0), "of 0-bit samples"),
        (wav(10, align=4), "frames are 4 bytes, not 2"),
        (flac(16000, 100, block=1), "blocks of 1 to 1 samples"),
        (b"RIFF\x04\x00\x00\x00WAVE", "without a data chunk"),
        # Hostile: 2.6 million empty chunks in 20 MiB, read no further than 64.
        (b"RIFF\x00\x00\x00\x00WAVE" + b"junk\x00\x00\x00\x00" * (20 << 17), "first 64 chunks"),
        (flac(0, 100), "does not say its sample rate and length"),
        (flac(16000, 0), "does not say its sample rate and length"),
        (b"fLaC" + b"\x01" + b"\x00" * 40, "without its STREAMINFO"),
        (bytes([0xFF, 0xFB, 0x00, 0x00]) + b"\x00" * 64, "free-format MP3"),
        (b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\x00" * 64, "without a frame"),
        (bytes([0xFF, 0xFB]) + b"\xff" * (70 << 10), "bytes outside its frames"),
    ],
)
def test_a_length_that_cannot_be_read_is_said(data: bytes, said: str) -> None:
    found = audio_length(data, 300)
    assert isinstance(found, str) and said in found, found


def test_the_budget_bounds_seconds_clips_and_decoded_bytes_naming_the_clip() -> None:
    budget = ImageBudget(fail)
    # A WAV at 2 Hz: 602 bytes that would be 301 s — 19 MB of samples at 16 kHz.
    with pytest.raises(ProtocolError, match=r"audio 0 \(here\): its wav header claims 301.0 s"):
        budget.take_audio(wav(602, rate=2), "here")
    with pytest.raises(ProtocolError, match=r"audio 0 \(here\): its flac header claims 3600.0 s"):
        budget.take_audio(flac(16000, 16000 * 3600), "here")
    budget.take_audio(wav(200 * 8000, rate=8000), "here")  # 200 s
    with pytest.raises(ProtocolError, match=f"audio 1 .* at most {MAX_AUDIO_SECONDS} s together"):
        budget.take_audio(wav(101 * 8000, rate=8000), "here")
    assert budget.sounds == 1 and budget.count == 0  # images are counted apart
    for _ in range(MAX_AUDIO - 1):
        budget.take_audio(sine_wav(seconds=0.1), "here")
    with pytest.raises(ProtocolError, match=f"audio {MAX_AUDIO}: at most {MAX_AUDIO} audio"):
        budget.take_audio(sine_wav(seconds=0.1), "here")
    # Decoded bytes: images' pixels (3 bytes each) and sound samples together.
    budget = ImageBudget(fail)
    budget.pixels = MAX_DECODED_BYTES // 3 - 1000
    with pytest.raises(ProtocolError, match="decode to more than"):
        budget.take_audio(sine_wav(seconds=1.0), "here")


def test_a_frames_audio_takes_base64_data_urls_and_uploads_after_the_images() -> None:
    sound, image = sine_wav(seconds=0.2), solid_png((9, 9, 9))
    read = FrameImages(ImageBudget(fail), None)
    b64 = base64.b64encode(sound).decode()
    assert read([b64, "data:audio/wav;base64," + b64], "messages[0].audio", "audio") == (
        sound,
        sound,
    )
    with pytest.raises(ProtocolError, match=r"audio 2 \(messages\[0\].audio\[0\]\): not a WAV"):
        read([base64.b64encode(image).decode()], "messages[0].audio", "audio")
    with pytest.raises(ProtocolError, match=r"audio 2 .*a sound is a base64 string"):
        read([{"file": "x"}], "messages[0].audio", "audio")
    with pytest.raises(ProtocolError, match="at most 8 audio clips"):
        read([b64] * 9, "messages[0].audio", "audio")
