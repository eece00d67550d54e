"""A sound's bytes judged from their header: its format and its length (sans-I/O).

libmtmd decodes audio with miniaudio (``mtmd_helper_bitmap_init_from_buf``:
WAV, MP3, FLAC, told from an image by the same magic bytes as
:func:`is_audio`), resampled to the projector's rate (16 kHz for the checked
types) as 32-bit float samples — and sizes its buffer from what the header
claims. A FLAC of a few kilobytes may claim hours, a WAV at 1 Hz stretches
a second of bytes into days at 16 kHz: a decompression bomb. So the length
is read here, before any decoder sees the bytes, and bounded
(:data:`MAX_AUDIO_SECONDS`, in :class:`~.image_check.ImageBudget`):

* WAV: its ``fmt`` chunk (PCM, IEEE float, A-law, μ-law) and its ``data``
  chunk's size — which must be there, whole, within the first
  :data:`_MAX_WAV_CHUNKS` chunks;
* MP3: every frame header walked (MPEG 1, 2 and 2.5, layers I to III),
  the samples of each counted at its rate; free-format streams (no bitrate
  in the header: their length cannot be read from headers) are refused, and
  at most :data:`_MAX_SKIP` bytes between frames (tags, junk) are skipped;
* FLAC: STREAMINFO's sample rate and total samples (a stream that does not
  say its length is refused).
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = [
    "AUDIO_FORMATS",
    "MAX_AUDIO_SECONDS",
    "PCM_BYTES_PER_SECOND",
    "audio_format",
    "audio_length",
    "is_audio",
]

#: The formats a wire may name (OpenAI's ``input_audio.format``: wav, mp3).
AUDIO_FORMATS: Final = ("wav", "mp3", "flac")

#: The seconds of sound one request may carry, all its clips together. libmtmd
#: reads a clip of n seconds as floor(n / 30) + 1 windows of 30 s (it pads 30 s
#: of silence): 300 s in one clip are 11 windows, 1,650 to 8,250 embeddings
#: with the checked types.
MAX_AUDIO_SECONDS: Final = 300
#: What a second of sound costs decoded: 16 kHz mono 32-bit float samples.
PCM_BYTES_PER_SECOND: Final = 16000 * 4

#: Bytes an MP3 walk may skip outside frames (ID3v1/APE tags, junk).
_MAX_SKIP: Final = 64 << 10
#: Chunks read in a WAV (a real one has a handful: fmt, data, LIST, fact…):
#: a 20 MiB file of empty 8-byte chunks would be 2.6 million of them, read
#: on the event loop.
_MAX_WAV_CHUNKS: Final = 64
#: WAV format tags taken, and the sample sizes (bits) each is taken with.
_WAV_FORMATS: Final = {1: (8, 16, 24, 32), 3: (32, 64), 6: (8,), 7: (8,)}


def is_audio(data: bytes) -> bool:
    """Whether libmtmd's helper takes these bytes for sound (its own test)."""
    if len(data) < 12:
        return False
    return (
        (data[:4] == b"RIFF" and data[8:12] == b"WAVE")
        or data[:3] == b"ID3"
        or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0)
        or data[:4] == b"fLaC"
    )


def audio_format(data: bytes) -> str:
    """The format :func:`is_audio` bytes are, by their magic."""
    if data[:4] == b"RIFF":
        return "wav"
    return "flac" if data[:4] == b"fLaC" else "mp3"


def audio_length(data: bytes, most: float) -> tuple[str, float] | str:
    """The format and the seconds the header claims (counting stops past
    ``most``), or why the length cannot be read."""
    if data[:4] == b"RIFF":
        return _wav(data)
    if data[:4] == b"fLaC":
        return _flac(data)
    return _mp3(data, most)


