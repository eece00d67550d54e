"""Images judged from their headers, before any decoder sees them (sans-I/O)."""

from __future__ import annotations

import base64
import re
import struct

import pytest
from tiny_images import gradient_png, png_header_only, solid_png

from wsserver.core.chat_input import Message
from wsserver.core.images import (
    IMAGE_MARKER,
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES,
    ImageBudget,
    image_size,
    with_images,
)
from wsserver.errors import ProtocolError


def fail(message: str) -> ProtocolError:
    return ProtocolError("bad_request", message)


def jpeg_header(width: int, height: int) -> bytes:
    app0 = (
        b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + b"\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    )
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x00" * 9
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


def test_the_header_says_format_and_size() -> None:
    assert image_size(solid_png((1, 2, 3), size=7)) == ("png", 7, 7)
    assert image_size(gradient_png(40, 24)) == ("png", 40, 24)
    assert image_size(jpeg_header(640, 480)) == ("jpeg", 640, 480)
    assert image_size(b"GIF89a" + struct.pack("<HH", 5, 6) + b"\x00") == ("gif", 5, 6)
    bmp = b"BM" + b"\x00" * 16 + struct.pack("<ii", 9, -4)
    assert image_size(bmp) == ("bmp", 9, 4)
    assert image_size(b"RIFF\x00\x00\x00\x00WEBPVP8 ") is None
    assert image_size(b"\x89PNG\r\n\x1a\n\x00") is None  # cut short
    assert image_size(b"\xff\xd8\xff\xe0\x00\x10JFIF") is None  # no frame header


def test_a_budget_counts_checks_and_names_each_image_by_index() -> None:
    budget = ImageBudget(fail)
    red = solid_png((255, 0, 0))
    assert budget.take(red, "a") == red
    assert budget.from_base64(base64.b64encode(red).decode(), "b") == red
    url = "data:image/png;base64," + base64.b64encode(red).decode()
    assert budget.from_url(url, "c") == red
    assert (budget.count, budget.bytes) == (3, 3 * len(red))
    for bad, said in [
        (b"", "image 3 (d): the image is empty"),
        (b"not an image", "image 3 (d): not a PNG, JPEG, GIF or BMP"),
        (png_header_only(0, 10), "image 3 (d): a png of 0x10 pixels"),
        (png_header_only(50_000, 50_000), "claims 50000x50000 pixels"),
        (png_header_only(20_000, 10), "claims 20000x10 pixels"),
    ]:
        with pytest.raises(ProtocolError, match=re.escape(said)):
            budget.take(bad, "d")
    with pytest.raises(ProtocolError, match="not fetched"):
        budget.from_url("http://127.0.0.1/secret.png", "e")
    with pytest.raises(ProtocolError, match="expected a data URL"):
        budget.from_url("data:image/png,raw", "e")
    with pytest.raises(ProtocolError, match="not valid base64"):
        budget.from_base64("a b c", "e")


def test_a_requests_images_are_bounded_in_count_bytes_and_pixels() -> None:
    budget = ImageBudget(fail)
    red = solid_png((255, 0, 0))
    for _ in range(MAX_IMAGES):
        budget.take(red, "x")
    with pytest.raises(ProtocolError, match=f"image {MAX_IMAGES}: at most {MAX_IMAGES}"):
        budget.take(red, "x")
    big = ImageBudget(fail)
    with pytest.raises(ProtocolError, match=f"exceed {MAX_IMAGE_BYTES} bytes"):
        big.from_base64("A" * (MAX_IMAGE_BYTES * 4 // 3 + 8), "x")
    many = ImageBudget(fail)
    half = png_header_only(4096, 4096)  # half the pixels a request may claim
    many.take(half, "x")
    many.take(half, "x")
    assert many.pixels == MAX_IMAGE_PIXELS
    with pytest.raises(ProtocolError, match=r"image 2 .* pixels together"):
        many.take(solid_png((0, 0, 0), size=2), "x")


def test_markers_must_match_the_images_and_only_a_user_shows_one() -> None:
    red = solid_png((255, 0, 0))
    messages = (Message("system", "s"), Message("user", f"a {IMAGE_MARKER} b"))
    carried = with_images(messages, {1: [red]}, fail)
    assert carried[1].images == (red,) and carried[0].images == ()
    typed = (Message("user", f"{IMAGE_MARKER}{IMAGE_MARKER}"),)
    with pytest.raises(ProtocolError, match="marks an image's place"):
        with_images(typed, {0: [red]}, fail)
    elsewhere = (Message("user", "x"), Message("system", IMAGE_MARKER))
    with pytest.raises(ProtocolError, match=r"messages\[1\]: only a user message"):
        with_images(elsewhere, {1: [red]}, fail)
