"""Images in a chat request: taken from the wire, checked from their headers (sans-I/O).

Every wire gives images its own way — OpenAI's ``image_url`` parts with a
``data:`` URL, Anthropic's and Ollama's base64, the Responses API's
``input_image``, the WebSocket protocol's ``images`` (base64, or uploads in
binary frames: :mod:`.frame_images`, :mod:`.uploads`) — and every one ends
in :class:`ImageBudget` (:mod:`.image_check`): the bytes decoded from base64,
then judged **from the header alone**, before any decoder sees them. What is
refused names the image by its index in the request (``image 2``):

* a format llama.cpp's decoder (stb_image) does not read: PNG, JPEG, GIF and
  BMP are taken, anything else — WebP, HEIC, bytes that are no image — is
  refused;
* zero-size images, and images whose header claims a side over
  :data:`MAX_IMAGE_SIDE`, or more than :data:`MAX_IMAGE_PIXELS` pixels — one
  image, or the request's images together, since they are decoded together
  (at 3 bytes a pixel: ~100 MB at most per request): a 50,000 x 50,000 PNG
  is a few kilobytes that would decode to 7.5 GB (a decompression bomb), so
  the claim is refused, not tested;
* more than :data:`MAX_IMAGES` images, or more than :data:`MAX_IMAGE_BYTES`
  encoded bytes, in one request.

An image's pixels may still be corrupt past a valid header; the engine's
decoder then refuses it (the request ends with ``bad_request`` naming it).

``http(s)`` URLs, where a wire may give them, are an
:class:`~.image_check.ImageUrl` in their message's ``fetch`` (their image
``b""``): the asyncio layer fetches them behind the operator's allow-list, or
refuses them (off by default: fetching on a client's behalf is a server-side
request forgery risk; docs/images.md), and :func:`fill_images` puts the bytes
in place, every image of the request checked again, in order, as one budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from .chat_input import IMAGE_MARKER, Message
from .client_frames import Generate
from .image_check import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGE_SIDE,
    MAX_IMAGES,
    Fail,
    ImageBudget,
    ImageUrl,
    image_size,
    not_fetched,
)

__all__ = [
    "IMAGE_MARKER",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "ImageBudget",
    "ImageUrl",
    "carry_images",
    "fill_images",
    "given_images",
    "image_size",
    "image_urls",
    "not_fetched",
    "with_images",
    "with_urls",
]


def with_images(
    messages: tuple[Message, ...], images: Mapping[int, Sequence[bytes | ImageUrl]], fail: Fail
) -> tuple[Message, ...]:
    """``messages`` with their images (by message index), each message's
    markers counted against them: a client's text that holds the marker
    itself is refused (it would claim an image it did not send). An
    :class:`ImageUrl` goes to the message's ``fetch``, its image ``b""``."""
    out = list(messages)
    for index, message in enumerate(messages):
        given = tuple(images.get(index, ()))
        if message.content.count(IMAGE_MARKER) != len(given):
            raise fail(
                f"messages[{index}]: its text contains {IMAGE_MARKER!r}, which marks an "
                "image's place here; remove it"
            )
        if given:
            if message.role != "user":
                raise fail(f"messages[{index}]: only a user message may carry images")
            out[index] = with_urls(message, given)
    return tuple(out)


def with_urls(message: Message, images: Sequence[bytes | ImageUrl]) -> Message:
    """``message`` with ``images``: an :class:`ImageUrl` in its ``fetch``, its image ``b""``."""
    return dataclasses.replace(
        message,
        images=tuple(b"" if isinstance(i, ImageUrl) else i for i in images),
        fetch=tuple(i for i in images if isinstance(i, ImageUrl)),
    )


def given_images(message: Message) -> list[bytes | ImageUrl]:
    """A message's images as a dialect gave them: a URL where it is to be fetched."""
    urls = iter(message.fetch)
    return [image or next(urls) for image in message.images]


def image_urls(messages: Sequence[Message] | None) -> list[ImageUrl]:
    """The image URLs of a request's messages, in order (to fetch)."""
    return [url for message in messages or () for url in message.fetch]


def fill_images(
    messages: tuple[Message, ...], fetched: Mapping[int, bytes], fail: Fail
) -> tuple[Message, ...]:
    """``messages`` with their URLs' images in place (``fetched``: bytes by
    image index), every image of the request checked again, in order, as one
    budget: a fetched image passes the checks a data URL's does (format,
    header, pixels, the request's bytes and pixels together)."""
    budget = ImageBudget(fail)
    out = []
    for at, message in enumerate(messages):
        urls: Iterator[ImageUrl] = iter(message.fetch)
        images = []
        for image in message.images:
            if image:
                images.append(budget.take(image, f"messages[{at}]"))
            else:
                url = next(urls)
                images.append(budget.take(fetched[url.index], url.where))
        out.append(dataclasses.replace(message, images=tuple(images), fetch=()))
    return tuple(out)


def carry_images(
    generate: Generate, messages: Sequence[Message], offset: int, fail: Fail
) -> Generate:
    """``generate`` (parsed from a frame, which carries no bytes) with the
    images of ``messages``, the dialect's messages it was made of, at
    ``offset`` (the messages the dialect put before them: a system prompt)."""
    images = {offset + i: given_images(m) for i, m in enumerate(messages) if m.images}
    if not images or generate.messages is None:
        return generate
    return dataclasses.replace(generate, messages=with_images(generate.messages, images, fail))