def _wav(data: bytes) -> tuple[str, float] | str:
    at, fmt = 12, None
    for _ in range(_MAX_WAV_CHUNKS):
        if at + 8 > len(data):
            return "a WAV without a data chunk (or cut short)"
        chunk, size = data[at : at + 4], struct.unpack("<I", data[at + 4 : at + 8])[0]
        body = data[at + 8 : at + 8 + size]
        if chunk == b"fmt " and len(body) >= 16:
            tag, channels, rate, _, align, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == 0xFFFE and len(body) >= 26:  # WAVE_FORMAT_EXTENSIBLE: its sub-format
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, channels, rate, align, bits)
        elif chunk == b"data":
            if fmt is None:
                return "a WAV whose data comes before its fmt chunk"
            tag, channels, rate, align, bits = fmt
            if tag not in _WAV_FORMATS:
                return f"a WAV of format {tag} (PCM, float, A-law or mu-law are taken)"
            # A header a WAV decoder would refuse is refused here: miniaudio
            # would go on to try the bytes as FLAC and MP3, whose length this
            # check did not read.
            if bits not in _WAV_FORMATS[tag] or not 1 <= channels <= 8 or not rate:
                return f"a WAV of {channels} channels of {bits}-bit samples at {rate} Hz"
            if align != channels * bits // 8:
                return f"a WAV whose frames are {align} bytes, not {channels * bits // 8}"
            if len(body) < size:
                return f"a WAV whose data chunk claims {size} bytes and holds {len(body)}"
            return "wav", size // align / rate
        at += 8 + size + (size & 1)
    return f"a WAV without a data chunk in its first {_MAX_WAV_CHUNKS} chunks"


def _flac(data: bytes) -> tuple[str, float] | str:
    # fLaC, then STREAMINFO: block header (4), block sizes (4), frame sizes
    # (6), then 20 bits of rate, 3 of channels, 5 of depth, 36 of samples.
    if len(data) < 8 + 18 or data[4] & 0x7F != 0:
        return "a FLAC without its STREAMINFO block"
    smallest, largest = struct.unpack(">HH", data[8:12])
    packed = int.from_bytes(data[18:26], "big")
    rate, total = packed >> 44, packed & ((1 << 36) - 1)
    bits = (packed >> 36 & 0x1F) + 1
    if not rate or not total:
        return "a FLAC that does not say its sample rate and length"
    # What a FLAC decoder refuses is refused here (see _wav).
    if smallest < 16 or largest < smallest or bits < 4:
        return f"a FLAC of blocks of {smallest} to {largest} samples of {bits} bits"
    return "flac", total / rate


_MP3_BITRATES: Final = {  # kbit/s by (MPEG-1?, layer), index 1..14
    (True, 1): (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_RATES: Final = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mp3(data: bytes, most: float) -> tuple[str, float] | str:
    at, seconds, skipped, frames = 0, 0.0, 0, 0
    if data[:3] == b"ID3" and len(data) >= 10:  # an ID3v2 tag: its syncsafe size
        size = 0
        for byte in data[6:10]:
            size = size << 7 | byte & 0x7F
        at = 10 + size + (10 if data[5] & 0x10 else 0)
    while at + 4 <= len(data) and seconds <= most:
        b1, b2 = data[at + 1], data[at + 2]
        version, layer = b1 >> 3 & 3, 4 - (b1 >> 1 & 3)
        bitrate, rate_index = b2 >> 4, b2 >> 2 & 3
        if data[at] != 0xFF or b1 & 0xE0 != 0xE0 or version == 1 or layer == 4:
            frame = 0  # not a frame header: resync
        elif rate_index == 3 or bitrate == 15:  # reserved values: not a frame either
            frame = 0
        elif bitrate == 0:
            return "a free-format MP3 (its length cannot be read from its headers)"
        else:
            mpeg1 = version == 3
            kbps = _MP3_BITRATES[(mpeg1, min(layer, 2) if not mpeg1 else layer)][bitrate - 1]
            rate, pad = _MP3_RATES[version][rate_index], b2 >> 1 & 1
            if layer == 1:
                frame, samples = (12 * kbps * 1000 // rate + pad) * 4, 384
            else:
                samples = 1152 if mpeg1 or layer == 2 else 576
                frame = samples // 8 * kbps * 1000 // rate + pad
            seconds += samples / rate
            frames += 1
        if frame:
            at += frame
            continue
        skipped += 1
        if skipped > _MAX_SKIP:
            break
        found = data.find(b"\xff", at + 1)
        if found < 0:
            break
        skipped += found - at - 1
        at = found
    if skipped > _MAX_SKIP:
        return f"an MP3 with over {_MAX_SKIP} bytes outside its frames"
    if not frames:
        return "an MP3 without a frame"
    return "mp3", seconds
