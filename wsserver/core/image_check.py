"""An image's bytes judged from their header, and a request's images bounded (sans-I/O).

Every wire's images end here (:class:`ImageBudget`): the bytes decoded from
base64 (or taken as they came, from a WebSocket upload), then judged **from
the header alone**, before any decoder sees them; :mod:`wsserver.core.images`
says what is refused and why. Apart from it so that the frame parser
(:mod:`wsserver.core.client_frames`) can use it without an import cycle.

An ``http(s)`` URL in a wire that may fetch (OpenAI's chat ``image_url``,
Anthropic's ``url`` source, the Responses API's ``input_image``) is an
:class:`ImageUrl`: counted as an image, its bytes not known. The parsers stay
sans-I/O; the asyncio layer fetches it before the request is submitted
(:mod:`wsserver.aio.image_fetch`, behind the operator's ``[images]``
allow-list: off by default, refused then with :func:`not_fetched`), and the
bytes go through :meth:`ImageBudget.take` as a data URL's do.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from ..errors import ProtocolError
from .audio_check import MAX_AUDIO_SECONDS, PCM_BYTES_PER_SECOND, audio_length, is_audio

__all__ = [
    "MAX_AUDIO",
    "MAX_DECODED_BYTES",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "MAX_URL_CHARS",
    "Fail",
    "ImageBudget",
    "ImageUrl",
    "image_size",
    "not_fetched",
]

#: Images per request, and their encoded bytes together.
MAX_IMAGES: Final = 8
MAX_IMAGE_BYTES: Final = 20 << 20
#: What a request's images' headers may claim together: 33.5 megapixels
#: (8192 x 4096; ~100 MB decoded as RGB), and no side over 16384.
MAX_IMAGE_PIXELS: Final = 8192 * 4096
MAX_IMAGE_SIDE: Final = 16384

#: The longest image URL taken (as browsers and most servers bound a URL).
MAX_URL_CHARS: Final = 8192
#: Sound clips per request (each at a marker, like an image).
MAX_AUDIO: Final = 8
#: What a request's images and sounds may take decoded together: its
#: images' pixels as RGB plus its sounds' samples (docs/images.md).
MAX_DECODED_BYTES: Final = MAX_IMAGE_PIXELS * 3

Fail = Callable[[str], ProtocolError]


@dataclass(frozen=True, slots=True)
class ImageUrl:
    """An ``http(s)`` image URL a request gave: fetched before the request
    runs, or refused (the image's ``index`` in the request, ``where`` its field)."""

    url: str
    index: int
    where: str

    def refusal(self, why: str) -> str:
        """A refusal of this image, naming it as every image refusal does."""
        return f"image {self.index} ({self.where}): {why}"


def not_fetched(image: ImageUrl) -> str:
    """The refusal of an image URL on a server that fetches none."""
    return image.refusal(
        "http(s) image URLs are not fetched by this server (a server-side request "
        "forgery risk; an operator may allow hosts: [images] fetch_hosts); send the "
        "image as a data: URL (data:image/png;base64,...)"
    )


_PNG: Final = b"\x89PNG\r\n\x1a\n"
#: JPEG's start-of-frame markers (the frame header holds the size); C4, C8
#: and CC are other segments.
_JPEG_SOF: Final = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:  # no length
            at += 2
            continue
        (length,) = struct.unpack(">H", data[at + 2 : at + 4])
        if marker in _JPEG_SOF:
            if at + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[at + 5 : at + 9])
            return width, height
        at += 2 + length
    return None


def image_size(data: bytes) -> tuple[str, int, int] | None:
    """The format and the size an image's header claims; ``None``: not a
    PNG, JPEG, GIF or BMP, or a header cut short."""
    if data.startswith(_PNG) and len(data) >= 24 and data[12:16] == b"IHDR":
        width, height = struct.unpack(">II", data[16:24])
        return "png", width, height
    if data.startswith(b"\xff\xd8"):
        size = _jpeg_size(data)
        return ("jpeg", *size) if size is not None else None
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return "gif", width, height
    if data.startswith(b"BM") and len(data) >= 26:
        width, height = struct.unpack("<ii", data[18:26])
        return "bmp", abs(width), abs(height)
    return None


