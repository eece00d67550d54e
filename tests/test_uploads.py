"""The WebSocket protocol's images, sans-I/O: binary-frame uploads and a
``generate``'s ``images`` (wsserver.core.uploads, wsserver.core.frame_images)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from tiny_images import png_header_only, solid_png

from wsserver.core.chat_input import IMAGE_MARKER
from wsserver.core.image_check import MAX_IMAGES
from wsserver.core.protocol import Generate, Limits, Restart, parse_client_frame
from wsserver.core.session import input_size
from wsserver.core.uploads import Uploads, parse_upload
from wsserver.errors import ProtocolError

RED = solid_png((255, 0, 0))
BLUE = solid_png((0, 0, 255))
LIMITS = Limits(max_upload_bytes=1 << 20)


def upload(uploads: Uploads, upload_id: str, data: bytes, pieces: int = 1) -> None:
    """``data`` as ``pieces`` binary frames of ``upload_id``."""
    size = -(-len(data) // pieces)
    for at in range(0, len(data), size):
        uploads.add(parse_upload(upload_id.encode() + b"\n" + data[at : at + size]))


def generate(*images: Any, content: str = "Look", role: str = "user", **more: Any) -> str:
    message: dict[str, Any] = {"role": role, "content": content, "images": list(images)}
    return json.dumps({"type": "generate", "id": "g1", "messages": [message], **more})


def parse(text: str, uploads: Uploads | None = None) -> Any:
    return parse_client_frame(text, LIMITS, uploads)


def refusal(text: str, uploads: Uploads | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        parse(text, uploads)
    return caught.value


def test_a_binary_frame_is_an_id_a_newline_and_bytes() -> None:
    chunk = parse_upload(b"img-1\n" + RED)
    assert chunk.id == "img-1" and chunk.data == RED
    assert parse_upload(b"a\n").data == b""
    for bad in (b"\n" + RED, RED, b"bad id\nxx", b"x" * 65 + b"\nxx", b"\xff\nxx"):
        with pytest.raises(ProtocolError) as caught:
            parse_upload(bad)
        assert caught.value.code == "bad_json" and "binary frame" in caught.value.message


def test_uploads_in_pieces_are_joined_and_named_by_a_generate() -> None:
    uploads = Uploads(1 << 20)
    upload(uploads, "a", RED, pieces=3)
    upload(uploads, "b", BLUE)
    assert uploads.bytes == len(RED) + len(BLUE) and len(uploads) == 2
    frame = parse(generate({"upload": "b"}, {"upload": "a"}), uploads)
    assert isinstance(frame, Generate) and frame.messages is not None
    (message,) = frame.messages
    # Before the text, in order.
    assert message.images == (BLUE, RED)
    assert message.content == IMAGE_MARKER * 2 + "Look"
    # The request took them: none are held any more.
    assert uploads.bytes == 0 and len(uploads) == 0
    assert input_size(frame) >= len(RED) + len(BLUE)  # the restart memory counts them


def test_base64_and_data_urls_inside_the_frame() -> None:
    b64 = base64.b64encode(RED).decode()
    frame = parse(generate(b64, "data:image/png;base64," + b64))
    assert isinstance(frame, Generate) and frame.messages is not None
    assert frame.messages[0].images == (RED, RED)


def test_a_generate_takes_every_upload_accepted_or_refused() -> None:
    uploads = Uploads(1 << 20)
    upload(uploads, "a", RED)
    upload(uploads, "unused", BLUE)
    parse(generate({"upload": "a"}), uploads)
    assert len(uploads) == 0  # the unused one was dropped
    upload(uploads, "a", RED)
    refused = refusal(json.dumps({"type": "generate", "id": "g1"}), uploads)
    assert refused.code == "bad_request" and len(uploads) == 0
    # A cancel takes nothing.
    upload(uploads, "a", RED)
    parse(json.dumps({"type": "cancel", "id": "x"}), uploads)
    assert len(uploads) == 1


def test_an_unknown_upload_is_refused_naming_it_and_the_image() -> None:
    uploads = Uploads(1 << 20)
    b64 = base64.b64encode(RED).decode()
    refused = refusal(generate(b64, {"upload": "nope"}), uploads)
    assert refused.code == "bad_request" and refused.request_id == "g1"
    assert "image 1 (messages[0].images[1])" in refused.message
    assert "no upload 'nope'" in refused.message


def test_the_connections_ceiling_refuses_an_upload_and_a_request_that_names_it() -> None:
    uploads = Uploads(len(RED) + 10)
    upload(uploads, "a", RED)
    with pytest.raises(ProtocolError) as caught:
        upload(uploads, "b", BLUE)
    assert caught.value.code == "too_large" and caught.value.request_id == "b"
    assert "upload 'b' refused" in caught.value.message
    assert uploads.bytes == len(RED)
    upload(uploads, "b", BLUE)  # a later piece of a refused upload: dropped, said once
    assert uploads.bytes == len(RED)
    refused = refusal(generate({"upload": "a"}, {"upload": "b"}), uploads)
    assert "image 1" in refused.message and "it was refused" in refused.message
    # A piece that passes the ceiling drops its upload's earlier pieces too.
    uploads = Uploads(len(RED) - 1)
    with pytest.raises(ProtocolError):
        upload(uploads, "a", RED, pieces=2)
    assert uploads.bytes == 0
    with pytest.raises(ProtocolError) as caught:
        upload(Uploads(0), "a", RED)
    assert "takes no uploads" in caught.value.message


def test_at_most_max_images_uploads_wait() -> None:
    uploads = Uploads(1 << 20)
    for n in range(MAX_IMAGES):
        upload(uploads, f"u{n}", RED)
    with pytest.raises(ProtocolError) as caught:
        upload(uploads, "one-more", RED)
    assert caught.value.code == "too_large" and f"more than {MAX_IMAGES}" in caught.value.message
    uploads.add(parse_upload(b"u0\n" + RED[:1]))  # a known one may still grow
    assert len(uploads) == MAX_IMAGES


REFUSED = {
    "not a list": ({"content": "x", "images": "abc"}, "must be a list"),
    "a number": (
        {"content": "x", "images": [1]},
        'an image is a base64 string, a data: URL, or {"upload"',
    ),
    "bad base64": ({"content": "x", "images": ["!!"]}, "not valid base64"),
    "not an image": (
        {"content": "x", "images": [base64.b64encode(b"hello").decode()]},
        "not a PNG",
    ),
    "bomb": (
        {"content": "x", "images": [base64.b64encode(png_header_only(50_000, 50_000)).decode()]},
        "claims 50000x50000 pixels",
    ),
    "too many": (
        {"content": "x", "images": [base64.b64encode(RED).decode()] * (MAX_IMAGES + 1)},
        f"at most {MAX_IMAGES} images",
    ),
    "a typed marker": (
        {"content": IMAGE_MARKER, "images": [base64.b64encode(RED).decode()]},
        IMAGE_MARKER,
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_images_are_refused_naming_the_field(case: str) -> None:
    message, said = REFUSED[case]
    text = json.dumps({"type": "generate", "id": "g1", "messages": [{"role": "user", **message}]})
    refused = refusal(text)
    assert refused.code == "bad_request" and refused.request_id == "g1"
    assert said in refused.message and "messages[0]" in refused.message, refused.message


def test_only_a_user_message_carries_images_and_a_prompt_none() -> None:
    b64 = base64.b64encode(RED).decode()
    refused = refusal(generate(b64, role="assistant"))
    assert "only a user message carries images" in refused.message
    refused = refusal(json.dumps({"type": "generate", "id": "g1", "prompt": "p", "images": [b64]}))
    assert "unknown field" in refused.message


def test_a_restart_reads_images_and_takes_uploads_too() -> None:
    uploads = Uploads(1 << 20)
    upload(uploads, "a", RED)
    message = {"role": "user", "content": "x", "images": [{"upload": "a"}]}
    frame = parse(
        json.dumps({"type": "restart", "id": "g1", "new_id": "g2", "messages": [message]}),
        uploads,
    )
    assert isinstance(frame, Restart) and frame.overrides["messages"][0].images == (RED,)
    assert len(uploads) == 0


def test_messages_without_images_are_as_before() -> None:
    text = json.dumps(
        {"type": "generate", "id": "g1", "messages": [{"role": "user", "content": IMAGE_MARKER}]}
    )
    frame = parse(text)
    assert isinstance(frame, Generate) and frame.messages is not None
    assert frame.messages[0].content == IMAGE_MARKER and frame.messages[0].images == ()


def test_the_python_clients_packing_round_trips_through_the_servers_core() -> None:
    from wsserver_client.images import pack_images

    ids = iter(f"img-{n}" for n in range(10))
    limits = Limits(max_frame_bytes=100, max_upload_bytes=1 << 20)
    given = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "Look", "images": [RED, bytearray(BLUE), {"base64": "AAAA"}]},
    ]
    messages, frames = pack_images(given, limits, lambda: next(ids))
    assert messages is not None and given[1]["images"][0] == RED  # not changed in place
    assert messages[1]["images"] == [{"upload": "img-0"}, {"upload": "img-1"}, "AAAA"]
    assert all(len(frame) <= 100 for frame in frames) and len(frames) > 2
    uploads = Uploads(1 << 20)
    for frame in frames:
        uploads.add(parse_upload(frame))
    messages[1]["images"].pop()  # (AAAA is no image)
    parsed = parse(json.dumps({"type": "generate", "id": "g", "messages": messages}), uploads)
    assert isinstance(parsed, Generate) and parsed.messages is not None
    assert parsed.messages[1].images == (RED, BLUE)
    # Without uploads (a server before them, or uploads off): base64.
    messages, frames = pack_images(given, Limits(), lambda: next(ids))
    assert frames == [] and messages is not None
    assert messages[1]["images"][:2] == [
        base64.b64encode(RED).decode(),
        base64.b64encode(BLUE).decode(),
    ]
    assert pack_images(None, limits, lambda: "x") == (None, [])


def test_an_upload_that_lost_a_piece_elsewhere_is_dropped_and_named() -> None:
    uploads = Uploads(1 << 20)
    upload(uploads, "a", RED, pieces=2)
    uploads.fail("a", "a piece of it was refused (rate_limited)")
    assert uploads.bytes == 0 and len(uploads) == 0
    upload(uploads, "a", RED)  # its later pieces: dropped
    assert uploads.bytes == 0
    refused = refusal(generate({"upload": "a"}), uploads)
    assert "it was refused: a piece of it was refused (rate_limited)" in refused.message
