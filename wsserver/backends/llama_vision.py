"""A model's vision projector, through llama.cpp's libmtmd (``llama_cpp.mtmd_cpp``).

Loading: the projector GGUF is checked from its header first
(:mod:`.mmproj_check`: libmtmd dereferences missing tensors inside
``mtmd_init_from_file``'s warm-up encode, which kills the process), then
libmtmd loads it against the text model (it refuses a projector whose output
width is not the model's). A refusal from either is the model's
``model_load_failed``, naming the projector and what is wrong.

A prompt with images (:meth:`Vision.tokenize`, on a worker thread): each
image is decoded from its bytes (``mtmd_helper_bitmap_init_from_buf``:
stb_image), then ``mtmd_tokenize`` splits the rendered prompt at its
markers into text chunks (their tokens, as the engine's) and image chunks
(preprocessed pixels). An image's chunk stands in the prompt as
``n_tokens`` positions holding one *negative* number derived from the
image's content (:func:`image_key`): no vocabulary token, so the samplers'
history skips them and the batcher never puts them in a token batch
(:meth:`.Job.text_end`).

The key is the image's prefix-cache key. It is a hash of the *decoded*
bitmap — its width, height and RGB bytes, what the chunk's pixels are made
from — not of the file (libmtmd's helper sets the sha256 of the encoded
bytes as the bitmap's id; two encodings of the same pixels would differ):
:func:`bitmap_key` replaces that id, libmtmd carries it to the image's chunk
(``mtmd_input_chunk_get_id``), and :func:`image_key` keeps 62 bits of it,
negated. The same pixels through the same projector (one per loaded model,
whose cache dies with its context) thus stand as the same positions, and
the prompt cache (:meth:`.PromptCache.claim`, in a slot or from host
memory) reuses an image's cells like text's: a follow-up question about the
same picture after the same conversation is neither encoded nor decoded
again. A match that ends inside an image is cut back to its start
(:func:`.llama_sequences.whole_images`).

A sound (a WAV, MP3 or FLAC file among a message's ``images``, told apart by
its bytes as libmtmd's helper tells them: :func:`.audio_check.is_audio`) is
decoded by miniaudio into 16 kHz samples — its length was bounded from its
header first, and is again once decoded — and ``mtmd_tokenize`` makes a
chunk of every 30 s window of its log-mel spectrogram, one position per
embedding; its key hashes the decoded PCM samples, and every window of it
carries that key. From there a window is an image to the engine.

In the engine (:class:`ImageDecoder`, on its thread): when a sequence's
prompt reaches an image, that step first encodes the image
(``mtmd_encode_chunk``: the projector's graph, one native call no cancel
reaches) and then decodes its embeddings into the sequence's positions with
``llama_decode`` on an embeddings batch, under the context's abort flag like
any prompt chunk — so the finest cancel point during an image is the end of
its encode, and inside the embeddings' decode ggml's graph node.

Most projectors' embeddings are decoded like prompt tokens, causally, a
prompt share a step. Gemma 3's are not (``mtmd_decode_use_non_causal``): an
image's tokens attend to each other both ways, so all of them go in **one**
``llama_decode`` with the context's causal attention off (and back on after,
whatever the decode returned) — in one micro-batch, which llama.cpp asserts
(a process abort) for non-causal attention: :func:`load_vision` refuses a
context whose ``n_ubatch`` cannot hold one image, and :meth:`Vision.tokenize`
an image bigger than that. A model that places images at M-RoPE positions
(``mtmd_decode_use_mrope``: Qwen2-VL's) is refused at load: the engine
writes one position a token.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd

from ..core.audio_check import MAX_AUDIO_SECONDS, is_audio
from ..errors import BackendError, ModelLoadError
from .llama_context import log_bridge
from .mmproj_check import Projector, ProjectorError, check_projector

__all__ = [
    "ImageChunk",
    "ImageDecoder",
    "ImageSpan",
    "Vision",
    "bitmap_key",
    "image_key",
    "load_vision",
]


def bitmap_key(bitmap: Any) -> bytes:
    """A decoded bitmap's content key (hex sha256 of its size and pixels, or
    of a sound's count of samples and its float PCM samples): the id
    :meth:`Vision.tokenize` gives it, which libmtmd copies to its chunks."""
    nx, ny = mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap)
    size = mtmd.mtmd_bitmap_get_n_bytes(bitmap)
    if mtmd.mtmd_bitmap_is_audio(bitmap):
        digest = hashlib.sha256(b"%d audio samples, %d bytes:" % (nx, size))
    else:
        digest = hashlib.sha256(b"%d x %d pixels, %d bytes:" % (nx, ny, size))
    data = mtmd.mtmd_bitmap_get_data(bitmap)
    if size and data:  # read in place (hashlib lets the GIL go for large buffers)
        digest.update(ctypes.cast(data, ctypes.POINTER(ctypes.c_uint8 * size)).contents)
    return digest.hexdigest().encode()


def image_key(chunk_id: bytes) -> int:
    """The number an image's positions hold, from its chunk's id (a hex
    :func:`bitmap_key`): 62 of its bits, negated, so from -1 to -2**62 —
    never a vocabulary token, and two images meet on it with a chance of
    2**-62."""
    return -1 - (int(chunk_id[:16], 16) >> 2)


class ImageChunk:
    """An image's chunk from ``mtmd_tokenize`` (its preprocessed pixels),
    owned: freed when the last request holding it lets it go."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: Any) -> None:
        self.ptr = ptr

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            mtmd.mtmd_input_chunk_free(ptr)


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image (or a sound's 30 s window) in a prompt: its first position
    and how many it takes."""

    start: int
    n_tokens: int
    chunk: ImageChunk
    #: "image", or "sound" (an audio chunk), for what the engine says it does.
    kind: str = "image"


log = logging.getLogger("wsserver.llama.vision")


class Vision:
    """A loaded projector: libmtmd's context for one text model."""

    def __init__(self, ctx: Any, projector: Projector, path: Path) -> None:
        self.ctx = ctx
        self.projector = projector
        self.path = path
        #: Its images are decoded non-causally, each in one micro-batch of at
        #: most ``most`` tokens (the context's ``n_ubatch``): :func:`load_vision`.
        self.whole, self.most = False, 0
        #: libmtmd's context is not thread-safe: tokenizing (a worker thread)
        #: and encoding (the engine) take turns.
        self.lock = threading.Lock()
        self._decoder: ImageDecoder | None = None
        #: The rate libmtmd resamples sound to (Hz; 0: no audio encoder).
        self.sample_rate = max(1, mtmd.mtmd_get_audio_sample_rate(ctx)) if projector.audio else 0

    def decoder(self, ctx: Any, n_batch: int) -> ImageDecoder:
        """The engine's decoder of this projector's images into ``ctx`` (freed with it)."""
        self._decoder = ImageDecoder(self, ctx, max(n_batch, self.most) if self.whole else n_batch)
        return self._decoder

    def tokenize(
        self, text: str, images: Sequence[bytes], *, add_special: bool
    ) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """``text``'s tokens with ``images`` at its markers (see the module
        docstring). ``BackendError`` (``bad_request``) names an image that
        does not decode, or a prompt whose markers do not match its images."""
        bitmaps: list[Any] = []
        chunks = mtmd.mtmd_input_chunks_init()
        counts, seconds = {"image": 0, "audio": 0}, 0.0
        try:
            for data in images:
                kind = "audio" if is_audio(data) else "image"
                name = f"{kind} {counts[kind]}"
                counts[kind] += 1
                if not (self.projector.audio if kind == "audio" else self.projector.vision):
                    what = "audio" if kind == "audio" else "images"
                    raise BackendError(
                        f"{name}: this model takes no {what} (its projector has no "
                        f"{'audio' if kind == 'audio' else 'vision'} encoder)",
                        code="bad_request",
                    )
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
                if not bitmap:
                    what = "sound" if kind == "audio" else "pixels"
                    raise BackendError(
                        f"{name}: its {what} could not be decoded", code="bad_request"
                    )
                bitmaps.append(bitmap)
                if kind == "audio":
                    # The header's claim was bounded (core.audio_check); what
                    # miniaudio made of the bytes is bounded again.
                    seconds += mtmd.mtmd_bitmap_get_nx(bitmap) / self.sample_rate
                    if seconds > MAX_AUDIO_SECONDS + 1:
                        raise BackendError(
                            f"{name}: the request's audio decodes to {seconds:.1f} s, over "
                            f"{MAX_AUDIO_SECONDS} s",
                            code="bad_request",
                        )
                mtmd.mtmd_bitmap_set_id(bitmap, bitmap_key(bitmap))
            given = mtmd.mtmd_input_text()
            encoded = text.encode("utf-8")
            given.text, given.text_len = encoded, len(encoded)
            given.add_special, given.parse_special = add_special, True
            array = (mtmd.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            with self.lock:
                status = mtmd.mtmd_tokenize(
                    self.ctx, chunks, ctypes.byref(given), array, len(bitmaps)
                )
            if status != 0:
                raise BackendError(
                    f"the prompt's {len(images)} image(s) and sound(s) could not be placed "
                    f"(libmtmd: {status}; did the chat template drop a message with one?)",
                    code="bad_request",
                )
            tokens, spans = _flatten(chunks)
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            for bitmap in bitmaps:
                mtmd.mtmd_bitmap_free(bitmap)
        for span in spans if self.whole else ():
            if span.n_tokens > self.most:
                raise BackendError(
                    f"an image is {span.n_tokens} tokens, decoded in one micro-batch here "
                    f"(non-causal attention) of at most {self.most} (n_ubatch)",
                    code="bad_request",
                )
        return tokens, spans

    @property
    def modalities(self) -> tuple[str, ...]:
        """What the model takes in: text, and what the projector encodes."""
        kinds = ["text"]
        if mtmd.mtmd_support_vision(self.ctx):
            kinds.append("image")
        if mtmd.mtmd_support_audio(self.ctx):
            kinds.append("audio")
        return tuple(kinds)

    def close(self) -> None:
        decoder, self._decoder = self._decoder, None
        if decoder is not None:
            decoder.free()
        ctx, self.ctx = self.ctx, None
        if ctx:
            mtmd.mtmd_free(ctx)


def _flatten(chunks: Any) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The chunks as one prompt: text tokens, each image's positions."""
    tokens: list[int] = []
    spans: list[ImageSpan] = []
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        kind = mtmd.mtmd_input_chunk_get_type(chunk)
        if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
            count = ctypes.c_size_t(0)
            text = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
            pieces = [text[k] for k in range(count.value)]
            if any(token < 0 for token in pieces):
                # libmtmd looks an image's marker text up in the vocabulary
                # (Idefics3's <fake_token_around_image>) and puts -1 where it is not.
                raise BackendError(
                    "libmtmd placed a token the text model's vocabulary lacks around an "
                    "image (the projector's image markers: is this its text model?)",
                    code="internal",
                )
            tokens.extend(pieces)
            continue
        if kind not in (mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE, mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO):
            raise BackendError(f"libmtmd gave a chunk of type {kind}", code="internal")
        n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        # One position per embedding: what the checked projectors make (an
        # audio chunk always: libmtmd's n_pos is its n_tokens); M-RoPE models
        # (Qwen2-VL) would differ and are not let through.
        assert mtmd.mtmd_input_chunk_get_n_pos(chunk) == n_tokens
        key = mtmd.mtmd_input_chunk_get_id(chunk)
        if not key:  # a libmtmd that does not carry the bitmap's id to its chunk
            raise BackendError("libmtmd gave an image's chunk no id", code="internal")
        owned = ImageChunk(mtmd.mtmd_input_chunk_copy(chunk))
        sound = kind == mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO
        spans.append(ImageSpan(len(tokens), n_tokens, owned, "sound" if sound else "image"))
        tokens.extend([image_key(key)] * n_tokens)
    if spans and spans[-1].start + spans[-1].n_tokens == len(tokens):
        # The last position's logits start the answer: a prompt's end is text.
        raise BackendError(
            "the prompt ends with an image or a sound; add text after it", code="bad_request"
        )
    return tokens, tuple(spans)


class ImageDecoder:
    """The engine's side: one image of a sequence's prompt into its KV cells
    (see the module docstring). Used on the engine thread only."""

    def __init__(self, vision: Vision, ctx: Any, n_batch: int) -> None:
        self.vision = vision
        self.ctx = ctx
        self.n_batch = n_batch
        #: An image's embeddings go in one decode, attention non-causal.
        self.whole = vision.whole
        self.n_embd = llama_cpp.llama_model_n_embd(llama_cpp.llama_get_model(ctx))
        self.batch = llama_cpp.llama_batch_init(n_batch, self.n_embd, 1)

    def encode(self, span: ImageSpan) -> Any:
        """The image's embeddings (``n_tokens`` x ``n_embd`` floats), copied
        out of libmtmd's buffer; ``None``: the encode failed."""
        size = span.n_tokens * self.n_embd
        with self.vision.lock:
            if mtmd.mtmd_encode_chunk(self.vision.ctx, span.chunk.ptr) != 0:
                return None
            out = mtmd.mtmd_get_output_embd(self.vision.ctx)
            embeddings = (ctypes.c_float * size)()
            ctypes.memmove(embeddings, out, size * ctypes.sizeof(ctypes.c_float))
        return embeddings

    def piece(self, span: ImageSpan, share: int) -> int:
        """How many of ``span``'s embeddings a step decodes at most, given
        the step's prompt ``share``: the whole image where its attention is
        non-causal (half an image's cells are not what the whole makes)."""
        return span.n_tokens if self.whole else min(share, self.n_batch)

    def decode(self, embeddings: Any, offset: int, count: int, seq: int, pos: int) -> int:
        """Embeddings ``offset`` to ``offset + count`` (at most ``n_batch``)
        into sequence ``seq`` from position ``pos``: ``llama_decode``'s
        status (2: aborted by the context's abort flag). A non-causal
        projector's image goes whole, causal attention off meanwhile."""
        if not self.whole:
            return self._decode(embeddings, offset, count, seq, pos)
        causal = llama_cpp.llama_get_causal_attn(self.ctx)
        llama_cpp.llama_set_causal_attn(self.ctx, False)
        try:
            return self._decode(embeddings, offset, count, seq, pos)
        finally:  # also when aborted, failed or raised
            llama_cpp.llama_set_causal_attn(self.ctx, causal)

    def _decode(self, embeddings: Any, offset: int, count: int, seq: int, pos: int) -> int:
        b, width = self.batch, self.n_embd
        size = ctypes.sizeof(ctypes.c_float) * width
        ctypes.memmove(b.embd, ctypes.byref(embeddings, offset * size), count * size)
        for i in range(count):
            b.pos[i] = pos + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = False
        b.n_tokens = count
        return int(llama_cpp.llama_decode(self.ctx, b))

    def free(self) -> None:
        llama_cpp.llama_batch_free(self.batch)


def load_vision(path: str | Path, context: Any, n_threads: int) -> Vision:
    """Check the projector at ``path`` and load it for ``context``'s model
    (a ``llama_context`` pointer), on the CPU. Blocking;
    :class:`ModelLoadError` on refusal."""
    model = llama_cpp.llama_get_model(context)
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"projector file not found: {path}")
    text_width = llama_cpp.llama_model_n_embd(model)
    try:
        projector = check_projector(path, text_width=text_width)
    except ProjectorError as exc:
        raise ModelLoadError(f"projector {path} refused: {exc}") from None
    mtmd.mtmd_log_set(log_bridge(), ctypes.c_void_p(0))
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False  # the text model's n_gpu_layers says nothing of the projector
    params.n_threads = n_threads
    params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(str(path).encode(), model, params)
    if not ctx:
        raise ModelLoadError(f"projector {path}: libmtmd could not load it (see the log)")
    try:
        vision = _fitted(Vision(ctx, projector, path), context)
    except BaseException:
        mtmd.mtmd_free(ctx)
        raise
    log.info(
        "projector %s (%s): %s%s",
        path,
        projector.projector_type,
        ", ".join(
            (
                [f"{projector.image_size}-pixel images, {projector.image_tokens} tokens each"]
                if projector.vision
                else []
            )
            + (["audio"] if projector.audio else [])
        ),
        ", decoded whole (non-causal)" if vision.whole else "",
    )
    return vision


def _fitted(vision: Vision, context: Any) -> Vision:
    """``vision``, its decode fitted to ``context``, or :class:`ModelLoadError`:
    M-RoPE positions, a vocabulary without the projector's image markers, or
    a non-causal image no micro-batch of the context holds."""
    where = f"projector {vision.path}"
    if mtmd.mtmd_decode_use_mrope(vision.ctx):
        raise ModelLoadError(
            f"{where}: its text model places images at M-RoPE positions (Qwen2-VL, "
            "Qwen2.5-VL and the like), which the engine does not write"
        )
    if not vision.projector.vision:  # an audio encoder alone: no image to place
        return vision
    # One blank image through libmtmd's own preprocessing and tokenizer: the
    # markers it puts around an image are in the vocabulary, and how many
    # tokens its largest chunk takes (Gemma 3: every image alike).
    pixels = (ctypes.c_uint8 * 3)()
    bitmap = mtmd.mtmd_bitmap_init(1, 1, pixels)
    mtmd.mtmd_bitmap_set_id(bitmap, bitmap_key(bitmap))
    chunks = mtmd.mtmd_input_chunks_init()
    given = mtmd.mtmd_input_text()
    text = f"x{mtmd.mtmd_default_marker().decode()}x".encode()
    given.text, given.text_len = text, len(text)
    given.add_special, given.parse_special = False, True
    try:
        array = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        if mtmd.mtmd_tokenize(vision.ctx, chunks, ctypes.byref(given), array, 1) != 0:
            raise ModelLoadError(f"{where}: libmtmd could not place an image in a prompt")
        _, spans = _flatten(chunks)
    except BackendError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
    if not mtmd.mtmd_decode_use_non_causal(vision.ctx, None):
        return vision
    tokens = max(span.n_tokens for span in spans)
    most = min(llama_cpp.llama_n_ubatch(context), llama_cpp.llama_n_batch(context))
    if tokens > most:
        raise ModelLoadError(
            f"{where}: an image is {tokens} tokens, decoded non-causally in one micro-batch, "
            f"but the context's n_ubatch is {most}: set backend.llama n_ubatch and n_batch "
            f"to at least {tokens}"
        )
    vision.whole, vision.most = True, most
    return vision
