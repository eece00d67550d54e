"""Small encoded images for tests, written without an imaging library.

PNG is simple enough to write by hand (a header, one zlib stream of filtered
rows, a CRC per chunk), so the tests need no Pillow: :func:`png` draws any
size from a pixel function, :func:`png_header_only` claims any size without
the pixels (a decompression bomb's header: what the server must refuse before
decoding).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

__all__ = ["gradient_png", "png", "png_header_only", "solid_png"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _ihdr(width: int, height: int) -> bytes:
    # 8 bits per channel, colour type 2 (RGB), no interlace.
    return _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))


def png(width: int, height: int, pixel: Callable[[int, int], tuple[int, int, int]]) -> bytes:
    """An RGB PNG of ``width`` x ``height``, ``pixel(x, y)`` its colours."""
    rows = b"".join(
        b"\x00" + b"".join(bytes(pixel(x, y)) for x in range(width)) for y in range(height)
    )
    return (
        _SIGNATURE
        + _ihdr(width, height)
        + _chunk(b"IDAT", zlib.compress(rows))
        + _chunk(b"IEND", b"")
    )


def solid_png(colour: tuple[int, int, int], size: int = 32) -> bytes:
    """A square PNG of one colour."""
    return png(size, size, lambda _x, _y: colour)


def gradient_png(width: int = 40, height: int = 24) -> bytes:
    """A PNG whose every pixel differs from its neighbours."""
    return png(width, height, lambda x, y: (x * 6 % 256, y * 10 % 256, (x * y) % 256))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` and holds one tiny pixel stream."""
    return (
        _SIGNATURE
        + _ihdr(width, height)
        + _chunk(b"IDAT", zlib.compress(b"\x00"))
        + _chunk(b"IEND", b"")
    )
