"""A request's prompt for the llama engine: its tokens, stop strings and images.

A raw ``prompt`` is tokenized as llama-cpp-python's ``create_completion``
does (BOS, then the text with special tokens parsed); chat ``messages`` go
through the model's chat template or the plain-text fallback
(:mod:`.llama_chat`). A chat with images is tokenized by libmtmd instead
(:meth:`.llama_vision.Vision.tokenize`): the same text tokens, and each
image's positions at its marker.
"""

from __future__ import annotations

from ..core.audio_check import is_audio
from ..errors import BackendError
from .llama_chat import LlamaChat
from .llama_vision import ImageSpan, Vision
from .llama_vocab import Vocabulary
from .request import GenerationRequest

__all__ = ["Media", "render_prompt"]

#: A prompt's images, in order.
Media = tuple[ImageSpan, ...]


def render_prompt(
    request: GenerationRequest, *, vocab: Vocabulary, chat: LlamaChat, vision: Vision | None
) -> tuple[list[int], tuple[str, ...], Media]:
    """The prompt's tokens, its stop strings and its images. ``bad_request``
    for a prompt of no tokens (the input's fault: an empty prompt, a chat
    template that rendered nothing) or images the model cannot take."""
    stops = tuple(request.stop)
    if request.prompt is not None:
        tokens = vocab.bos + vocab.tokenize(request.prompt, add_bos=False)
        if not tokens:
            raise BackendError("the prompt is empty", code="bad_request")
        return tokens, stops, ()
    text, more_stops, fallback = chat.prompt(request)
    images = [image for m in request.messages or () for image in m.images]
    if images:  # the fallback's BOS as a special token; a template writes its own
        if vision is None:
            first = (
                "audio 0: this model takes no audio"
                if is_audio(images[0])
                else ("image 0: this model takes no images")
            )
            raise BackendError(first, code="bad_request")
        tokens, media = vision.tokenize(text, images, add_special=fallback)
        return tokens, stops + more_stops, media
    if fallback:
        return vocab.bos + vocab.tokenize(text, add_bos=False), stops + more_stops, ()
    # The template writes the BOS token itself (as llama-cpp-python's chat handlers assume).
    tokens = vocab.tokenize(text, add_bos=False)
    if not tokens:
        raise BackendError(
            "the model's chat template rendered an empty prompt for these messages",
            code="bad_request",
        )
    return tokens, stops + more_stops, ()