class ImageBudget:
    """A request's images as they are read, in order: each checked, the
    request's count and bytes bounded. ``fail`` makes the wire's error."""

    def __init__(self, fail: Fail) -> None:
        self.fail = fail
        self.count = 0
        self.bytes = 0
        self.pixels = 0
        #: Sound clips, apart from images (``audio 0`` is the first clip).
        self.sounds = 0
        self.seconds = 0.0

    def from_base64(self, text: object, where: str) -> bytes:
        """An image given as base64 text (``where`` names its field)."""
        index = self.count
        if not isinstance(text, str):
            raise self.fail(f"image {index} ({where}): base64 data must be a string")
        self._room(index, len(text) * 3 // 4)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise self.fail(f"image {index} ({where}): not valid base64") from None
        return self.take(data, where)

    def from_url(self, url: object, where: str) -> bytes:
        """An image given as a URL: only ``data:image/…;base64,`` URLs."""
        index = self.count
        if not isinstance(url, str):
            raise self.fail(f"image {index} ({where}): the URL must be a string")
        if url.startswith(("http://", "https://")):
            raise self.fail(
                f"image {index} ({where}): http(s) image URLs are not fetched by this "
                "server (a server-side request forgery risk); send the image as a "
                "data: URL (data:image/png;base64,...)"
            )
        head, comma, payload = url.partition(",")
        if not comma or not head.startswith("data:") or not head.endswith(";base64"):
            raise self.fail(
                f"image {index} ({where}): expected a data URL (data:image/png;base64,...)"
            )
        return self.from_base64(payload, where)

    def url_or_data(self, url: object, where: str) -> bytes | ImageUrl:
        """An image given as a URL on a wire that may fetch: a ``data:`` URL's
        bytes, or an ``http(s)`` URL to fetch (counted as an image now)."""
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            return self.later(url, where)
        return self.from_url(url, where)

    def later(self, url: str, where: str) -> ImageUrl:
        """An ``http(s)`` image URL: counted; its bytes are checked once fetched."""
        index = self.count
        self._room(index, 0)
        if len(url) > MAX_URL_CHARS:
            raise self.fail(f"image {index} ({where}): the URL is over {MAX_URL_CHARS} characters")
        self.count += 1
        return ImageUrl(url, index, where)

    def take(self, data: bytes, where: str) -> bytes:
        """An image's bytes: counted, checked from their header."""
        index = self.count
        self._room(index, len(data))
        if not data:
            raise self.fail(f"image {index} ({where}): the image is empty")
        claimed = image_size(data)
        if claimed is None:
            raise self.fail(
                f"image {index} ({where}): not a PNG, JPEG, GIF or BMP image "
                "(or its header is cut short)"
            )
        kind, width, height = claimed
        if width == 0 or height == 0:
            raise self.fail(f"image {index} ({where}): a {kind} of {width}x{height} pixels")
        if width > MAX_IMAGE_SIDE or height > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
            raise self.fail(
                f"image {index} ({where}): its {kind} header claims {width}x{height} pixels; "
                f"at most {MAX_IMAGE_PIXELS} pixels and {MAX_IMAGE_SIDE} a side are decoded"
            )
        if (self.pixels + width * height) * 3 + self.seconds * PCM_BYTES_PER_SECOND > (
            MAX_DECODED_BYTES
        ):
            raise self.fail(
                f"image {index} ({where}): the request's images claim more than "
                f"{MAX_IMAGE_PIXELS} pixels together (3 bytes a pixel, with its audio's "
                f"samples at most {MAX_DECODED_BYTES} bytes)"
            )
        self.count += 1
        self.bytes += len(data)
        self.pixels += width * height
        return data

    def audio_from_base64(self, text: object, where: str) -> bytes:
        """A sound given as base64 text (``where`` names its field)."""
        index = self.sounds
        if not isinstance(text, str):
            raise self.fail(f"audio {index} ({where}): base64 data must be a string")
        self._audio_room(index, len(text) * 3 // 4)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise self.fail(f"audio {index} ({where}): not valid base64") from None
        return self.take_audio(data, where)

    def take_audio(self, data: bytes, where: str) -> bytes:
        """A sound's bytes: counted, its length read from its header and bounded
        (:mod:`.audio_check`); its decoded samples count against the request's
        decoded bytes beside its images' pixels."""
        index = self.sounds
        self._audio_room(index, len(data))
        if not data:
            raise self.fail(f"audio {index} ({where}): the audio is empty")
        if not is_audio(data):
            raise self.fail(
                f"audio {index} ({where}): not a WAV, MP3 or FLAC file (or its header is cut short)"
            )
        left = MAX_AUDIO_SECONDS - self.seconds
        length = audio_length(data, left)
        if isinstance(length, str):
            raise self.fail(f"audio {index} ({where}): {length}")
        kind, seconds = length
        if seconds > left:
            # (An MP3's frames are counted until they pass what is left.)
            claim = f"over {left:.1f} s" if kind == "mp3" else f"{seconds:.1f} s"
            raise self.fail(
                f"audio {index} ({where}): its {kind} header claims {claim}; a "
                f"request's audio is at most {MAX_AUDIO_SECONDS} s together ({left:.1f} s left)"
            )
        decoded = self.pixels * 3 + (self.seconds + seconds) * PCM_BYTES_PER_SECOND
        if decoded > MAX_DECODED_BYTES:
            raise self.fail(
                f"audio {index} ({where}): the request's images and audio decode to more than "
                f"{MAX_DECODED_BYTES} bytes together"
            )
        self.sounds += 1
        self.bytes += len(data)
        self.seconds += seconds
        return data

    def _audio_room(self, index: int, size: int) -> None:
        if index >= MAX_AUDIO:
            raise self.fail(f"audio {index}: at most {MAX_AUDIO} audio clips per request")
        if self.bytes + size > MAX_IMAGE_BYTES:
            raise self.fail(
                f"audio {index}: the request's images and audio exceed {MAX_IMAGE_BYTES} "
                "bytes together"
            )

    def _room(self, index: int, size: int) -> None:
        if index >= MAX_IMAGES:
            raise self.fail(f"image {index}: at most {MAX_IMAGES} images per request")
        if self.bytes + size > MAX_IMAGE_BYTES:
            raise self.fail(
                f"image {index}: the request's images exceed {MAX_IMAGE_BYTES} bytes together"
            )
